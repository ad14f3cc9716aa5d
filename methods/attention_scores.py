"""Attention statistics that KV-dropping methods rank tokens by, computed in bounded memory.

* :func:`accumulated_attention` — H2O's heavy-hitter score: how much attention each key receives from
  all (causal) queries of the prompt, summed. Computed in chunks of queries, so a 16k-token prompt
  never materialises its 16k × 16k attention matrix.
* :func:`window_votes` — SnapKV's vote: the attention of the last ``window`` queries (the observation
  window) over the keys before it.
* :func:`pool1d` — SnapKV's smoothing of votes along the sequence (avg or max, odd kernel, same length).
* :func:`group_reduce` — per-KV-head scores from the query heads of its GQA group (sum, mean, max).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GQA_REDUCTIONS = ("sum", "mean", "max")


def _expand(keys: torch.Tensor, heads: int) -> torch.Tensor:
    return keys.repeat_interleave(heads // keys.shape[0], dim=0)


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scale: float, chunk: int = 256) -> torch.Tensor:
    """Column sums ``[H, s]`` of the causal softmax attention of ``query`` ``[H, s, d]`` over ``keys`` ``[Hkv, s, d]``."""
    heads, s, _ = query.shape
    keys = _expand(keys.float(), heads)
    total = torch.zeros(heads, s, dtype=torch.float32, device=query.device)
    positions = torch.arange(s, device=query.device)
    for start in range(0, s, chunk):
        end = min(start + chunk, s)
        logits = torch.einsum("hqd,hkd->hqk", query[:, start:end].float(), keys[:, :end]) * scale
        causal = positions[None, :end] <= positions[start:end, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        total[:, :end] += probs.sum(dim=1)
    return total


def window_votes(query: torch.Tensor, keys: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Summed attention ``[H, s - window]`` of the last ``window`` queries over the keys before them.

    Each window query takes a causal softmax over all keys up to itself (SnapKV), then only the
    prefix columns are kept.
    """
    heads, s, _ = query.shape
    window = min(window, s)
    keys = _expand(keys.float(), heads)
    logits = torch.einsum("hqd,hkd->hqk", query[:, s - window :].float(), keys) * scale
    rows = torch.arange(s - window, s, device=query.device)[:, None]
    causal = torch.arange(s, device=query.device)[None, :] <= rows
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    return probs[:, :, : s - window].sum(dim=1)


def pool1d(scores: torch.Tensor, kernel: int, kind: str = "avg") -> torch.Tensor:
    """Smooth ``[*, n]`` scores along ``n`` with an odd ``kernel`` (stride 1, same length)."""
    if kernel <= 1:
        return scores
    if kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be odd, got {kernel}")
    flat = scores.reshape(-1, 1, scores.shape[-1])
    if kind == "avg":
        # count_include_pad (PyTorch's default): edges average over zero padding, as SnapKV's code does
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif kind == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"unknown pooling {kind!r}; use avg or max")
    return pooled.reshape(scores.shape)


def group_reduce(scores: torch.Tensor, group: int, rule: str = "sum") -> torch.Tensor:
    """``[H, n]`` query-head scores → ``[H / group, n]`` KV-head scores."""
    grouped = scores.reshape(scores.shape[0] // group, group, -1)
    if rule == "sum":
        return grouped.sum(dim=1)
    if rule == "mean":
        return grouped.mean(dim=1)
    if rule == "max":
        return grouped.amax(dim=1)
    raise ValueError(f"unknown GQA reduction {rule!r}; use one of {GQA_REDUCTIONS}")
