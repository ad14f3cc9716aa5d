"""Name → class registries for methods and tasks, filled by the modules of a package.

Adding a method or a task is adding a module: every non-excluded module of the package is imported
on first use, and its classes register themselves with the decorator.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

from kvbench.errors import ConfigError


class Configured(Protocol):
    """What a registry holds: classes built from their config node (methods, tasks)."""

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None: ...


T = TypeVar("T", bound=Configured)


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str, exclude: set[str]) -> None:
        self.kind = kind
        self.package = package
        self.exclude = exclude
        self.entries: dict[str, type[T]] = {}
        self._discovered = False

    def register(self, cls: type[T]) -> type[T]:
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} has no name")
        if name in self.entries and self.entries[name] is not cls:
            raise ValueError(f"{self.kind} name {name!r} registered twice")
        self.entries[name] = cls
        return cls

    def discover(self) -> None:
        if self._discovered:
            return
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            if module.name not in self.exclude and not module.name.startswith("_"):
                importlib.import_module(f"{self.package}.{module.name}")
        self._discovered = True

    def names(self) -> list[str]:
        self.discover()
        return sorted(self.entries)

    def get(self, name: Any) -> type[T]:
        self.discover()
        if name not in self.entries:
            raise ConfigError(f"unknown {self.kind} {name!r}", f"choose one of: {', '.join(self.names())}")
        return self.entries[name]

    def create(self, cfg: Mapping[str, Any]) -> T:
        """Instantiate the entry named by ``cfg['name']``."""
        params = dict(cfg)
        cls = self.get(params.get("name"))
        return cls(params)
