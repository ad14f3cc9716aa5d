"""Compose the Hydra config tree outside ``kvbench run`` (validation, dry runs, checks, reproductions).

``kvbench run -m`` sweeps are expanded here with Hydra's own parser and basic-sweeper rule (the
cartesian product of every comma list, ``range(...)``, ``glob(...)``), so that every point is composed
and validated before the first one runs. Hydra's parse errors become one line with the fix; the most
common one, a non-ASCII character in an unquoted value, says how to quote it.

The ``method`` and ``task`` config groups have no YAML files: :func:`register_method_configs` builds each
``method=<name>`` and ``task=<name>`` node from its parameter declarations (each method's and task's
module: :data:`kvbench.methods.PARAMS`, :data:`kvbench.tasks.params.TASK_PARAMS`), so the defaults exist
once. The nodes are plain dicts (OmegaConf need not understand ``Literal`` or union types);
:func:`kvbench.methods.validate_method_config` and the task's constructor check the values.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from kvbench.errors import ConfigError

CONFIG_MODULE = "kvbench.conf"
#: top-level keys a composed config may hold that are not part of a run (never hashed): Hydra's own, and
#: the ``reproduce:`` block of an experiment file (read by ``kvbench reproduce``, :mod:`kvbench.experiments`)
NOT_RUN_KEYS = ("hydra", "reproduce")


def register_method_configs() -> None:
    """Store every method's and every task's default node in Hydra's ConfigStore (groups ``method`` and
    ``task``); idempotent.
    Call before any compose or ``hydra.main``."""
    from hydra.core.config_store import ConfigStore

    from kvbench.methods import method_choices, method_node
    from kvbench.tasks.params import TASK_PARAMS

    store = ConfigStore.instance()
    for name in method_choices():
        store.store(group="method", name=name, node=method_node(name))
    for name in TASK_PARAMS:
        store.store(group="task", name=name, node=task_node(name))


def task_node(name: str) -> dict[str, Any]:
    """The default config node of ``task=<name>``: ``{"name": name, **defaults}`` from its parameters."""
    from kvbench.params import defaults
    from kvbench.tasks.params import TASK_PARAMS

    if name not in TASK_PARAMS:
        raise ConfigError(f"unknown task {name!r}", f"choose one of: {', '.join(TASK_PARAMS)} (`kvbench list`)")
    return {"name": name, **defaults(TASK_PARAMS[name])}


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """The resolved config (a plain dict, without ``hydra``) for ``overrides``."""
    return compose_many([overrides])[0]


def compose_many(points: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """The resolved configs of several override lists, composed within one Hydra initialisation."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_method_configs()
    resolved: list[dict[str, Any]] = []
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        for overrides in points:
            try:
                cfg = hydra_compose(config_name="config", overrides=list(overrides))
                # a composed config is a mapping with string keys
                config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
            except (HydraException, OmegaConfBaseException) as exc:
                raise override_error(exc, overrides) from None
            for key in NOT_RUN_KEYS:
                config.pop(key, None)
            resolved.append(config)
    return resolved


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """Every point of a ``-m`` sweep as a plain override list, in the order Hydra's basic sweeper runs
    them (the cartesian product of the sweep values, the first key varying slowest)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]
    except HydraException as exc:
        raise override_error(exc, overrides) from None


def merge_overrides(overrides: Sequence[str]) -> list[str]:
    """One override per key, the last one winning at the first one's place — how Hydra's basic sweeper
    merges an experiment's ``hydra.sweeper.params`` with the command line."""
    merged: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0] if "=" in item else item
        merged[key] = item
    return list(merged.values())


def shard_overrides(overrides: Sequence[str]) -> list[str]:
    """``task.shard=i/n`` as ``++task.shard=i/n``: no task config declares ``shard`` (so that unsharded
    runs keep their run ids), and Hydra only adds an undeclared key with a ``+``."""
    return [f"++{item}" if item.startswith("task.shard=") else item for item in overrides]


