"""``profile.deviation`` of a reuse prefill: how far reused and blended K/V and the query rows' attention are
from a full prefill's (CacheBlend Figs. 6-8), computed after the prefill from the plan's store and the
full prefill's K, V and Q (:class:`~kvbench.engine.reuse.ReusePrefill`'s ``reference``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvbench.engine.reuse import ReusePrefill


def deviation(plan: ReusePrefill) -> dict[str, Any]:
    """How far reuse is from a full prefill (CacheBlend Figs. 6–8), computed after the prefill.

    * ``reused_kv``: per layer, the KV deviation of every cached token *as reused* (re-rotated,
      before any recompute) from the full prefill's — squared L2 of V summed over heads and
      dimensions, the quantity CacheBlend selects by — as a 101-point quantile curve, its mean, and
      the share of the total carried by the top 15 % of tokens (Fig. 7);
    * ``spearman``: rank correlation of those per-token deviations between consecutive layers (Fig. 8);
    * ``attention``: per layer, the Frobenius norm of the difference between the query rows'
      attention (softmax over every prompt key, causal by position) in this prefill and in the full
      one, averaged over heads, and its mean over layers (Fig. 6's y axis);
    * ``blended_kv``: per layer, the mean KV deviation of all tokens after this method's recompute;
    * ``chunks``: one entry per cached span (the exact prefix and every reused chunk, prompt order),
      keyed by its ``begin`` / ``end`` in the prompt (``mode``: its store key's mode) so that a
      method's per-chunk telemetry can be joined with it: ``reused_v``, the mean over its tokens and
      over every layer of the V deviation *as reused* (before any recompute; the quantity of
      ``reused_kv`` above), and ``blended_v``, the same after this method's recompute (what the fix
      left; V only, so that the two compare). 0 for a span whose cache was computed after exactly
      this prompt's tokens.
    """
    assert plan.reference is not None  # (called only with profile.deviation)
    keys_f, values_f, queries_f = plan.reference
    # per-token deviations are computed where the KV lives and read on the host (curves, ranks)
    device = keys_f[0].device if keys_f else torch.device("cpu")
    cached = torch.nonzero(plan.cached_mask).flatten().cpu()
    curves, means, top15, per_layer = [], [], [], []
    blended, attention_dev = [], []
    span_reused = torch.zeros(len(plan.spans), dtype=torch.float64)
    span_blended = torch.zeros(len(plan.spans), dtype=torch.float64)
    scale = plan.ctx.spec.head_dim**-0.5
    positions = torch.arange(plan.n, device=device)
    query_positions = positions[plan.query_mask.to(device)]
    for layer in range(len(keys_f)):
        host = _reused_deviation(plan, layer, values_f[layer], device).cpu()
        tokens = host[cached]
        per_layer.append(tokens)
        curve, mean, share = _curve(tokens)
        curves.append(curve)
        means.append(mean)
        top15.append(share)
        kv = plan.ctx.store[layer]
        blend_k, blend_v = kv.keys[:, : plan.n].to(device).float(), kv.values[:, : plan.n].to(device).float()
        blend_v_dev = (blend_v - values_f[layer].float()).pow(2).sum(dim=(0, 2))
        blended.append(float((blend_v_dev + (blend_k - keys_f[layer].float()).pow(2).sum(dim=(0, 2))).mean()))
        blend_host = blend_v_dev.cpu()
        for i, span in enumerate(plan.spans):
            span_reused[i] += float(host[span.begin : span.end].double().mean())
            span_blended[i] += float(blend_host[span.begin : span.end].double().mean())
        q_b, q_f = plan._queries.get(layer), queries_f[layer]
        if q_b is not None and q_b.shape[1]:
            a_b = _attention(q_b.float(), blend_k, query_positions, positions, scale)
            a_f = _attention(q_f.float(), keys_f[layer].float(), query_positions, positions, scale)
            attention_dev.append(float((a_b - a_f).flatten(1).norm(dim=1).mean()))
    spearman = [_spearman(a, b) for a, b in zip(per_layer, per_layer[1:])]
    chunks = _chunk_deviations(plan, span_reused, span_blended, max(1, len(keys_f)))
    return {
        "metric": "V squared L2 summed over heads and dims (reused_kv); K+V (blended_kv)",
        "reused_kv_quantiles": curves,
        "reused_kv_mean": means,
        "reused_kv_top15_share": top15,
        "spearman": spearman,
        "blended_kv_mean": blended,
        "attention": attention_dev,
        "attention_mean": float(sum(attention_dev) / len(attention_dev)) if attention_dev else None,
        "chunks": chunks,
    }


def _reused_deviation(plan: ReusePrefill, layer: int, values_f: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Per token at ``layer``, the V deviation of the cached rows as reused from the full prefill's (else 0)."""
    dev = torch.zeros(plan.n, device=device)
    for span in plan.spans:
        assert span.reader is not None
        _, v = span.reader.layer(layer)
        v = v[:, span.rows].to(device).float()
        dev[span.begin : span.end] = (v - values_f[:, span.begin : span.end].float()).pow(2).sum(dim=(0, 2))
    return dev


def _chunk_deviations(
    plan: ReusePrefill, span_reused: torch.Tensor, span_blended: torch.Tensor, layers: int
) -> list[dict[str, Any]]:
    """One entry per cached span: its place, mode and mean V deviation over ``layers``, reused and blended."""
    return [
        {
            "begin": span.begin,
            "end": span.end,
            "mode": span.key.mode,
            "reused_v": float(span_reused[i]) / layers,
            "blended_v": float(span_blended[i]) / layers,
        }
        for i, span in enumerate(plan.spans)
    ]


def _curve(tokens: torch.Tensor) -> tuple[list[float], float, float]:
    """Per-token deviations' 101-point quantile curve, mean, and share of the total held by the top 15 %."""
    ordered = torch.sort(tokens).values
    curve = [round(float(x), 6) for x in torch.quantile(ordered, torch.linspace(0, 1, 101))] if tokens.numel() else []
    mean = float(tokens.mean()) if tokens.numel() else 0.0
    k = max(1, int(0.15 * tokens.numel()))
    total = float(tokens.sum())
    return curve, mean, float(ordered[-k:].sum()) / total if total > 0 else 0.0


def _attention(
    q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention ``[heads, rows, keys]`` of queries ``[heads, rows, d]`` over keys ``[kv_heads, n, d]``
    (query head h reads KV head h // group), causal by position."""
    group = q.shape[0] // k.shape[0]
    logits = torch.einsum("hrd,hnd->hrn", q, k.repeat_interleave(group, dim=0)) * scale
    logits = logits.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks of ``x`` with ties given their average rank (as Spearman's coefficient defines them)."""
    values, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(values, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2  # 1-based average rank of each group of equal values
    ranks = torch.empty(x.numel(), dtype=torch.float64)
    ranks[order] = average[inverse]
    return ranks


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman rank correlation of two equally long vectors (average ranks for ties; None when either
    is constant, e.g. layer 0, whose KV cannot deviate)."""
    if a.numel() < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denominator if denominator > 1e-12 else None
