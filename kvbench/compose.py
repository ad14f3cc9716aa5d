"""Compose the Hydra config tree outside ``kvbench run`` (validation, dry runs, checks, reproductions).

``kvbench run -m`` sweeps are expanded here with Hydra's own parser and basic-sweeper rule (the
cartesian product of every comma list, ``range(...)``, ``glob(...)``), so that every point is composed
and validated before the first one runs. Hydra's parse errors become one line with the fix; the most
common one, a non-ASCII character in an unquoted value, says how to quote it.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvbench.errors import ConfigError

CONFIG_MODULE = "kvbench.conf"


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

    resolved: list[dict[str, Any]] = []
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        for overrides in points:
            try:
                cfg = hydra_compose(config_name="config", overrides=list(overrides))
                config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
            except (HydraException, OmegaConfBaseException) as exc:
                raise override_error(exc, overrides) from None
            config.pop("hydra", None)
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


def is_sweep(overrides: Sequence[str]) -> list[str]:
    """The overrides that are sweeps (``a=1,2``, ``range(...)``), which need ``-m``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise override_error(exc, overrides) from None
    return [o.input_line for o in parsed if o.is_sweep_override()]


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
        return ConfigError(f"{first.split('argument', 1)[1].strip()} is a sweep", "add -m to run every value (kvbench run -m ...)")
    if "Lexer" in first or "mismatched input" in first or "token recognition" in first:
        return ConfigError(
            f"cannot parse the override {first.split(':', 1)[-1].strip()!r}",
            "write key=value; quote values with spaces or special characters: 'key=\"a value\"'",
        )
    return ConfigError(
        f"invalid override: {first}",
        "check the key's spelling against `kvbench list`, `kvbench run --help` and conf/ (new keys need a leading +)",
    )