def is_sweep(overrides: Sequence[str]) -> list[str]:
    """The overrides that are sweeps (``a=1,2``, ``range(...)``), which need ``-m``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise override_error(exc, overrides) from None
    # (input_line is set on every override parsed from a line)
    return [o.input_line for o in parsed if o.is_sweep_override() and o.input_line is not None]


def override_error(exc: Exception, overrides: Sequence[str]) -> ConfigError:
    """One line for a Hydra/OmegaConf error about ``overrides``."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else type(exc).__name__
    odd = [o for o in overrides if not o.isascii()]
    if odd and ("Lexer" in first or "mismatched input" in first or "token recognition" in first):
        key, _, value = odd[0].partition("=")
        return ConfigError(
            f"{odd[0]!r}: Hydra reads non-ASCII characters only inside a quoted value",
            f"quote the value for Hydra and the whole override for the shell: '{key}=\"{value}\"'",
        )
    if "Ambiguous value for argument" in first:
        return ConfigError(
            f"{first.split('argument', 1)[1].strip()} is a sweep", "add -m to run every value (kvbench run -m ...)"
        )
    if "Lexer" in first or "mismatched input" in first or "token recognition" in first:
        return ConfigError(
            f"cannot parse the override {first.split(':', 1)[-1].strip()!r}",
            "write key=value; quote values with spaces or special characters: 'key=\"a value\"'",
        )
    return ConfigError(
        f"invalid override: {first}",
        "check the key's spelling against `kvbench list`, `kvbench run --help` and conf/ (new keys need a leading +)",
    )


def default_choice(group: str) -> str | None:
    """The option ``conf/config.yaml``'s defaults list picks for ``group`` (``method`` → ``full``)."""
    from importlib.resources import files

    from omegaconf import DictConfig, OmegaConf

    config = OmegaConf.load(str(files(CONFIG_MODULE) / "config.yaml"))
    assert isinstance(config, DictConfig)
    for entry in config.get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            for key, value in entry.items():
                if key == group:
                    return str(value)
    return None


def method_sweep_points(overrides: Sequence[str]) -> list[dict[str, Any]]:
    """The ``method`` node of every point of a sweep, from the command line alone (no compose).

    Each point is the chosen method's declared defaults with that point's ``method.<key>`` overrides
    applied (``+``/``++`` alike; ``~method.key`` restores the default), so every combination of
    ``method=a,b method.m=2,4`` can be checked before the first job runs. Values are Hydra's own
    parse of the override (``5`` an int, ``[0,1]`` a list, ``null`` None); interpolations (``${...}``),
    glob sweeps, flags (``--cfg``) and overrides Hydra cannot parse (composing reports those) are left
    to Hydra.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    from kvbench.methods import method_choices, method_node

    parser = OverridesParser.create()
    axes: list[list[tuple[str, bool, Any]]] = []  # per override: its (key, delete, value) choices
    for item in overrides:
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException:
            continue
        key = override.key_or_group
        if key != "method" and not key.startswith("method."):
            continue
        if override.is_delete():
            axes.append([(key, True, None)])
        elif override.value_type == ValueType.GLOB_CHOICE_SWEEP:
            continue
        elif override.is_sweep_override():
            axes.append([(key, False, value) for value in override.sweep_iterator()])
        else:
            axes.append([(key, False, override.value())])
    points = []
    for combination in itertools.product(*axes):
        name, changes = default_choice("method"), {}
        for key, delete, value in combination:
            if key == "method":
                name = None if delete else value
            elif not (isinstance(value, str) and "${" in value):
                changes[key.removeprefix("method.")] = (delete, value)
        if name is None:  # ~method: no method group (the runner says so)
            continue
        node = method_node(name) if name in method_choices() else {"name": name}
        for key, (delete, value) in changes.items():
            if delete:
                node.pop(key, None)
            else:
                node[key] = value
        points.append(node)
    return points
