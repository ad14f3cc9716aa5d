"""Moving cached keys to new positions with the model's own rotary embedding.

A reused chunk's keys were computed (post-RoPE) at the positions the chunk had when it was
prefilled alone; in a new prompt the chunk sits elsewhere. RoPE rotates each 2-D pair of a key by
``position · θ_i``, and rotations by the same frequencies compose, so a key at position ``p`` moves to
``p + Δ`` by one more rotation by ``Δ`` (CacheBlend §4, Appendix A; LMCache's "delta RoPE"). Doing it
with the model's own rotary module and its own ``apply_rotary_pos_emb`` keeps every model detail
right without re-deriving it: the half-split (Llama, Mistral, Qwen2) or interleaved partial layout
(GLM-4), ``rope_theta``, and frequency rescaling such as Llama-3's ``rope_scaling`` (which changes the
frequencies, not the composition rule).

Two rope types do not compose this way and are refused: ``dynamic`` (NTK scaling whose frequencies
depend on the sequence length) and ``longrope`` (short/long factors switched by length). Types whose
cos/sin carry an attention scaling factor (YaRN) are handled by dividing it out, so the delta rotation
is a pure rotation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from kvbench.errors import ConfigError

NON_COMPOSABLE = ("dynamic", "longrope")


def rope_type(model: Any) -> str:
    rotary = model.model.rotary_emb
    return str(getattr(rotary, "rope_type", "default"))


def check_rerotatable(model: Any) -> None:
    """Refuse models whose RoPE cannot be moved by a delta rotation."""
    kind = rope_type(model)
    if kind in NON_COMPOSABLE:
        raise ConfigError(
            f"this model's rope_type {kind!r} depends on the sequence length, so cached keys cannot be re-rotated",
            "use a model with default, linear, llama3 or yarn RoPE for reuse methods",
        )


def _apply_fn(model: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The model family's ``apply_rotary_pos_emb`` (from the module that defines its attention)."""
    attention = model.model.layers[0].self_attn
    module = sys.modules[type(attention).__module__]
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None:
        raise ConfigError(f"{type(attention).__name__} has no apply_rotary_pos_emb", "use a Llama-family architecture")
    return fn


def rotation(model: Any, delta: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) ``[1, n, d]`` (float32) of a pure rotation by ``delta`` ``[n]`` positions, computed
    once and applied to every layer's keys with :func:`apply_rotation` (the delta is the same for all)."""
    rotary = model.model.rotary_emb
    probe = torch.empty(0, dtype=torch.float32, device=device)
    cos, sin = rotary(probe, delta.to(device).view(1, -1))
    scale = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if scale != 1.0:
        cos, sin = cos / scale, sin / scale
    return cos, sin


def apply_rotation(model: Any, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[kv_heads, n, d]`` rotated by a :func:`rotation` (in float32; returned in ``keys``' dtype)."""
    k = keys.float().unsqueeze(0)
    _, moved = _apply_fn(model)(k, k, cos, sin)
    return moved[0].to(keys.dtype)


def rerotate(model: Any, keys: torch.Tensor, delta: torch.Tensor | int) -> torch.Tensor:
    """``keys`` ``[kv_heads, n, d]`` (post-RoPE) moved by ``delta`` positions (a scalar or ``[n]``).

    Returns a new tensor in ``keys``' dtype; the rotation is computed in float32.
    """
    n = keys.shape[1]
    if isinstance(delta, int):
        delta = torch.full((n,), delta, dtype=torch.long)
    cos, sin = rotation(model, delta, keys.device)
    return apply_rotation(model, keys, cos, sin)
