"""Tasks: one module (or folder) per benchmark family, registered by name (``task=<name>``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbench.registry import Registry
from kvbench.tasks.base import Sample, SampleResult, Task

REGISTRY: Registry[Task] = Registry(
    "task",
    __name__,
    exclude={
        "base",
        "metrics",
        "metrics_infinitebench",
        "scoring",
        "sources",
        "longbench_protocol",
        "params",
        "infinitebench_protocol",
        "rag_metrics",
        "rag_retrieval",
        "ruler_data",
        "ruler_protocol",
    },
)


def register(cls: type[Task]) -> type[Task]:
    """Register a task class (its parameters: ``cls.Params``, declared in its module)."""
    return REGISTRY.register(cls)


def available_tasks() -> list[str]:
    return REGISTRY.names()


def create_task(cfg: Mapping[str, Any]) -> Task:
    return REGISTRY.create(cfg)


__all__ = ["Task", "Sample", "SampleResult", "register", "create_task", "available_tasks", "REGISTRY"]
