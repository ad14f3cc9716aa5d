"""Flash-decoding for the static decode step (``engine.decode_attention=split``), a Triton kernel.

A decode step's dense attention reads every held K/V slot of a layer once. PyTorch's fused kernels
give one thread block to each (KV head, block of query rows): with one query token and 8 KV heads a
layer's 32k slots are read by 8 blocks of a GPU with 132 multiprocessors, and the step runs far
below the memory bandwidth (``benchmarks/RESULTS.md`` §10b). Flash-decoding (Dao et al., 2023; the
decode kernels of SGLang and vLLM) splits the slots instead: one program per (KV head, chunk of
``split_tokens`` slots) computes, for the group's query heads, the chunk's running maximum ``m``,
its sum of exponentials ``l`` and its exponential-weighted values, and a merge weighs the chunks by
``exp(m_c - max m)``. Here:

* the group's query heads are the rows of the program's ``tl.dot`` products, padded to 16 rows (the
  smallest ``tl.dot`` shape), so the K/V a program reads serve all of them;
* the additive mask of the step (0 on held slots, -inf past the length, on the device) is read with the
  keys: the length never reaches the host and the launch has the same grid at every step of a bucket,
  so it is captured into the step's CUDA graph like any other kernel;
* the running maximum starts at -1e30, not -inf, so a chunk with no held slot yields ``m = -1e30``,
  ``l = 0`` and zero values, and weighs nothing in the merge;
* the merge is five PyTorch ops over ``[rows, chunks, 16]`` partials (no host read).

The kernel is built on first use (Triton is imported only then); ``tests/test_decode_kernels.py``
runs it under ``TRITON_INTERPRET=1`` on a CPU in float32 against written-out attention (Triton 3.9's
interpreter computes bf16 dot products wrongly, so bf16 is checked on a GPU: ``tests/test_gpu.py``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

BLOCK = 64  # slots a program reads per iteration (a chunk is a multiple of it)
ROWS = 16  # the smallest tl.dot tile: a group's query heads, padded


def available() -> bool:
    """Whether Triton can be imported (it ships with PyTorch's CUDA wheels)."""
    try:
        import triton  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl  # type: ignore[import-not-found]

    @triton.jit
    def partials(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        o_ptr,
        m_ptr,
        l_ptr,
        stride_kr,
        stride_kn,
        stride_vr,
        stride_vn,
        slots,
        scaling,
        GROUP: tl.constexpr,
        ROWS_P: tl.constexpr,
        D: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        heads = tl.arange(0, ROWS_P)
        dims = tl.arange(0, D)
        in_group = (heads < GROUP)[:, None]
        q = tl.load(q_ptr + (row * GROUP + heads)[:, None] * D + dims[None, :], mask=in_group, other=0.0)
        m = tl.full([ROWS_P], -1e30, tl.float32)
        total = tl.zeros([ROWS_P], tl.float32)
        acc = tl.zeros([ROWS_P, D], tl.float32)
        for offset in range(0, CHUNK, BLOCK_N):
            n = chunk * CHUNK + offset + tl.arange(0, BLOCK_N)
            inside = n < slots
            held = inside[:, None]
            k = tl.load(k_ptr + row * stride_kr + n[:, None] * stride_kn + dims[None, :], mask=held, other=0.0)
            if IEEE:  # float32 operands: exact products (not TF32); bf16/fp16 take the tensor cores as they are
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scaling
            else:
                scores = tl.dot(q, tl.trans(k)) * scaling
            bias = tl.load(mask_ptr + n, mask=inside, other=float("-inf")).to(tl.float32)
            scores = scores + bias[None, :]
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row * stride_vr + n[:, None] * stride_vn + dims[None, :], mask=held, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        base = (row * tl.num_programs(1) + chunk) * ROWS_P + heads
        tl.store(m_ptr + base, m)
        tl.store(l_ptr + base, total)
        tl.store(o_ptr + base[:, None] * D + dims[None, :], acc)

    return partials


def supports(group: int, head_dim: int, split_tokens: int) -> bool:
    """Shapes the kernel takes: a group of at most 16 query heads, a power-of-two head dimension, and
    chunks of whole iterations."""
    return group <= ROWS and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and split_tokens % BLOCK == 0


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float, split_tokens: int
) -> torch.Tensor:
    """:func:`kvbench.engine.attention.decode_dense` by flash-decoding: ``query`` ``[1, H, 1, d]``,
    ``keys``/``values`` ``[rows, B, d]`` (views of a layer's buffer, the last dimension contiguous), ``mask``
    ``[1, 1, 1, B]`` additive. Returns ``[1, 1, H, d]`` in the values' dtype."""
    n_heads, d = query.shape[1], query.shape[-1]
    rows, slots = keys.shape[0], keys.shape[1]
    group = n_heads // rows
    if not supports(group, d, split_tokens) or keys.stride(-1) != 1 or values.stride(-1) != 1:
        from kvbench.engine.attention import decode_matmul

        return decode_matmul(query, keys, values, mask, scaling)
    chunks = -(-slots // split_tokens)
    q = query.reshape(n_heads, d).contiguous()
    bias = mask.reshape(slots).contiguous()
    partial = torch.empty(rows, chunks, ROWS, d, dtype=torch.float32, device=keys.device)
    maxima = torch.empty(rows, chunks, ROWS, dtype=torch.float32, device=keys.device)
    sums = torch.empty_like(maxima)
    _kernel()[(rows, chunks)](
        q,
        keys,
        values,
        bias,
        partial,
        maxima,
        sums,
        keys.stride(0),
        keys.stride(1),
        values.stride(0),
        values.stride(1),
        slots,
        scaling,
        GROUP=group,
        ROWS_P=ROWS,
        D=d,
        CHUNK=split_tokens,
        BLOCK_N=BLOCK,
        IEEE=keys.dtype == torch.float32,
    )
    weights = torch.exp(maxima - maxima.amax(1, keepdim=True))  # [rows, chunks, ROWS]
    out = torch.einsum("rcg,rcgd->rgd", weights, partial) / (weights * sums).sum(1).unsqueeze(-1)
    return out[:, :group].to(values.dtype).reshape(1, 1, n_heads, d)
