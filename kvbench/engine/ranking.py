"""Ranking primitives the engine and the methods share: GQA score rules and exact, static top-k.

They live in the engine because its recall profiler ranks with them too (:mod:`kvbench.engine.recall`);
methods import them from here (``methods/primitives/pq.py`` re-exports them).
"""

from __future__ import annotations

import torch
from torch import Tensor

#: how a KV head's query heads combine their scores (PQCache's code: ``softmax_sum``)
GQA_RULES = ("softmax_sum", "logit_sum", "max")


def group_scores(scores: Tensor, rule: str = "softmax_sum", scale: float | None = None) -> Tensor:
    """One score per KV head and token ``[G, n]`` from the ``[G, R, n]`` scores of its query heads.

    ``softmax_sum`` (the PQCache code's rule): per query head ``softmax(scale · s)`` over the given
    tokens, summed over the group; needs ``scale`` (``1/sqrt(head_dim)``). ``logit_sum``: raw scores
    summed. ``max``: the largest over the group."""
    values = scores.float()
    if rule == "softmax_sum":
        if scale is None:
            raise ValueError("rule 'softmax_sum' needs scale (1/sqrt(head_dim))")
        return torch.softmax(values * scale, dim=-1).sum(dim=1)
    if rule == "logit_sum":
        return values.sum(dim=1)
    if rule == "max":
        return values.amax(dim=1)
    raise ValueError(f"unknown GQA rule {rule!r}; use one of {GQA_RULES}")


def topk_ascending(values: Tensor, k: int) -> Tensor:
    """Indices ``[..., min(k, n)]`` of the ``k`` largest values per row, in ascending order.

    Deterministic ties: among equal values the lower index wins (NaN counts as −inf). ``topk`` only
    finds the k-th largest value; the pick itself is a mask and a prefix sum, so it is O(n) and needs
    no host sync.

    The k-th largest value comes from ``kthvalue`` (a selection, O(n)) rather than ``topk`` (which
    sorts ``k`` values): the same number, 4-5x faster at a decode step's sizes on a CPU. On a CPU,
    where reading a count costs nothing, the common case takes a shortcut: when exactly ``k`` values
    per row reach the k-th largest (no tie straddles it), they are the pick, listed by ``nonzero``
    (each pass over a decode step's scores costs tens of microseconds there, cold from the model's
    weights streaming through the caches)."""
    n = values.shape[-1]
    k = min(k, n)
    if k <= 0:
        return torch.empty(*values.shape[:-1], 0, dtype=torch.long, device=values.device)
    inf = float("inf")
    v = values.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)  # one pass; infinities stay as they are
    kth = v.kthvalue(n - k + 1, dim=-1, keepdim=True).values
    if v.device.type == "cpu":
        reach = v >= kth
        if bool((reach.sum(dim=-1) == k).all()):
            return torch.nonzero(reach)[:, -1].view(*values.shape[:-1], k)
    above = v > kth
    tied = v == kth
    room = k - above.sum(dim=-1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=-1) <= room))
    slot = torch.where(take, take.cumsum(dim=-1) - 1, k)  # slot k collects the rest
    out = torch.zeros(*values.shape[:-1], k + 1, dtype=torch.long, device=values.device)
    positions = torch.arange(n, device=values.device).expand_as(slot)
    return out.scatter_(-1, slot, positions)[..., :k]


def topk_keyed(
    values: Tensor,
    k: int,
    *,
    reversed_iota: Tensor | None = None,
    nonnegative: bool = False,
    offset: int = 0,
) -> Tensor:
    """:func:`topk_ascending` with no host read and one ``topk``: the same indices, ties alike.

    Each value becomes an int64 key ``order(value) · 2³² + (n - 1 - index)``, where ``order`` maps a float32
    to an int32 of the same order (negative floats: all bits but the sign flipped; ``-0.0`` is made
    ``+0.0`` first, NaN counts as −inf). The ``k`` largest keys are the ``k`` largest values, equal values
    taken lowest index first; their indices (plus ``offset``) are sorted ascending (a sort of ``k``, not
    ``n``). Every shape is fixed by ``values.shape`` and ``k``, so a decode step that calls it can be
    captured. ``reversed_iota`` (``n - 1, ..., 0``, int64, optional) saves making it; ``nonnegative``: the
    caller knows every value is ≥ 0 or −inf, never NaN (a softmax, masked), which skips the mapping."""
    n = values.shape[-1]
    k = min(k, n)
    if k <= 0:
        return torch.empty(*values.shape[:-1], 0, dtype=torch.long, device=values.device)
    v = values if values.dtype == torch.float32 else values.float()
    if nonnegative:  # (−inf's bits are a negative int32: below every value ≥ 0)
        ordered = v.view(torch.int32).to(torch.int64)
    else:
        v = v.nan_to_num(nan=-float("inf"), posinf=float("inf"), neginf=-float("inf")) + 0.0  # (-0.0 -> +0.0)
        bits = v.view(torch.int32)
        ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    if reversed_iota is None:
        reversed_iota = torch.arange(n - 1, -1, -1, device=values.device)
    key = torch.add(reversed_iota, ordered, alpha=1 << 32)
    top = torch.topk(key, k, dim=-1, sorted=False).values
    return torch.sort((n - 1 + offset) - (top & 0xFFFFFFFF), dim=-1).values
