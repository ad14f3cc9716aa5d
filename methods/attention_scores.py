"""Attention statistics that the KV-dropping methods rank tokens by, in bounded memory.

* :func:`accumulated_attention` — H2O's heavy-hitter statistic: the attention every key receives from
  all (causal) queries of the prompt, summed per query head. Queries are processed in chunks whose
  attention block has at most ``max_elements`` entries (``chunk`` rows), so a 16k-token prompt never
  materialises its 16k × 16k matrix; only keys up to the chunk's last query are read (causality).
* :func:`window_votes` — SnapKV's vote: the summed causal softmax attention of the prompt's last
  ``window`` queries (the observation window), per query head, over every key.
* :func:`pool1d` — SnapKV's smoothing of votes along the sequence (``avg`` or ``max``, odd kernel,
  stride 1, same length; zero padding counts in the average, as ``F.avg_pool1d`` does by default).
* :func:`group_reduce` — per-KV-head scores from the query heads of a GQA group: ``sum`` (default),
  ``mean`` or ``max``. ``sum`` and ``mean`` differ by the constant group size, so they always rank
  tokens identically; ``max`` ranks differently (a token one head needs badly beats a token every head
  likes a little).

Every function takes the engine's per-layer tensors without the batch axis: ``query`` ``[H, s, d]``
(post-RoPE), ``keys`` ``[H_kv, s, d]`` with ``H = group · H_kv`` (query head ``h`` reads KV head
``h // group``), and computes in float32 whatever the model's dtype. Scores are per query head
(``[H, n]``); methods reduce them over the group when they rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GQA_REDUCTIONS = ("sum", "mean", "max")
POOLINGS = ("avg", "max")

#: default cap on the entries of one chunk's attention block (fp32: 32 MiB)
MAX_CHUNK_ELEMENTS = 1 << 23


def _grouped(query: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    heads, kv_heads = query.shape[0], keys.shape[0]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} KV heads")
    group = heads // kv_heads
    return query.reshape(kv_heads, group, *query.shape[1:]), group


def chunk_rows(heads: int, length: int, max_elements: int = MAX_CHUNK_ELEMENTS) -> int:
    """Query rows per chunk so that a ``[heads, rows, length]`` block stays under ``max_elements``."""
    return max(1, min(length, max_elements // max(1, heads * length)))


def accumulated_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    *,
    chunk: int | None = None,
    max_elements: int = MAX_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Column sums ``[H, s]`` of the causal softmax attention of ``query`` over ``keys``.

    Entry ``[h, j]`` is ``sum_i softmax_j(q_i · k_j · scale)`` over the queries ``i >= j`` of head ``h``.
    ``chunk`` fixes the query rows per chunk; by default it is derived from ``max_elements``. The
    result does not depend on the chunking (up to float rounding).
    """
    heads, s, _ = query.shape
    grouped, group = _grouped(query, keys)
    kv_heads = keys.shape[0]
    rows = int(chunk) if chunk else chunk_rows(heads, s, max_elements)
    total = torch.zeros(kv_heads, group, s, dtype=torch.float32, device=query.device)
    k32 = keys.float()
    for start in range(0, s, rows):
        end = min(start + rows, s)
        # [kv, g, c, end]: this chunk's queries against the keys they can see
        block = torch.einsum("hgqd,hkd->hgqk", grouped[:, :, start:end].float(), k32[:, :end])
        block.mul_(scale)
        if end - start > 1:
            # query start + r sees keys <= start + r: mask the upper triangle of the last (end - start) columns
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).triu_(1)
            block[..., start:end].masked_fill_(future, float("-inf"))
        # in-place softmax: one buffer of the block's size
        block.sub_(block.amax(dim=-1, keepdim=True)).exp_()
        block.div_(block.sum(dim=-1, keepdim=True))
        total[..., :end] += block.sum(dim=2)
        del block
    return total.reshape(heads, s)


def window_votes(query: torch.Tensor, keys: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Summed attention ``[H, s]`` of the last ``window`` queries over all ``s`` keys.

    Each window query takes its causal softmax over the keys up to itself (SnapKV); the sum over the
    window rows is the vote. Columns inside the window receive only the votes of the queries after
    them; callers slice the prefix they rank.
    """
    heads, s, _ = query.shape
    window = max(1, min(int(window), s))
    grouped, group = _grouped(query, keys)
    logits = torch.einsum("hgqd,hkd->hgqk", grouped[:, :, s - window :].float(), keys.float()) * scale
    future = torch.ones(window, window, dtype=torch.bool, device=query.device).triu_(1)
    logits[..., s - window :] = logits[..., s - window :].masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(dim=2).reshape(heads, s)


def pool1d(scores: torch.Tensor, kernel: int, kind: str = "avg") -> torch.Tensor:
    """Smooth ``[*, n]`` scores along ``n`` with an odd ``kernel`` (stride 1, same length).

    ``avg``: mean over the window, zero padding included at the edges; ``max``: max over the window.
    A kernel of 1 (or less) returns the scores unchanged.
    """
    if kind not in POOLINGS:
        raise ValueError(f"unknown pooling {kind!r}; use one of {POOLINGS}")
    kernel = int(kernel)
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    if kernel % 2 == 0:
        raise ValueError(f"the pooling kernel must be odd to keep tokens aligned, got {kernel}")
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pool = F.avg_pool1d if kind == "avg" else F.max_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(scores.shape)


def group_reduce(scores: torch.Tensor, group: int, rule: str = "sum") -> torch.Tensor:
    """``[H, n]`` (or ``[H_kv, group, n]``) query-head scores → ``[H_kv, n]`` KV-head scores."""
    grouped = scores.reshape(-1, group, scores.shape[-1])
    if rule == "sum":
        return grouped.sum(dim=1)
    if rule == "mean":
        return grouped.mean(dim=1)
    if rule == "max":
        return grouped.amax(dim=1)
    raise ValueError(f"unknown GQA reduction {rule!r}; use one of {GQA_REDUCTIONS}")
