"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023) as PQCache's baseline code runs it (seed-pqcache.md §3.4).

Each KV head keeps its ``sink`` (32) first tokens, the ``local`` most recent tokens, and the
``select`` "heavy hitters" — the tokens with the largest attention accumulated over every query so
far (prompt queries at prefill, then each decode step's query), summed over the GQA group
(``gqa: sum``; ``mean``/``max`` optional). Heavy = recent = half the budget. During decode every step
adds its attention to the scores and evicts the lowest-scoring token outside the sinks and the recent
window, so the cache stays at ``sink + budget`` tokens (plus the current one).

Prefill scores are accumulated chunk by chunk of queries (``chunk``), so long prompts fit in memory;
H2O needs the attention weights, which fused attention kernels do not return — its prefill costs a
second pass over the attention.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.budget import MethodBudgetDefaults
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.attention_scores import accumulated_attention, group_reduce
from kvbench.methods.base import KVMethod, Selection
from kvbench.methods.selection import topk_sorted


@register
class H2O(KVMethod):
    name = "h2o"
    family = "eviction"
    budget_defaults = MethodBudgetDefaults(sink=32, local_fraction=0.5, compensable=True)
    needs_attention_probs = True

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, n] accumulated attention, per slot

    def on_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV) -> None:
        budget, spec = self.ctx.budget, self.ctx.spec
        received = accumulated_attention(query[0], key[0], spec.head_dim**-0.5, chunk=int(self.cfg.get("chunk", 256)))
        scores = group_reduce(received, spec.group, str(self.cfg.get("gqa", "sum"))).to(kv.home)
        s = kv.n
        if budget.total >= s:
            self.scores[layer] = scores
            return
        recent_start = s - budget.local
        middle = scores[:, budget.sink : recent_start]
        heavy = topk_sorted(middle, budget.select) + budget.sink
        fixed = torch.cat([torch.arange(budget.sink, device=kv.home), torch.arange(recent_start, s, device=kv.home)])
        keep = torch.sort(torch.cat([fixed.expand(kv.n_kv_heads, -1), heavy], dim=1), dim=1).values
        kv.keep(keep)
        self.scores[layer] = torch.gather(scores, 1, keep)

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        budget, spec = self.ctx.budget, self.ctx.spec
        step = group_reduce(probs.float(), spec.group, str(self.cfg.get("gqa", "sum"))).to(kv.home)
        scores = self.scores[layer]
        if scores.shape[1] < kv.n:  # the token appended at this step starts with its own attention
            scores = torch.cat([scores, torch.zeros(kv.n_kv_heads, kv.n - scores.shape[1], device=kv.home)], dim=1)
        scores = scores + step
        if kv.n > budget.total:
            positions = kv.positions
            protected = (positions < budget.sink) | (positions >= kv.seen - budget.local)
            victim = scores.masked_fill(protected, float("inf")).argmin(dim=1, keepdim=True)
            keep = torch.ones_like(scores, dtype=torch.bool).scatter_(1, victim, False)
            kv.remove(victim)
            scores = scores[keep].view(kv.n_kv_heads, -1)
        self.scores[layer] = scores
