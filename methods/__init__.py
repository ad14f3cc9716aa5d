"""KV methods: one module of policy per method, registered by name.

Every module in this package that defines a :class:`~kvbench.methods.base.KVMethod` subclass with a
``name`` and decorates it with :func:`register` becomes available as ``method=<name>``. Modules are
discovered on first use, so adding a method is adding a file (and its ``conf/method/<name>.yaml``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Mapping

from kvbench.errors import ConfigError
from kvbench.methods.base import KVMethod, Selection

METHODS: dict[str, type[KVMethod]] = {}
_NOT_METHODS = {"base", "selection", "primitives"}
_discovered = False


def register(cls: type[KVMethod]) -> type[KVMethod]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    METHODS[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _NOT_METHODS and not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    _discovered = True


def available_methods() -> list[str]:
    _discover()
    return sorted(METHODS)


def create_method(cfg: Mapping[str, Any]) -> KVMethod:
    """Instantiate ``method=<name>`` with the rest of its config node as parameters."""
    _discover()
    params = dict(cfg)
    name = params.pop("name", None)
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}", f"choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name](params)


__all__ = ["KVMethod", "Selection", "register", "create_method", "available_methods", "METHODS"]
