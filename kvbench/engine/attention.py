"""The attention function kvbench registers with transformers, and its kernels.

transformers calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
mask, scaling=...)`` from every attention layer, after the projections and RoPE. Registering
``"kvbench"`` there gives the engine the post-RoPE query, key and value of each layer, with
``module.layer_idx``, for any model family that uses the interface (Llama, Mistral, Qwen2/3, GLM-4),
without patching model code. The function does not receive the cache object, so it reads the active
:class:`~kvbench.engine.context.GenerationContext` from a context variable that
:func:`activate` binds for the duration of one generation.

Dense paths call transformers' own SDPA function with the same tensors the stock model would pass,
so ``method=full`` is token-identical to ``model.generate``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext

ATTENTION_NAME = "kvbench"
_ACTIVE: ContextVar[GenerationContext | None] = ContextVar("kvbench_active_generation", default=None)


def kvbench_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx = _ACTIVE.get()
    if ctx is None:
        raise RuntimeError("the kvbench attention function ran outside kvbench.engine.activate()")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return ctx.attend(module, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, kvbench_attention)


@contextmanager
def activate(ctx: GenerationContext) -> Iterator[GenerationContext]:
    """Route the model's attention through ``ctx`` while the block runs."""
    if _ACTIVE.get() is not None:
        raise RuntimeError("a kvbench generation is already active in this thread")
    model = ctx.model
    previous = model.config._attn_implementation
    token = _ACTIVE.set(ctx)
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield ctx
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)


