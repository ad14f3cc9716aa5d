"""Compose the Hydra config tree outside ``kvbench run`` (validation, checks, reproductions).

The ``method`` config group has no YAML files: :func:`register_method_configs` builds each
``method=<name>`` node from its parameter declarations (:mod:`kvbench.methods.params`), so the
defaults exist once. The nodes are plain dicts (OmegaConf need not understand ``Literal`` or union
types); :func:`kvbench.methods.validate_method_config` checks the values.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from kvbench.errors import ConfigError

CONFIG_MODULE = "kvbench.conf"


def register_method_configs() -> None:
    """Store every method's default node in Hydra's ConfigStore (group ``method``); idempotent.
    Call before any compose or ``hydra.main``."""
    from hydra.core.config_store import ConfigStore

    from kvbench.methods import PARAMS, method_node

    store = ConfigStore.instance()
    for name in PARAMS:
        store.store(group="method", name=name, node=method_node(name))


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """The resolved config (a plain dict, without ``hydra``) for ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_method_configs()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except (HydraException, OmegaConfBaseException) as exc:
        message = str(exc).strip().splitlines()
        raise ConfigError(
            f"invalid override: {message[0] if message else exc}",
            "check the key's spelling against `kvbench list` and conf/ (new keys need a leading +)",
        ) from None
    resolved.pop("hydra", None)
    return resolved


def default_choice(group: str) -> str | None:
    """The option ``conf/config.yaml``'s defaults list picks for ``group`` (``method`` → ``full``)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    for entry in OmegaConf.load(files(CONFIG_MODULE) / "config.yaml").get("defaults", []):
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

    from kvbench.methods import PARAMS, method_node

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
        node = method_node(name) if name in PARAMS else {"name": name}
        for key, (delete, value) in changes.items():
            if delete:
                node.pop(key, None)
            else:
                node[key] = value
        points.append(node)
    return points
