"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023), as PQCache's baseline code runs it.

Each KV head keeps its ``sink`` first tokens (32), the ``local`` most recent tokens and ``select``
"heavy hitters": the tokens with the largest attention *accumulated* over every query so far, summed
over the query heads of the KV head's GQA group (``gqa``: ``sum``, or ``mean`` / ``max``). Heavy =
recent = half the budget (``local_fraction: 0.5``), all from kvbench's shared budget
(``kvbench/budget.py``; "(C)" compensation applies: H2O drops KV).

* **Prefill.** After the layer's dense attention, the accumulated attention of every prompt key is
  recomputed from the prompt's queries in chunks (:func:`~kvbench.methods.attention_scores.accumulated_attention`,
  ``chunk`` rows, or automatic so that a chunk's attention block stays under ``chunk_elements``
  entries): a 16k-token prompt never materialises its s × s attention. Each KV head keeps sinks +
  top-``select`` of the middle + the last ``local`` prompt tokens; the store forgets the rest.
* **Decode.** Every step attends all held tokens (``sink + budget`` plus the current one), adds the
  step's attention probabilities to the scores of the held slots (the new token starts with its own
  attention), and evicts, per KV head, the lowest-scoring token that is neither a sink nor among the
  ``local`` most recent positions (the current token included, also with ``budget.local=0``: a token
  is never evicted at the step that produced it). The cache therefore stays at
  ``sink + budget`` tokens after every step, and a token evicted once never returns. "Recent" is by
  position (``kv.positions``), since eviction reorders slots (``swap_remove``: O(1) per step, no copy
  of the layer; ``swap_remove: false`` uses the order-keeping ``remove``).

