"""A decode step's decoder layers without the module stack: the same weights, ~18 ops a layer.

transformers runs a decoder layer as a tree of modules (norms, projections, rotary embedding, MLP):
~45 aten ops a layer for one token, and on a CPU most of a small model's decode time is the host
issuing them. SGLang and vLLM run decode from their own layer code over the model's weights; kvbench
does the same for the Llama family (Llama, Mistral, Qwen2; :data:`LEAN_ARCHS`), computing exactly what
the stock layer computes, in the same order:

``x + o(attn(rope(q), rope(k), v))`` then ``x + down(act(gate(h)) * up(h))``, with RMSNorm before each.

* the Q/K/V projections are one matrix product when the weights are fused (:func:`fuse_weights`), the
  rotary embedding one pass over the query and key rows together (``x·cos + roll(x)·sin±``, the
  sign folded into ``sin`` once per step: the same products as ``rotate_half``);
* the attention is the engine's (``attend``), with the layer's fresh post-RoPE Q/K/V;
* every op keeps the stock layer's rounding: separate products and sums where the stock layer has
  them, RMSNorm in float32 as transformers does (``F.rms_norm`` when the model is float32, where it
  is the same computation in one kernel).

:func:`fuse_weights` (CPU only, at load time) re-lays each layer's projection weights as
``[in, out]`` matrices, Q/K/V side by side and gate/up side by side, and points the modules'
``weight`` parameters at transposed *views* of them: no memory is added, the modules compute what
they computed (a ``[out, in]`` view of the same numbers), and a one-row product over an ``[in, out]``
matrix streams its weights 2-2.5x faster on a CPU than over ``[out, in]`` (measured on the
2-core machine: 59 vs 150 µs for a 1 MiB weight). A GPU keeps the weights as loaded.

An architecture outside :data:`LEAN_ARCHS` (GLM-4's partial rotary, Qwen3's Q/K norms) decodes
through its own modules (:class:`~kvbench.engine.driver.ModelDriver`), with the same attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: model types whose decoder layer :func:`lean_layer` reproduces
LEAN_ARCHS = ("llama", "mistral", "qwen2")

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors as the lean step reads them."""

    in_norm: torch.Tensor
    in_eps: float
    qkv: tuple[torch.Tensor, ...]  # fused: one [in, q+k+v] matrix; else the three [out, in] weights
    qkv_bias: tuple[torch.Tensor, ...] | None  # same layout as qkv (Qwen2), or None
    o: torch.Tensor  # [in, out] when fused, else [out, in]
    post_norm: torch.Tensor
    post_eps: float
    gate_up: tuple[torch.Tensor, ...]  # fused: one [in, 2·inter] matrix; else gate and up [out, in]
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    fused: bool


def supports(model: Any) -> bool:
    """Whether :func:`lean_layer` reproduces this model's decoder layers."""
    config = model.config
    if config.model_type not in LEAN_ARCHS or getattr(config, "mlp_bias", False):
        return False
    if getattr(config, "attention_bias", False) and config.model_type != "qwen2":
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):  # sliding-window layers
        return False
    return getattr(config, "pretraining_tp", 1) == 1


def fuse_weights(model: Any) -> bool:
    """Re-lay a CPU model's projection weights as fused ``[in, out]`` matrices (module docstring);
    returns whether it did (a supported architecture on a CPU, once per model)."""
    if getattr(model, "_kvbench_fused", False) or not supports(model):
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
            _fuse(attn.o_proj)
            _fuse(mlp.gate_proj, mlp.up_proj)
            _fuse(mlp.down_proj)
    model._kvbench_fused = True
    return True


def _fuse(*linears: nn.Linear) -> None:
    """One ``[in, Σ out]`` matrix holding ``linears``' weights side by side; each module's ``weight``
    becomes a ``[out, in]`` view of its columns (biases likewise, side by side)."""
    matrix = torch.cat([linear.weight for linear in linears], dim=0).t().contiguous()
    start = 0
    for linear in linears:
        out = linear.weight.shape[0]
        linear.weight = nn.Parameter(matrix[:, start : start + out].t(), requires_grad=False)
        start += out
    if linears[0].bias is not None:
        bias = torch.cat([linear.bias for linear in linears])
        start = 0
        for linear in linears:
            out = linear.weight.shape[0]
            linear.bias = nn.Parameter(bias[start : start + out], requires_grad=False)
            start += out


