"""The exact scores a recall profile compares a selection with (``profile.recall``, :mod:`kvbench.telemetry`).

The engine's recall profiler (:meth:`~kvbench.engine.context.GenerationContext.profile_step`) and the
Oracle rank with the same functions: exact ``q·k`` logits per KV head group, a GQA rule, and the exact
top-k with ties to the lower slot.
"""

from __future__ import annotations

import torch

from kvbench.engine.ranking import group_scores
from kvbench.engine.ranking import topk_ascending as topk_sorted


def group_logits(query: torch.Tensor, keys: torch.Tensor, group: int) -> torch.Tensor:
    """Exact ``q·k`` logits ``[kv_heads, group, n]`` from ``query`` ``[1, H, 1, d]`` and ``keys``
    ``[kv_heads, n, d]``."""
    q = query[0, :, -1, :].to(device=keys.device, dtype=torch.float32)
    q = q.view(keys.shape[0], group, -1)
    return torch.einsum("hgd,hnd->hgn", q, keys.to(torch.float32))


def aggregate(
    logits: torch.Tensor, rule: str, scale: float, candidates: torch.Tensor | slice | None = None
) -> torch.Tensor:
    """Per-KV-head token scores ``[kv_heads, n_candidates]`` from ``[kv_heads, group, n]`` exact logits.

    ``candidates``: slots (a tensor), or a ``slice`` for a contiguous range (a view: no gather).

    ``softmax_sum`` is the PQCache authors' Oracle: per query head softmax over *all* held tokens, then
    sliced to the candidates and summed over the group (their approximate path normalises over the
    candidates only: ``group_scores`` on the candidates' scores). ``logit_sum`` / ``max``: see
    :func:`~kvbench.methods.primitives.pq.group_scores`.
    """
    if rule == "softmax_sum" and candidates is not None:
        return torch.softmax(logits * scale, dim=-1)[..., candidates].sum(dim=1)
    return group_scores(logits if candidates is None else logits[..., candidates], rule, scale)


def exact_topk(
    query: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor | slice,
    k: int,
    *,
    group: int,
    per_query_head: bool,
    rule: str = "softmax_sum",
    scale: float,
) -> torch.Tensor:
    """The exact top-``k`` candidate slots: ``[kv_heads, k]`` under a GQA rule, or ``[q_heads, k]``
    by each query head's own logits, ascending per row. This is the Oracle's pick and the recall
    reference. ``candidates``: slots, or a ``slice(start, stop)`` of consecutive slots (the middle of a
    :class:`Layout`), which reads the logits through a view instead of a gather."""
    logits = group_logits(query, keys, group)
    if isinstance(candidates, slice):
        start = candidates.start or 0
        picked = logits[..., candidates]
        scores = picked.reshape(-1, picked.shape[-1]) if per_query_head else aggregate(logits, rule, scale, candidates)
        return topk_sorted(scores, k) + start
    cand = candidates.to(keys.device)
    if per_query_head:
        scores = logits[..., cand].reshape(-1, cand.numel())
    else:
        scores = aggregate(logits, rule, scale, cand)
    return cand[topk_sorted(scores, k)]


def attended_recall(
    query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, prompt: int, b: int
) -> torch.Tensor:
    """Recall of the exact top-``b`` prompt tokens per query head: ``[H]`` fractions in ``[0, 1]``.

    The ClusterKV paper's Fig. 11 quantity (``|I_T ∩ I_T^true| / B``; its code's ``stat_topk``):

    * **exact set** of query head ``h``: the ``b`` prompt tokens (``positions < prompt``, sinks included)
      with the largest raw ``q_h · k`` (no softmax, no group reduction), ranked over every held prompt
      key of the head's KV head; ties go to the lower slot;
    * **predicted set**: the prompt tokens among ``slots`` — everything the method attends at this
      step (sinks, local window and selected alike; generated tokens never count). ``slots`` is
      ``[rows, a]``: rows = query heads (a per-query-head selection), or KV heads, whose set every query
      head of the group attends;
    * ``|predicted ∩ exact| / b``. With ``b`` larger than the held prompt the denominator is the held
      prompt (the method can then attend all of it, which scores 1).

    ``query`` ``[1, H, 1, d]``, ``keys`` ``[kv_heads, n, d]``, ``positions`` ``[kv_heads, n]``. Which
    method produced ``slots`` plays no part: two methods attending the same tokens score the same.
    """
    heads, kv_heads = query.shape[1], keys.shape[0]
    group = heads // kv_heads
    logits = group_logits(query, keys, group).reshape(heads, -1)  # row h: query head h against KV head h // group
    in_prompt = (positions < prompt).to(logits.device).repeat_interleave(group, dim=0)
    k = min(int(b), int(in_prompt.sum(dim=1).min()))
    if k <= 0:
        raise ValueError(f"recall needs a positive budget and held prompt tokens, got b={b}")
    exact = topk_sorted(logits.masked_fill(~in_prompt, float("-inf")), k)
    truth = torch.zeros_like(in_prompt).scatter_(1, exact, True)
    rows = slots.shape[0]
    if heads % rows:
        raise ValueError(f"cannot map {rows} selection rows onto {heads} query heads")
    attended = slots.to(logits.device).repeat_interleave(heads // rows, dim=0)
    predicted = torch.zeros_like(in_prompt).scatter_(1, attended, True)
    return (predicted & truth).sum(dim=1).float() / k