Choices where the papers are silent (PQCache's ``KVCacheH2OOfficial``, seed-pqcache.md §3.4):

* Scores are kept per *query* head and reduced over the group when ranking. With ``gqa: sum`` this is
  exactly the authors' code (accumulate group sums); ``mean`` ranks identically to ``sum``; ``max``
  is the max over the group of the per-head accumulated attention (the authors' code applies ``max``
  to the prefill scores only and sums at decode, which mixes two statistics).
* Accumulated scores are plain sums (no decay, no normalisation by the number of queries that could
  see a key): older tokens collect attention from more queries, as in H2O and the authors' code.
* The authors' code simulates eviction with attention masks over a full cache; kvbench evicts for
  real, which attends the same tokens with the same probabilities (masked entries get zero weight) and
  makes the held bytes real.
* Ties among equal scores keep the lower slot (prefill) / evict the first found (decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvbench.budget import MethodBudgetDefaults
from kvbench.engine.protocol import QueryStatistic, Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.attention_scores import accumulated_attention, group_reduce
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import GqaReduction, MethodParams
from kvbench.methods.selection import topk_sorted
from kvbench.params import param

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


@dataclass(frozen=True)
class H2OParams(MethodParams):
    sink: int = param(32, "PQCache's baseline code: 32 sinks outside the budget", min=0)
    local_fraction: float = param(0.5, "recent = heavy hitters = half the budget", min=0, max=1)
    gqa: GqaReduction = param("sum", "accumulated scores over a KV head's query heads: sum (authors) | mean | max")
    chunk: int = param(0, "prefill query rows per chunk of the accumulated-attention pass (0: automatic)", min=0)
    chunk_elements: int = param(1 << 23, "automatic chunks: attention entries at once (2**23: 32 MiB in fp32)", min=1)
    swap_remove: bool = param(True, "decode eviction in O(1) per step (false: order-keeping remove, copies)")


@register
class H2O(EvictionMethod):
    name = "h2o"
    Params = H2OParams
    params: H2OParams
    budget_defaults = MethodBudgetDefaults(compensable=True)
    needs_attention_probs = True
    static_decode = False  # evicts at every decode step from the scores it reads back

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self.gqa = self.params.gqa
        self.chunk = self.params.chunk
        self.chunk_elements = self.params.chunk_elements
        self.swap = self.params.swap_remove
        #: per layer: accumulated attention ``[kv_heads, group, n]`` of the held slots (float32)
        self.scores: dict[int, torch.Tensor] = {}
        self.evicted_in_decode = 0

    def start(self, ctx: GenerationContext) -> None:
        super().start(ctx)
        self.scores = {}
        self.evicted_in_decode = 0

    def _limit(self, layer: int) -> int:
        budget = self.ctx.budget
        return budget.sink + budget.layer_budget(layer)

    def _rank(self, scores: torch.Tensor) -> torch.Tensor:
        return group_reduce(scores, scores.shape[1], self.gqa)

    def prefill_statistics(self) -> tuple[QueryStatistic, ...]:
        return (self._received(),)

    def _received(self) -> QueryStatistic:
        """The attention every prompt token received from the prompt's queries ``[q_heads, s]``."""
        spec = self.ctx.spec
        return QueryStatistic(
            accumulated_attention,
            (spec.head_dim**-0.5,),
            (("chunk", self.chunk or None), ("max_elements", self.chunk_elements)),
        )

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        budget, spec = self.ctx.budget, self.ctx.spec
        s = kv.n
        received = self.query_statistic(self._received(), layer, query, key)
        scores = received.view(kv.n_kv_heads, spec.group, s).to(kv.home)
        if self._limit(layer) >= s:
            self.scores[layer] = scores
            return
        local = min(budget.local, s - budget.sink)
        recent_start = s - local
        heavy = topk_sorted(self._rank(scores)[:, budget.sink : recent_start], budget.select) + budget.sink
        fixed = torch.cat([torch.arange(budget.sink, device=kv.home), torch.arange(recent_start, s, device=kv.home)])
        keep = torch.sort(torch.cat([fixed.expand(kv.n_kv_heads, -1), heavy], dim=1), dim=1).values
        kv.keep(keep)
        self.scores[layer] = torch.gather(scores, 2, keep[:, None, :].expand(-1, spec.group, -1))

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        if probs is None or selection is not None:
            raise RuntimeError("h2o attends every held token and needs the step's attention probabilities")
        scores = self.scores[layer]
        heads, group, held = scores.shape
        if held < kv.n:  # the token appended at this step
            scores = torch.cat([scores, scores.new_zeros(heads, group, kv.n - held)], dim=2)
        scores += probs.to(device=kv.home, dtype=torch.float32).view(heads, group, kv.n)
        if kv.n > self._limit(layer):
            budget = self.ctx.budget
            positions = kv.positions
            # the token just generated always stays (with budget.local=0 nothing else recent is kept)
            protected = (positions < budget.sink) | (positions >= kv.seen - max(budget.local, 1))
            victim = self._rank(scores).masked_fill(protected, float("inf")).argmin(dim=1, keepdim=True)
            if self.swap:
                dst, src = kv.swap_remove(victim)
                index = torch.arange(heads, device=kv.home)[:, None]
                scores[index, :, dst] = scores[index, :, src]
                scores = scores[:, :, : kv.n]
            else:
                kept = torch.ones(heads, kv.n, dtype=torch.bool, device=kv.home).scatter_(1, victim, False)
                kv.remove(victim)
                scores = scores.transpose(1, 2)[kept].view(heads, kv.n, group).transpose(1, 2)
            self.evicted_in_decode += 1
        self.scores[layer] = scores

    def telemetry(self) -> dict[str, Any]:
        return {"evicted_in_decode": self.evicted_in_decode}

    def snapshot(self) -> dict[int, torch.Tensor]:
        """The accumulated scores of the held slots (decode steps add to them and evict with the store)."""
        return {layer: scores.clone() for layer, scores in self.scores.items()}

    def restore(self, state: dict[int, torch.Tensor]) -> None:
        self.scores = {layer: scores.clone() for layer, scores in state.items()}
