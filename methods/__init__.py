"""KV methods: one module of policy per method, registered by name.

Every module in this package that decorates a :class:`~kvbench.methods.base.KVMethod` subclass with
:func:`register` becomes available as ``method=<name>`` (with its ``conf/method/<name>.yaml``).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvbench.methods.base import KVMethod, Selection
from kvbench.registry import Registry

REGISTRY: Registry[KVMethod] = Registry("method", __name__, exclude={"base", "eviction", "reuse", "selection", "primitives", "retrieval", "attention_scores", "pqcache_cost"})
register = REGISTRY.register


def available_methods() -> list[str]:
    return REGISTRY.names()


def create_method(cfg: Mapping[str, Any]) -> KVMethod:
    """Instantiate ``method=<name>`` with the rest of its config node as parameters."""
    params = dict(cfg)
    cls = REGISTRY.get(params.pop("name", None))
    return cls(params)


__all__ = ["KVMethod", "Selection", "register", "create_method", "available_methods", "REGISTRY"]
