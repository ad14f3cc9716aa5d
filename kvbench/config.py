"""One run's configuration as typed groups, parsed once (issue 45, step 1).

Hydra composes a run's config into a plain dict (``resolved``: what ``config.yaml`` records and what the
run id hashes, :mod:`kvbench.results`). :meth:`RunConfig.parse` turns it, once, into the typed groups
that the cross-group checks (:mod:`kvbench.validate`) and the runner read — each group's own declaration
does the parsing and checking:

* ``model`` — :class:`ModelConfig` (the name, the device asked for, and the node the loaders read:
  :mod:`kvbench.models.loading` takes the Hydra node, checked by :func:`kvbench.validate.check_model`);
* ``method`` — :class:`MethodConfig`: the name, the method's ``Params`` (declared in its module) and what
  its family implies for the other groups (a budget, a chunk store);
* ``task`` — :class:`TaskConfig`: the name, the task's ``Params`` (declared in its module), whether its
  prompts carry chunks and whether they are exactly ``task.lengths`` tokens;
* ``budget`` — :class:`~kvbench.budget.BudgetConfig`; ``store`` — :class:`~kvbench.kv.chunks.StoreConfig`
  (``None`` for a method without a chunk store, whose run leaves ``store`` out of its config);
  ``profile`` — :class:`~kvbench.profile.Profile`; ``engine`` — :class:`~kvbench.engine.settings.EngineSettings`;
* the run-level keys ``output_dir``, ``progress`` and ``prefill_cache``.

Parsing imports no torch for a shipped method: its parameters and family come from its declaration
(:data:`kvbench.methods.PARAMS`); a method registered elsewhere (tests, notebooks) is built to learn them.
Importing this module loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError

if TYPE_CHECKING:
    from kvbench.budget import BudgetConfig
    from kvbench.engine.settings import EngineSettings
    from kvbench.kv.chunks import StoreConfig
    from kvbench.params import Params
    from kvbench.profile import Profile

DEFAULT_OUTPUT_DIR = "results/runs"


@dataclass(frozen=True)
class ModelConfig:
    """The ``model`` group: its name, the device asked for (``auto``: CUDA when present) and the whole
    node, which the loaders read (``source``, ``asset``/``path``, ``dtype``, ``stop_tokens``, ...)."""

    name: str
    device: str
    node: Mapping[str, Any]

    @classmethod
    def parse(cls, node: Any) -> ModelConfig:
        if not isinstance(node, Mapping) or not node.get("name"):
            raise ConfigError("the model group has no name", "choose one with model=<name> (kvbench list models)")
        return cls(name=str(node["name"]), device=str(node.get("device") or "auto"), node=dict(node))


@dataclass(frozen=True)
class MethodConfig:
    """The ``method`` group: its name, its parameters, and what its family means for the other groups —
    ``needs_budget`` (it compresses: ``budget.*`` must be set and fit the prompts) and
    ``uses_chunk_store`` (it reuses chunk caches: it reads ``store.*`` and needs a chunked task)."""

    name: str
    params: Params
    family: str  # dense | eviction | retrieval | reuse
    needs_budget: bool
    uses_chunk_store: bool

    @classmethod
    def parse(cls, node: Mapping[str, Any], method: Any = None) -> MethodConfig:
        """From the config node; ``method``: the instance already built from it (else a shipped method is
        read from its declaration, without torch, and any other method is built)."""
        from kvbench.methods import METHOD_PRESETS, PARAMS, create_method, validate_method_config
        from kvbench.methods.params import family_of

        name = str(node.get("name"))
        if method is None and name in {*PARAMS, *METHOD_PRESETS}:
            params = validate_method_config(node)
            family = family_of(type(params))
            return cls(
                name=name,
                params=params,
                family=family,
                needs_budget=family in ("eviction", "retrieval"),
                uses_chunk_store=family == "reuse",
            )
        method = method if method is not None else create_method(node)
        return cls(
            name=method.name,
            params=method.params,
            family=method.family,
            needs_budget=bool(method.needs_budget),
            uses_chunk_store=bool(getattr(method, "uses_chunk_store", False)),
        )


@dataclass(frozen=True)
class TaskConfig:
    """The ``task`` group: its name, its parameters, whether its prompts carry chunk segments (what a reuse
    method needs) and whether they are exactly ``task.lengths`` tokens (checked against the model)."""

    name: str
    params: Params
    chunked: bool
    exact_lengths: bool

    @classmethod
    def parse(cls, node: Mapping[str, Any], task: Any = None) -> TaskConfig:
        """From the config node; ``task``: the instance already built from it (task modules are light)."""
        if task is None:
            from kvbench.tasks import create_task

            task = create_task(node)
        return cls(
            name=task.name,
            params=task.params,
            chunked=bool(task.chunked),
            exact_lengths=bool(getattr(task.params, "exact_lengths", False)),
        )

    def get(self, key: str, default: Any = None) -> Any:
        """A parameter by its ``task.<key>`` name (``None``-safe for keys only some tasks have)."""
        return getattr(self.params, key, default)


@dataclass(frozen=True)
class RunConfig:
    """A run's configuration, typed (see the module docstring); built by :meth:`parse`."""

    model: ModelConfig
    method: MethodConfig
    task: TaskConfig
    budget: BudgetConfig
    store: StoreConfig | None
    profile: Profile
    engine: EngineSettings
    output_dir: Path
    progress: bool
    prefill_cache: bool | None

    @classmethod
    def parse(cls, resolved: Mapping[str, Any], *, method: Any = None, task: Any = None) -> RunConfig:
        """The typed groups of ``resolved``. ``method`` / ``task``: the instances already built from it
        (else the groups are parsed from their declarations: :meth:`MethodConfig.parse`)."""
        from kvbench.budget import BudgetConfig
        from kvbench.engine.settings import engine_settings
        from kvbench.kv.chunks import StoreConfig
        from kvbench.profile import profile_settings

        method_config = MethodConfig.parse(resolved["method"], method)
        store = resolved.get("store")
        return cls(
            model=ModelConfig.parse(resolved.get("model")),
            method=method_config,
            task=TaskConfig.parse(resolved["task"], task),
            budget=BudgetConfig.from_mapping(resolved.get("budget")),
            store=StoreConfig.from_mapping(store) if method_config.uses_chunk_store else None,
            profile=profile_settings(resolved.get("profile")),
            engine=engine_settings(resolved.get("engine")),
            output_dir=Path(str(resolved.get("output_dir") or DEFAULT_OUTPUT_DIR)).expanduser(),
            progress=bool(resolved.get("progress", True)),
            prefill_cache=resolved.get("prefill_cache"),
        )
