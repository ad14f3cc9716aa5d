"""Attention statistics of chosen query rows, computed row block by row block.

A policy that needs attention *probabilities* during a prefill (Cache-Craft's inter- and intra-chunk
attention, a question's attention to each chunk) cannot get them from the fused kernels the prefill
runs, which return only the attention's output. :func:`segment_mass` recomputes them for the rows
asked for: the causal softmax of each row over every key of the layer (keys at positions after the
row's own are masked, as the prefill's exact mask does), summed over each *segment* of keys (a
segment is any labelled set of positions, e.g. a document chunk) and reduced over the query heads.

Memory stays bounded: the logits of at most ``block_elements`` (query head, row, key) entries exist
at once — a block of ``max(1, block_elements // (heads · keys))`` rows — never the whole
``heads × rows × keys`` matrix. The softmax is computed in float32 whatever the model's dtype.
A reuse policy calls it from its ``observe_attention`` hook (:class:`~kvbench.engine.reuse.ReusePrefill`),
which runs after a layer's fresh K/V are written, so the keys are the layer's complete K.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: how the per-head masses of a row are combined: the mean over query heads (default), their max, their sum
HEAD_REDUCTIONS = ("mean", "max", "sum")


def probability_blocks(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    block_elements: int = 1 << 22,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The causal softmax of the query rows over every key, row block by row block: yields
    ``(start, stop, probs)`` with ``probs`` ``[H, stop - start, n]`` (float32), at most ``block_elements``
    logits at once. Shapes and the causal rule are :func:`segment_mass`'s."""
    n_heads, rows, dim = query.shape
    kv_heads, n, _ = keys.shape
    if rows == 0 or n == 0:
        return
    device = query.device
    k = keys.to(device=device, dtype=torch.float32)
    key_positions = key_positions.to(device)
    q_positions = query_positions.to(device)
    q = query.float().view(kv_heads, n_heads // kv_heads, rows, dim)
    block = max(1, int(block_elements) // max(1, n_heads * n))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        logits = torch.einsum("kgrd,knd->kgrn", q[:, :, start:stop], k) * scaling
        future = key_positions[None, :] > q_positions[start:stop, None]  # [b, n]
        logits = logits.masked_fill(future[None, None], float("-inf"))
        yield start, stop, torch.softmax(logits, dim=-1).reshape(n_heads, stop - start, n)


def reduce_heads(values: torch.Tensor, heads: str) -> torch.Tensor:
    """``values`` ``[H, ...]`` combined over the query heads (``HEAD_REDUCTIONS``)."""
    if heads == "mean":
        return values.mean(dim=0)
    if heads == "max":
        return values.amax(dim=0)
    return values.sum(dim=0)


def segment_membership(labels: torch.Tensor, n_segments: int) -> torch.Tensor:
    """One-hot ``[n, n_segments]`` float32 membership of keys labelled ``labels`` ``[n]`` (``-1``: a key of no
    segment, an all-zero row)."""
    n, device = labels.shape[0], labels.device
    labels = labels.long()
    member = torch.zeros(n, n_segments + 1, dtype=torch.float32, device=device)
    member[torch.arange(n, device=device), torch.where(labels < 0, n_segments, labels)] = 1.0
    return member[:, :n_segments]


def segment_mass(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    key_segments: torch.Tensor,
    n_segments: int,
    scaling: float,
    *,
    heads: str = "mean",
    block_elements: int = 1 << 22,
) -> torch.Tensor:
    """Attention mass of each query row on each segment of keys, ``[rows, n_segments]`` (float32).

    ``query`` ``[H, rows, d]`` and ``keys`` ``[kv_heads, n, d]`` are post-RoPE (query head ``h`` reads KV
    head ``h // (H / kv_heads)``); ``query_positions`` ``[rows]`` and ``key_positions`` ``[n]`` are
    prompt positions (a key attends a row when its position is at most the row's); ``key_segments``
    ``[n]`` labels each key with a segment in ``[0, n_segments)``, or ``-1`` for a key that is attended
    (it takes part in the softmax) but counted in no segment. Entry ``[r, s]`` is
    ``reduce_h sum_{keys k of s} softmax_h(q_r · K / sqrt)[k]`` with ``reduce`` = ``heads``.
    """
    if heads not in HEAD_REDUCTIONS:
        raise ValueError(f"heads={heads!r} is not one of {HEAD_REDUCTIONS}")
    rows, n, device = query.shape[1], keys.shape[1], query.device
    out = torch.zeros(rows, n_segments, dtype=torch.float32, device=device)
    if rows == 0 or n == 0:
        return out
    member = segment_membership(key_segments.to(device), n_segments)  # the sums are one matmul
    for start, stop, probs in probability_blocks(query, query_positions, keys, key_positions, scaling, block_elements):
        out[start:stop] = reduce_heads(probs @ member, heads)  # [H, b, segments] -> [b, segments]
    return out


def column_mass(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    *,
    heads: str = "mean",
    block_elements: int = 1 << 22,
) -> torch.Tensor:
    """Attention *received* by each key, summed over the query rows, ``[n]`` (float32): H2O's accumulated
    attention score (Prefill-H2O, :mod:`kvbench.methods.prefill_h2o`).

    Shapes and the causal rule are :func:`segment_mass`'s: ``query`` ``[H, rows, d]`` and ``keys``
    ``[kv_heads, n, d]`` post-RoPE, a key takes part in a row's softmax when its position is at most the
    row's (so a key's column sums the rows at or after it, its own row included). Entry ``k`` is
    ``reduce_h sum_r softmax_h(q_r · K / sqrt)[k]`` with ``reduce`` = ``heads`` applied to each head's
    column sums (``max``: the largest head's sum). Row blocks of at most ``block_elements`` logits, never
    the whole ``heads × rows × keys`` matrix.
    """
    if heads not in HEAD_REDUCTIONS:
        raise ValueError(f"heads={heads!r} is not one of {HEAD_REDUCTIONS}")
    per_head = torch.zeros(query.shape[0], keys.shape[1], dtype=torch.float32, device=query.device)
    for _, _, probs in probability_blocks(query, query_positions, keys, key_positions, scaling, block_elements):
        per_head += probs.sum(dim=1)
    return reduce_heads(per_head, heads)
