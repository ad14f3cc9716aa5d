"""``sparq``: SparQ Attention (Ribar et al., 2024) as PQCache configures it (seed-pqcache.md §3.4).

Per decode step and KV head: take the ``r`` query components of largest magnitude (summed over the
group's query heads), fetch only those components of every middle key from the host tier, score
``ŝ = q[i_r]·K[:, i_r] / sqrt(d · ‖q[i_r]‖₁ / ‖q‖₁)`` per query head, sum the group's scores, and
attend the top-``select`` tokens exactly, with the sinks and local window.

``r`` comes from the extra-communication budget: fetching ``r`` of ``d_h`` components of every key is
``r / d_h`` of the keys' bytes, so ``r = round(budget.comm_ratio · d_h)`` (1 for 1/128 and 2 for 1/64
at ``d_h`` = 128), at least 1 — with ``d_h`` = 64 (SmolLM2, Qwen2.5-Coder-0.5B) 1/128 cannot be met and the
recorded ratio is 1/64. ``method.r`` overrides. Mean-value reallocation is off, as in PQCache's runs.
The component fetch is counted as index traffic, every step (it depends on the query, so it cannot
be prefetched).

Static decode step (:mod:`kvbench.engine.decode`): the scores are computed over every slot of the
layer's bucket (``[0, bucket_end)``, a shape fixed within a length bucket), the slots that are not
middle tokens (the sinks, the local window, the current token, unheld slots) are masked to ``-inf``,
and :func:`~kvbench.methods.primitives.pq.topk_keyed` takes the top ``select`` — the indices
``topk_sorted`` took over the middle alone, ties to the lower slot. A key's score depends on that key
only, so the wider bucket changes no middle score. The scores are computed where the keys live (the
host tier when offloading, as before); a covering budget is the dense step (``select`` returns None).
What changes only with the bucket (the slots' ranges, ``topk_keyed``'s reversed iota) is made on the
host in :meth:`SparQ.before_step`, so a step issues fewer ops per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import RetrievalParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import topk_keyed
from kvbench.params import param


def sparq_scores(query: torch.Tensor, keys: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Approximate scores ``[kv_heads, n]`` (group-summed) and the chosen components ``[kv_heads, r]``.

    ``query`` ``[kv_heads, group, d]`` (float32), ``keys`` ``[kv_heads, n, d]``, float32 or the cache's
    dtype: the ``r`` chosen components are converted after the gather (the values of converting every key
    first, without copying whole keys). ``‖q[i_r]‖₁`` gathers the magnitudes ``|q|`` already taken for the
    components (the same numbers as ``|q[i_r]|``), and index shapes are views: fewer ops per decode step.
    """
    h, g, d = query.shape
    magnitude = query.abs()
    components = torch.topk(magnitude.sum(dim=1), r, dim=-1).indices  # [kv_heads, r]
    q_index = components.view(h, 1, r).expand(h, g, r)
    q_r = torch.gather(query, 2, q_index)  # [h, g, r]
    k_r = torch.gather(keys, 2, components.view(h, 1, r).expand(h, keys.shape[1], r))  # [h, n, r]
    if k_r.dtype != torch.float32:
        k_r = k_r.float()
    share = torch.gather(magnitude, 2, q_index).sum(-1) / magnitude.sum(-1).clamp_min(1e-12)  # ‖q[i_r]‖₁ / ‖q‖₁
    scale = torch.sqrt(d * share).clamp_min(1e-12)  # [h, g]
    scores = torch.einsum("hgr,hnr->hgn", q_r, k_r) / scale.view(h, g, 1)
    return scores.sum(dim=1), components


@dataclass(frozen=True)
class _Bucket:
    """Constants of a static step's length bucket (made on the host, once per bucket)."""

    end: int  # bucket_end
    device: torch.device  # the layer's compute device
    reach: torch.Tensor  # [end]: slot + 1 + local (a middle slot: reach < length); int64 max for the sinks
    back: torch.Tensor  # [local + 1]: local, ..., 0 (the local window and the current token: current - back)
    reversed_iota: torch.Tensor  # [end]: topk_keyed's keys, where the scores are computed


@dataclass(frozen=True)
class SparQParams(RetrievalParams):
    r: int | None = param(None, "query components fetched; null: round(budget.comm_ratio * head_dim), >= 1", min=1)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)


@register
class SparQ(RetrievalMethod):
    name = "sparq"
    Params = SparQParams
    params: SparQParams

    static_decode = True

    def rank(self) -> int:
        d = self.ctx.spec.head_dim
        if self.params.r is not None:
            return max(1, min(d, self.params.r))
        return max(1, min(d, round(self.ctx.budget.comm_ratio * d)))

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self._buckets: _Bucket | None = None

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """The top-``select`` middle tokens by approximate score (static step: scores over the layer's
        bucket, the slots that are not middle tokens masked; module docstring)."""
        if self.covers(kv):
            return None
        spec, budget = self.ctx.spec, self.ctx.budget
        bucket = self._bucket(kv)
        assert kv.length is not None and kv.current is not None
        r = self.rank()
        keys, _ = kv.bucket()  # (the home tier: the host's when offloading, where the scores were computed)
        q = _on(query[0, :, 0, :], keys.device).view(spec.n_kv_heads, spec.group, -1)
        scores, _ = sparq_scores(q if q.dtype == torch.float32 else q.float(), keys, r)  # [kv_heads, end]
        outside = _on(bucket.reach >= kv.length, scores.device)  # not a middle token
        scores = scores.masked_fill(outside, float("-inf"))
        if kv.offload:  # (eager: the host's layout counts the component fetch)
            kv.count_index_bytes(spec.n_kv_heads * self.layout(kv).middle * r * kv.element_bytes)
        chosen = _on(topk_keyed(scores, budget.select, reversed_iota=bucket.reversed_iota), kv.device)
        rows = spec.n_kv_heads
        sinks, local = kv.iota(budget.sink).expand(rows, -1), (kv.current - bucket.back).expand(rows, -1)
        return Selection(slots=torch.cat([sinks, chosen, local], dim=1), selected=chosen)

    def before_step(self, ctx: Any) -> None:
        """This bucket's constants (:class:`_Bucket`), made on the host when the bucket changes."""
        self._bucket(self.compressing_kv())

    def _bucket(self, kv: LayerKV) -> _Bucket:
        """The constants of ``kv``'s bucket: made by :meth:`before_step` on the static step, found here
        (``select`` makes them only on the dynamic step, which has no ``before_step``)."""
        found = self._buckets
        if found is None or found.end != kv.bucket_end or found.device != kv.device:
            sink, local, end = self.ctx.budget.sink, self.ctx.budget.local, kv.bucket_end
            reach = torch.arange(1 + local, end + 1 + local, device=kv.device)
            reach[:sink] = torch.iinfo(torch.int64).max  # (never a candidate)
            found = self._buckets = _Bucket(
                end=end,
                device=kv.device,
                reach=reach,
                back=torch.arange(local, -1, -1, device=kv.device),
                reversed_iota=torch.arange(end - 1, -1, -1, device=kv.home),
            )
        return found

    def telemetry(self) -> dict[str, Any]:
        if not self.started:
            return {}
        r = self.rank()
        return {"r": r, "comm_ratio_used": r / self.ctx.spec.head_dim}


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, with no op when it is there already (a decode step counts its ops)."""
    return tensor if tensor.device == device else tensor.to(device)
