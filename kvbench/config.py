"""One run's configuration as typed groups, parsed once (issue 45, step 1).

Hydra composes a run's config into a plain dict (``resolved``: what ``config.yaml`` records and what the
run id hashes, :mod:`kvbench.results`). :meth:`RunConfig.parse` turns it, once, into the typed groups
the runner hands on — each group's own declaration does the parsing and checking:

* ``model`` — :class:`ModelConfig` (the name, the device asked for, and the node the loaders read:
  :mod:`kvbench.models.loading` takes the Hydra node, checked by :func:`kvbench.validate.check_model`);
* ``method`` / ``task`` — the method's and the task's ``Params`` (declared once, in
  each method's and each task's own module);
* ``budget`` — :class:`~kvbench.budget.BudgetConfig`; ``store`` — :class:`~kvbench.kv.chunks.StoreConfig`
  (``None`` for a method without a chunk store, whose run leaves ``store`` out of its config);
  ``profile`` — :class:`~kvbench.profile.Profile`; ``engine`` — :class:`~kvbench.engine.settings.EngineSettings`;
* the run-level keys ``output_dir``, ``progress`` and ``prefill_cache``.

The cross-group rules (a reuse method needs a chunked task, a budget must fit the task's lengths, ...)
stay one list of checks, :data:`kvbench.validate.CONFIG_CHECKS` and ``METHOD_CHECKS``, run on every
sweep point before anything loads. Importing this module loads no torch.
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
class RunConfig:
    """A run's configuration, typed (see the module docstring); built by :meth:`parse`."""

    model: ModelConfig
    method: Params
    task: Params
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
        (their ``params`` are the groups; else they are built here)."""
        from kvbench.budget import BudgetConfig
        from kvbench.engine.settings import engine_settings
        from kvbench.kv.chunks import StoreConfig
        from kvbench.profile import profile_settings

        if method is None:
            from kvbench.methods import create_method

            method = create_method(resolved["method"])
        if task is None:
            from kvbench.tasks import create_task

            task = create_task(resolved["task"])
        store = resolved.get("store")
        return cls(
            model=ModelConfig.parse(resolved.get("model")),
            method=method.params,
            task=task.params,
            budget=BudgetConfig.from_mapping(resolved.get("budget")),
            store=StoreConfig.from_mapping(store) if getattr(method, "uses_chunk_store", False) else None,
            profile=profile_settings(resolved.get("profile")),
            engine=engine_settings(resolved.get("engine")),
            output_dir=Path(str(resolved.get("output_dir") or DEFAULT_OUTPUT_DIR)).expanduser(),
            progress=bool(resolved.get("progress", True)),
            prefill_cache=resolved.get("prefill_cache"),
        )