# ---------------------------------------------------------------------- kernels
def dense(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal (prefill) or full (decode) attention exactly as transformers' SDPA path computes it.

    ``query`` ``[1, H, t, d]``, ``key``/``value`` ``[1, kv_heads, n, d]``; returns ``[1, t, H, d]``.
    """
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling)[0]


def selected(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a per-head selection (an index list, gathered).

    ``query`` ``[1, H, 1, d]``; ``keys``/``values`` ``[rows, k, d]`` with rows = KV heads (shared by a
    query group) or rows = H (one selection per query head); ``mask`` ``[rows, k]`` (optional, additive:
    0 or -inf, :func:`valid_mask`) leaves out the entries a fixed-shape selection pads with. Returns
    ``[1, 1, H, d]``.

    The group's query heads are the query rows of one 4-D SDPA call per KV head (``[1, rows, g, d]``),
    which PyTorch runs on its flash kernel, not the math path, and with no repeated K/V."""
    n_heads, d = query.shape[1], query.shape[-1]
    rows = keys.shape[0]
    q = query.reshape(1, rows, n_heads // rows, d)
    if mask is not None:
        mask = mask.view(1, rows, 1, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask, scale=scaling)
    return out.reshape(1, 1, n_heads, values.shape[-1])


def valid_mask(valid: torch.Tensor, zero: torch.Tensor, minus_inf: torch.Tensor) -> torch.Tensor:
    """The additive mask of a selection's ``valid`` flags: ``zero`` where attended, ``minus_inf`` where not
    (0-d tensors of the attention's dtype, made once by the caller: one op)."""
    return torch.where(valid, zero, minus_inf)


def decode_dense(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    kernel: str = "sdpa",
    split_tokens: int = 256,
) -> torch.Tensor:
    """Decode attention over a layer's buffer prefix ``keys``/``values`` ``[rows, B, d]`` (static decode):
    ``mask`` ``[1, 1, 1, B]`` is 0 on held slots and -inf past the length. Returns ``[1, 1, H, d]``.

    ``kernel`` (``engine.decode_attention``): ``sdpa`` — as :func:`selected`, one 4-D SDPA call with the
    group's query heads as rows; ``matmul`` — :func:`decode_matmul`; ``split`` — flash-decoding
    (:mod:`kvbench.engine.split_decode`, Triton on CUDA; :func:`decode_matmul` elsewhere)."""
    if kernel == "split" and keys.device.type == "cuda":
        from kvbench.engine import split_decode

        return split_decode.attend(query, keys, values, mask, scaling, split_tokens)
    if kernel in ("matmul", "split"):
        return decode_matmul(query, keys, values, mask, scaling)
    n_heads, d = query.shape[1], query.shape[-1]
    rows = keys.shape[0]
    q = query.reshape(1, rows, n_heads // rows, d)
    out = F.scaled_dot_product_attention(q, keys[None], values[None], attn_mask=mask, scale=scaling)
    return out.reshape(1, 1, n_heads, values.shape[-1])


def decode_matmul(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:func:`decode_dense` as two batched GEMMs around a float32 softmax (transformers' eager attention):
    the scores ``[rows, g, B]`` with the mask added in the same call, the probabilities in the values'
    dtype, times the values. Four ops, no copy of the keys or values (the GEMMs read the buffer's views)."""
    n_heads, d = query.shape[1], query.shape[-1]
    rows, slots = keys.shape[0], keys.shape[1]
    q = query.reshape(rows, n_heads // rows, d)
    scores = torch.baddbmm(mask.reshape(1, 1, slots), q, keys.transpose(1, 2), alpha=scaling)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values).reshape(1, 1, n_heads, values.shape[-1])


def length_mask(iota: torch.Tensor, length: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, 1, B]``: 0 for slots below ``length`` (``[1]``, device), -inf from it on."""
    return torch.zeros(1, 1, 1, iota.shape[0], dtype=dtype, device=iota.device).masked_fill_(
        iota >= length, float("-inf")
    )


def probabilities(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax attention ``[H, k]`` of a decode query over ``keys`` ``[rows, k, d]`` (fp32); entries not
    ``valid`` (``[rows, k]``) get none."""
    n_heads, d = query.shape[1], query.shape[-1]
    rows = keys.shape[0]
    q = query[0, :, 0, :].reshape(rows, n_heads // rows, d).float()
    logits = torch.einsum("rgd,rkd->rgk", q, keys.float()) * scaling
    if valid is not None:
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(n_heads, -1)


def with_past(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
    *,
    layout: PastLayout | None = None,
) -> torch.Tensor:
    """Several query rows attending held keys causally by position (chunked prefill, reuse prefill).

    ``query`` ``[1, H, t, d]``; ``keys``/``values`` ``[kv_heads, n, d]``; ``key_positions`` ``[n]`` (shared
    by every head) or ``[kv_heads, n]``; ``query_positions`` ``[t]``. A key is visible to a query when its
    position is not after the query's. Returns ``[1, t, H, d]``.

    The mask is additive (0 / -inf) rather than boolean: PyTorch's CPU SDPA runs its flash kernel with a
    float mask but falls back to the much slower math path with a boolean one (3x on a reuse prefill).

    ``layout`` (:func:`past_layout`): the same computation planned on the host, once, for keys held at
    positions ``0..n-1`` in slot order (a reuse prefill writes slot = position) and one set of query rows.
    With it the call reads nothing back from the device and builds no mask (``key_positions`` and
    ``query_positions`` are not read): a prefill plan makes one layout per set of active rows and passes it
    at every layer. Without it the call plans itself, reading the positions where they are (on a GPU, a
    few blocking reads a call) and building its masks.
    """
    if layout is not None:
        return layout.attend(query, keys, values, scaling)
    n_heads, t, d = query.shape[1], query.shape[2], query.shape[-1]
    kv_heads = keys.shape[0]
    query_positions = query_positions.to(key_positions.device)
    if key_positions.dim() == 1 and _is_causal_suffix(key_positions, query_positions):
        return _suffix_padded(query, keys, values, scaling)
    if key_positions.dim() == 1 and t >= 2 * BLOCK_ROWS and bool((key_positions[1:] >= key_positions[:-1]).all()):
        return _with_past_blocked(query, keys, values, key_positions, query_positions, scaling)
    if key_positions.dim() == 1:
        hidden = key_positions[None, :] > query_positions[:, None]
        mask = torch.zeros(1, 1, t, keys.shape[1], dtype=query.dtype, device=query.device)
        mask.masked_fill_(hidden.to(query.device)[None, None], float("-inf"))
        if query.device.type == "cuda" and n_heads != kv_heads:  # (see PastLayout.attend)
            keys, values, kv_heads = _repeat_heads(keys, n_heads), _repeat_heads(values, n_heads), n_heads
        out = F.scaled_dot_product_attention(
            query, keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=n_heads != kv_heads
        )
        return out.transpose(1, 2)
    group = n_heads // kv_heads
    q = query[0].reshape(kv_heads, group, t, d)
    hidden = key_positions[:, None, None, :] > query_positions[None, None, :, None]
    mask = torch.zeros(kv_heads, 1, t, keys.shape[1], dtype=query.dtype, device=query.device)
    mask.masked_fill_(hidden.to(query.device), float("-inf"))
    k = keys[:, None].expand(kv_heads, group, *keys.shape[1:])
    v = values[:, None].expand(kv_heads, group, *values.shape[1:])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(n_heads, t, -1).transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class SegmentColumns:
    """Extra value columns that make one attention call also return each row's attention *mass* per
    segment of keys (a policy's statistics, :class:`~kvbench.engine.reuse.ReusePrefill`): the values get
    the keys' one-hot segment membership as ``segments`` more columns, so the output's extra columns
    hold ``sum_{keys k of segment s} softmax(q K / sqrt)[k]`` for every row and query head, from the
    same softmax as the attention itself (no second pass over the logits).

    PyTorch's fused kernels need query, key and value of one head dimension (a wider value sends CPU
    SDPA to its math path, ~10x slower), so the query and keys get zero columns up to the same width
    ``d + pad``: the logits are unchanged (the zeros add nothing; the scale is passed explicitly), and so
    are the first ``d`` output columns (bit-identical on the CPU kernels we tested; a test pins it).
    ``member`` is ``[n, segments]`` in the model's dtype (a key of no segment has a zero row); ``pad`` is
    ``segments`` rounded up to a multiple of 8 (the GPU kernels' alignment)."""

    member: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.member.shape[-1])

    @property
    def pad(self) -> int:
        return -(-self.count // 8) * 8

    def query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` ``[..., t, d]`` with ``pad`` zero columns: ``[..., t, d + pad]``."""
        return F.pad(query, (0, self.pad))

    def kv(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` ``[..., n, d]`` with zero columns, ``values`` ``[..., n, d]`` followed by the membership
        columns and zeros: both ``[..., n, d + pad]``."""
        d = values.shape[-1]
        wide = F.pad(values, (0, self.pad))
        wide[..., d : d + self.count] = self.member.to(values.dtype)
        return F.pad(keys, (0, self.pad)), wide

    def split(self, out: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention output ``[..., d + pad]`` split into the attention's ``[..., d]`` and the mass
        ``[..., segments]``."""
        return out[..., :d].contiguous(), out[..., d : d + self.count]


def _is_causal_suffix(key_positions: torch.Tensor, query_positions: torch.Tensor) -> bool:
    """Whether the keys hold positions ``0..n-1`` in order and the queries are the last ``t`` of them, in
    order, with ``t`` at least the ``p = n - t`` earlier ones (a prefix-cache hit on a short prefix) —
    the case :func:`_suffix_padded` computes on the fast causal kernel at no more than 4/3 the work."""
    n, t = key_positions.shape[0], query_positions.shape[0]
    if t < 2 or 2 * t < n:
        return False
    steps_ok = bool((key_positions[1:] - key_positions[:-1] == 1).all()) and int(key_positions[0]) == 0
    return steps_ok and bool((query_positions == key_positions[n - t :]).all())


def _suffix_padded(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Queries at positions ``p..n-1`` over keys at ``0..n-1``: pad the query with ``p`` zero rows in front
    and run the causal kernel over all ``n`` rows, keeping the last ``t``.

    A bottom-right causal mask is what the rows need, but PyTorch's causal flag aligns top-left and its
    CPU kernel is only fast with that flag: the masked blocked path took 1.4-1.9x the causal kernel's
    time on a 6k-token SmolLM2 layer whose prefix is 10 % of the prompt (a loaded 2-core machine).
    The padded rows cost ``p^2/2`` extra, at most a third of the work when ``t >= p``."""
    n_heads, t, d = query.shape[1], query.shape[2], query.shape[-1]
    n, kv_heads = keys.shape[1], keys.shape[0]
    padded = query.new_zeros(1, n_heads, n, d)
    padded[:, :, n - t :] = query
    out = F.scaled_dot_product_attention(
        padded, keys[None], values[None], is_causal=True, scale=scaling, enable_gqa=n_heads != kv_heads
    )
    return out[:, :, n - t :].transpose(1, 2)


#: query rows per block of :func:`_with_past_blocked` (at least; at most :data:`MAX_BLOCKS` blocks)
BLOCK_ROWS = 32
MAX_BLOCKS = 8


def _with_past_blocked(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """:func:`with_past` for keys held in position order (a reuse prefill writes slot = position): the
    query rows, sorted by position, go in up to :data:`MAX_BLOCKS` blocks, and each block attends only
    the keys up to its last row's position — the keys after it are masked for every row of the block
    anyway. A dense causal kernel skips the upper triangle the same way; one rectangle over all keys
    would compute about twice the attention a causal prefill does for rows spread over the prompt.

    The result equals the unblocked computation up to float summation order (the excluded keys carry
    zero weight). Here each block's key count is read from the positions (one read a block);
    :func:`past_layout` takes the same decisions on the host."""
    t = query.shape[2]
    order = torch.argsort(query_positions, stable=True)
    sorted_positions = query_positions[order]
    limits = [
        int(torch.searchsorted(key_positions, sorted_positions[end - 1 : end], right=True)[0])
        for _, end in _block_bounds(t)
    ]
    blocks = _blocks(order.to(query.device), sorted_positions, limits, key_positions, query.dtype, query.device)
    return PastLayout(t, keys.shape[1], False, blocks).attend(query, keys, values, scaling)


def _block_bounds(t: int) -> list[tuple[int, int]]:
    """The ``[begin, end)`` ranges of the sorted query rows that form :func:`_with_past_blocked`'s blocks."""
    blocks = max(1, min(MAX_BLOCKS, t // BLOCK_ROWS))
    bounds = [round(i * t / blocks) for i in range(blocks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _blocks(
    order: torch.Tensor,
    sorted_positions: torch.Tensor,
    limits: list[int],
    key_positions: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[_Block, ...]:
    """The blocks of :func:`_with_past_blocked`: ``order`` (on ``device``) the query rows by position,
    ``sorted_positions`` their positions (beside ``key_positions``), ``limits`` each block's key count;
    each block's additive mask is made here."""
    out = []
    for (begin, end), limit in zip(_block_bounds(order.shape[0]), limits):
        positions = sorted_positions[begin:end]
        hidden = key_positions[None, :limit] > positions[:, None]
        mask = _zero_mask(end - begin, limit, dtype, device)
        mask.masked_fill_(hidden.to(device)[None, None], float("-inf"))
        out.append(_Block(order[begin:end], limit, mask))
    return tuple(out)


def _zero_mask(rows: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero additive mask ``[1, 1, rows, keys]``; on CUDA a view of rows padded to a multiple of 16
    keys, the alignment the memory-efficient kernel needs (else SDPA pads a copy at every call)."""
    if torch.device(device).type != "cuda":
        return torch.zeros(1, 1, rows, keys, dtype=dtype, device=device)
    return torch.zeros(1, 1, rows, -(-keys // 16) * 16, dtype=dtype, device=device)[..., :keys]


def _repeat_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``x`` ``[kv_heads, n, d]`` with each KV head repeated for its group of query heads: ``[n_heads, n, d]``."""
    kv_heads, n, d = x.shape
    return x[:, None].expand(kv_heads, n_heads // kv_heads, n, d).reshape(n_heads, n, d)


@dataclass(frozen=True)
class _Block:
    """Query rows of a :class:`PastLayout` that attend the same keys ``[0, limit)`` under one mask."""

    rows: torch.Tensor | None  # indices of the rows among the query rows (device); None: every row, in order
    limit: int
    mask: torch.Tensor | None  # additive, [1, 1, rows, limit]


@dataclass(frozen=True)
class PastLayout:
    """:func:`with_past` for one set of query rows over ``keys`` keys held in position order, planned once
    (:func:`past_layout` on the host, or :func:`_with_past_blocked` from the positions): the padded causal
    kernel, or blocks of rows each with its key count and its additive mask (held on the device)."""

    rows: int
    keys: int
    padded: bool
    blocks: tuple[_Block, ...]

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float,
        *,
        repeat_heads: bool | None = None,
    ) -> torch.Tensor:
        """The attention of ``query`` ``[1, H, t, d]`` over ``keys``/``values`` ``[kv_heads, n, d]``.

        Under a mask, GQA runs on SDPA's ``enable_gqa`` on a CPU (its flash kernel takes a float mask).
        On CUDA (``repeat_heads``, default: on CUDA) the K/V heads are repeated for the group instead,
        once a call: CUDA's SDPA runs GQA only on its flash kernel, which takes no mask, and on the math
        path, which materialises every block's attention matrix in float32; with as many K/V heads as
        query heads the memory-efficient kernel takes the additive mask."""
        n_heads, t = query.shape[1], query.shape[2]
        if t != self.rows or keys.shape[1] != self.keys:
            raise ValueError(
                f"a layout for {self.rows} rows over {self.keys} keys was given {t} rows over {keys.shape[1]} keys"
            )
        if self.padded:
            return _suffix_padded(query, keys, values, scaling)
        if repeat_heads is None:
            repeat_heads = query.device.type == "cuda"
        if repeat_heads and n_heads != keys.shape[0]:
            keys, values = _repeat_heads(keys, n_heads), _repeat_heads(values, n_heads)
        gqa = n_heads != keys.shape[0]
        if len(self.blocks) == 1 and self.blocks[0].rows is None:  # one rectangle over every key
            mask = self.blocks[0].mask
            out = F.scaled_dot_product_attention(
                query, keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=gqa
            )
            return out.transpose(1, 2)
        out = torch.empty(1, n_heads, t, values.shape[-1], dtype=query.dtype, device=query.device)
        for block in self.blocks:
            rows, limit = block.rows, block.limit
            out[:, :, rows] = F.scaled_dot_product_attention(
                query[:, :, rows],
                keys[None, :, :limit],
                values[None, :, :limit],
                attn_mask=block.mask,
                scale=scaling,
                enable_gqa=gqa,
            )
        return out.transpose(1, 2)


def past_layout(
    keys: int, positions: np.ndarray | Sequence[int], *, dtype: torch.dtype, device: torch.device
) -> PastLayout:
    """Plan :func:`with_past` for query rows at ``positions`` (host ints, ``[t]``) over ``keys`` keys held at
    positions ``0..keys-1`` in slot order, on the host: the decisions :func:`with_past` takes from the
    positions (the padded causal kernel for a query suffix at least as long as its prefix; blocks by
    position from ``2 · BLOCK_ROWS`` rows; else one rectangle), with each block's key count from the
    positions themselves instead of a device read. The masks (``dtype``) are made on ``device`` here,
    once, and the layout gives :func:`with_past` the same result, bit for bit, at every call."""
    positions = np.asarray(positions, dtype=np.int64)
    t = len(positions)
    if t >= 2 and 2 * t >= keys and positions[0] == keys - t and bool((np.diff(positions) == 1).all()):
        return PastLayout(t, keys, True, ())
    key_positions = torch.arange(keys, device=device)
    if t >= 2 * BLOCK_ROWS:
        order = np.argsort(positions, kind="stable")  # (as argsort(stable=True))
        ordered = positions[order]
        limits = [min(keys, int(ordered[end - 1]) + 1) for _, end in _block_bounds(t)]  # keys up to the last row
        rows, where = _device_ints(np.stack([order, ordered]), device)
        return PastLayout(t, keys, False, _blocks(rows, where, limits, key_positions, dtype, device))
    (where,) = _device_ints(positions[None], device)
    mask = _zero_mask(t, keys, dtype, device)
    mask.masked_fill_((key_positions[None, :] > where[:, None])[None, None], float("-inf"))
    return PastLayout(t, keys, False, (_Block(None, keys, mask),))


def _device_ints(rows: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """The rows of a host int array ``[r, t]`` as int64 tensors on ``device``: one host tensor, copied
    asynchronously from pinned memory on a GPU."""
    host = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    if device.type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.unbind(0))
