"""Compose the Hydra config tree outside ``kvbench run`` (validation, checks, reproductions)."""

from __future__ import annotations

from typing import Any, Sequence

from kvbench.errors import ConfigError

CONFIG_MODULE = "kvbench.conf"


def compose(overrides: Sequence[str]) -> dict[str, Any]:
    """The resolved config (a plain dict, without ``hydra``) for ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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