def _fused_matrix(*linears: nn.Linear) -> torch.Tensor | None:
    """The ``[in, Σ out]`` matrix behind ``linears`` when :func:`_fuse` made their weights views of it
    (in this order), else ``None``."""
    first = linears[0].weight
    width = sum(linear.weight.shape[0] for linear in linears)
    offset = first.storage_offset()
    for linear in linears:
        w = linear.weight
        same = w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not same or w.stride() != (1, width) or w.storage_offset() != offset:
            return None
        offset += w.shape[0]
    return first.as_strided((first.shape[1], width), (width, 1), first.storage_offset())


def _fused_bias(*linears: nn.Linear) -> torch.Tensor | None:
    """The one vector behind ``linears``' biases when :func:`_fuse` made them views of it, else ``None``."""
    biases: list[torch.Tensor | None] = [linear.bias for linear in linears]
    first = biases[0]
    if first is None:
        return None
    offset = first.storage_offset()
    for b in biases:
        if b is None or b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        if b.storage_offset() != offset:
            return None
        offset += b.shape[0]
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def layer_weights(layer: Any) -> LayerWeights:
    """What :func:`lean_layer` reads of one stock decoder layer."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = _fused_matrix(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = _fused_matrix(mlp.gate_proj, mlp.up_proj)
    o, down = _fused_matrix(attn.o_proj), _fused_matrix(mlp.down_proj)
    fused = qkv is not None and gate_up is not None and o is not None and down is not None
    if fused:
        bias = _fused_bias(attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = None if bias is None else (bias,)
        assert qkv is not None and gate_up is not None and o is not None and down is not None
        qkv_w: tuple[torch.Tensor, ...] = (qkv,)
        gate_up_w: tuple[torch.Tensor, ...] = (gate_up,)
    else:
        qkv_w = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        biases = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        qkv_bias = None if biases[0] is None else tuple(biases)
        gate_up_w = (mlp.gate_proj.weight, mlp.up_proj.weight)
        o, down = attn.o_proj.weight, mlp.down_proj.weight
    return LayerWeights(
        in_norm=layer.input_layernorm.weight,
        in_eps=float(layer.input_layernorm.variance_epsilon),
        qkv=qkv_w,
        qkv_bias=qkv_bias,
        o=o,
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=float(layer.post_attention_layernorm.variance_epsilon),
        gate_up=gate_up_w,
        down=down,
        act=mlp.act_fn,
        fused=fused,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: float32 statistics, the weight applied in the input's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, ±sin)`` ``[d]`` for one position: ``rotate_half(x)·sin == roll(x, d/2)·(±sin)``, with the
    first half of ``sin`` negated (once per step, shared by every layer)."""
    c, s = cos.reshape(-1), sin.reshape(-1)
    half = s.shape[0] // 2
    return c, torch.cat((-s[:half], s[half:]))


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` for rows ``x`` ``[r, d]`` (the same products and sum)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _project(
    h: torch.Tensor, weights: tuple[torch.Tensor, ...], bias: tuple[torch.Tensor, ...] | None, fused: bool
) -> torch.Tensor:
    if fused:
        return torch.mm(h, weights[0]) if bias is None else torch.addmm(bias[0], h, weights[0])
    parts = [F.linear(h, w, None if bias is None else bias[i]) for i, w in enumerate(weights)]
    return torch.cat(parts, dim=-1)


def lean_layer(
    index: int,
    w: LayerWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    shape: tuple[int, int, int],
    attend: Attend,
) -> torch.Tensor:
    """Decoder layer ``index`` for one token: ``x`` ``[1, hidden]`` → ``[1, hidden]``.

    ``shape`` is ``(heads, kv_heads, head_dim)``; ``attend(index, q [1, H, 1, d], k [1, H_kv, 1, d],
    v [1, H_kv, 1, d])`` returns ``[1, 1, H, d]`` (the registered attention function's contract)."""
    heads, kv_heads, d = shape
    h = rms_norm(x, w.in_norm, w.in_eps)
    qkv = _project(h, w.qkv, w.qkv_bias, w.fused).view(heads + 2 * kv_heads, d)
    qk = rope(qkv[: heads + kv_heads], cos, signed_sin)
    q = qk[:heads].view(1, heads, 1, d)
    k = qk[heads:].view(1, kv_heads, 1, d)
    v = qkv[heads + kv_heads :].view(1, kv_heads, 1, d)
    out = attend(index, q, k, v).reshape(1, heads * d)
    o = torch.mm(out, w.o) if w.fused else F.linear(out, w.o)
    x = x + o
    h = rms_norm(x, w.post_norm, w.post_eps)
    gu = _project(h, w.gate_up, None, w.fused)
    inter = gu.shape[-1] // 2
    m = w.act(gu[:, :inter]) * gu[:, inter:]
    return x + (torch.mm(m, w.down) if w.fused else F.linear(m, w.down))
