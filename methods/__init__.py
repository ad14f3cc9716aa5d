"""KV methods: one module of policy per method, registered by name.

A method is one module: its ``Params`` dataclass (deriving from the shared bases in
:mod:`kvbench.methods.params`) and a :class:`~kvbench.engine.protocol.KVMethod` subclass decorated with
:func:`register`, which makes it available as ``method=<name>``. :data:`PARAMS` maps every name to its
parameters, read from the modules' sources (:mod:`kvbench.declarations`), which is also Hydra's
``method`` config group.

Importing this package stays light (no torch): the CLI checks ``method.*`` settings with
:func:`validate_method_config` before anything heavy loads; the method classes are imported when a
method is created or listed.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError
from kvbench.params import Params, defaults, parse
from kvbench.registry import Registry

if TYPE_CHECKING:
    from kvbench.engine.protocol import KVMethod, Selection

REGISTRY: Registry[KVMethod] = Registry(
    "method",
    __name__,
    exclude={
        "eviction",
        "reuse",
        "selection",
        "primitives",
        "retrieval",
        "attention_scores",
        "pqcache_cost",
        "pqcache_workers",
        "params",
    },
)


class _DeclaredParams(Mapping[str, "type[Params]"]):
    """``method=<name>`` -> its ``Params``, read on first use from the sources of this package's modules
    (:func:`kvbench.declarations.read_declaration`: about 0.1 s for all of them, no torch)."""

    def __init__(self) -> None:
        self._entries: dict[str, type[Params]] | None = None

    def _load(self) -> dict[str, type[Params]]:
        if self._entries is None:
            from kvbench.declarations import read_declaration

            entries: dict[str, type[Params]] = {}
            for module in pkgutil.iter_modules(__path__):
                if module.name in REGISTRY.exclude or module.name.startswith("_"):
                    continue
                declared = read_declaration(f"{__name__}.{module.name}")
                if declared.name is not None and declared.params is not None:
                    entries[declared.name] = declared.params
            self._entries = entries
        return self._entries

    def __getitem__(self, name: str) -> type[Params]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


#: ``method=<name>`` → its parameters, as each method's module declares them. ``full`` has none: it
#: attends everything, so a sink or a window share would be a setting it silently ignores.
PARAMS: Mapping[str, type[Params]] = _DeclaredParams()


def register(cls: type[KVMethod]) -> type[KVMethod]:
    """Make ``cls`` available as ``method=<cls.name>``. A shipped method (a module of this package)
    declares its ``Params`` in its own module and sets it in the class body (``Params = H2OParams``;
    none for a method without parameters), which is what :data:`PARAMS` reads; classes registered
    elsewhere (tests, notebooks) may take their ``Params`` from anywhere."""
    if cls.__module__.startswith(f"{__name__}.") and "Params" in cls.__dict__ and cls.Params is not Params:
        if cls.Params.__module__ != cls.__module__:
            raise ValueError(
                f"method {cls.name!r}: declare its Params in its own module ({cls.__module__}), "
                f"not in {cls.Params.__module__}"
            )
    elif cls.__module__.startswith(f"{__name__}.") and cls.Params is not Params:
        raise ValueError(f"method {cls.name!r}: set {cls.__name__}.Params in the class body")
    return REGISTRY.register(cls)


def available_methods() -> list[str]:
    return REGISTRY.names()


def create_method(cfg: Mapping[str, Any]) -> KVMethod:
    """Instantiate ``method=<name>`` with the rest of its config node as parameters."""
    params = dict(cfg)
    cls = REGISTRY.get(params.pop("name", None))
    return cls(params)


#: extra ``method=`` choices: a registered method with some parameters set, for sweeps that mix methods
#: (``method=full,h2o,pqcache_niah``), where a ``method.<key>=`` override would reach every method. The
#: run records the method's own name (``pqcache``) and the parameters, as if they had been given.
#: ``pqcache_niah``: PQCache as its authors' NIAH script runs it (``test_nah.py``: 10 k-means iterations).
#: ``pyramidkv_equal``: PyramidKV with its per-layer counts rounded so that the layers together keep what
#: uniform layers keep (``rounding: exact``), for comparisons at equal KV bytes (the PQCache tables).
METHOD_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "pqcache_niah": ("pqcache", {"protocol": "pqcache_niah"}),
    "pyramidkv_equal": ("pyramidkv", {"rounding": "exact"}),
    # CacheBlend with the check layer kvbench ran before 2026-11-29 (every row through attention and MLP)
    # and its chunks precomputed alone before each request (miss: precompute; the default since 2026-11-30
    # computes a missing chunk in the request's prefill): the recorded CacheBlend experiments ran it, and
    # their runs keep their ids (both keys at their legacy values)
    "cacheblend_allrows": ("cacheblend", {"check_rows": "all", "miss": "precompute"}),
}


def method_choices() -> list[str]:
    """Every ``method=`` choice: the registered methods and the presets."""
    return sorted([*PARAMS, *METHOD_PRESETS])


def method_node(name: str) -> dict[str, Any]:
    """The default config node of ``method=<name>``: ``{"name": name, **defaults}`` (a preset: its
    method's node with the preset's values)."""
    if name in METHOD_PRESETS:
        base, values = METHOD_PRESETS[name]
        return {**method_node(base), **values}
    if name not in PARAMS:
        raise ConfigError(f"unknown method {name!r}", f"choose one of: {', '.join(method_choices())} (`kvbench list`)")
    return {"name": name, **defaults(PARAMS[name])}


def validate_method_config(cfg: Mapping[str, Any]) -> Params:
    """Parse a method config node (``name`` plus parameters) without building the method.

    Cheap and torch-free, so ``kvbench run`` checks every point of a sweep before any job starts.
    Raises :class:`ConfigError` for an unknown method, an unknown key, a wrong type or a value out of
    range; returns the parsed parameters.
    """
    values = dict(cfg or {})
    name = values.pop("name", None)
    method_node(str(name))  # the unknown-method error
    return parse(PARAMS[str(name)], values, owner=f"method {name}", prefix="method.")


def __getattr__(attr: str) -> Any:
    """``KVMethod`` and ``Selection`` on first use (they import torch)."""
    if attr in ("KVMethod", "Selection"):
        from kvbench.engine import protocol  # (the engine owns the protocol)

        return getattr(protocol, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = [
    "KVMethod",
    "Selection",
    "register",
    "create_method",
    "available_methods",
    "REGISTRY",
    "PARAMS",
    "method_node",
    "validate_method_config",
]
