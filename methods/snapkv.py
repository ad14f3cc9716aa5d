"""``snapkv``: SnapKV (Li et al., 2024): the prompt's last tokens vote for the tokens worth keeping.

At prefill, the last ``window`` (32) prompt tokens form the observation window. Their attention over
the earlier tokens is summed (per query head), smoothed along the sequence with a pooling kernel
(``kernel`` 5, ``pooling`` avg — SnapKV's defaults; KVCache-Factory uses 8 / 7 / max), reduced over
the GQA group (``gqa``: sum | mean | max), and each KV head keeps its top-``select`` tokens plus the
window. Nothing is evicted during decode. The window is the budget's local part; SnapKV has no sink
tokens (``sink`` 0; ``budget.sink`` adds them). Because the votes come from the prompt's end, the
selection depends on where the question sits (PQCache Table 3: ``task.question_position=start``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvbench.budget import BudgetConfig, MethodBudgetDefaults, ResolvedBudget
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.attention_scores import group_reduce, pool1d, window_votes
from kvbench.methods.base import KVMethod
from kvbench.methods.selection import topk_sorted


@register
class SnapKV(KVMethod):
    name = "snapkv"
    family = "eviction"
    budget_defaults = MethodBudgetDefaults(sink=0, local_fraction=0.0, compensable=True)

    @property
    def window(self) -> int:
        return int(self.cfg.get("window", 32))

    def resolve_budget(self, budget: BudgetConfig, context: int, capacity: int, n_layers: int) -> ResolvedBudget:
        """The observation window is the local part of the budget (``budget.local`` overrides it)."""
        resolved = super().resolve_budget(budget, context, capacity, n_layers)
        local = resolved.local if budget.local is not None else min(self.window, resolved.budget)
        return dataclasses.replace(resolved, local=local, select=resolved.budget - local)

    def layer_select(self, layer: int) -> int:
        """Prefix tokens a layer keeps besides sinks and window (PyramidKV varies it by layer)."""
        return self.ctx.budget.select

    def on_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV) -> None:
        budget, spec = self.ctx.budget, self.ctx.spec
        s = kv.n
        select = self.layer_select(layer)
        if budget.sink + budget.local + select >= s:
            return
        votes = window_votes(query[0], key[0], budget.local, spec.head_dim**-0.5)  # [H, s - window]
        votes = pool1d(votes, int(self.cfg.get("kernel", 5)), str(self.cfg.get("pooling", "avg")))
        votes = group_reduce(votes, spec.group, str(self.cfg.get("gqa", "sum"))).to(kv.home)
        chosen = topk_sorted(votes[:, budget.sink :], select) + budget.sink
        fixed = torch.cat([torch.arange(budget.sink, device=kv.home), torch.arange(s - budget.local, s, device=kv.home)])
        kv.keep(torch.cat([fixed.expand(kv.n_kv_heads, -1), chosen], dim=1))

    def telemetry(self) -> dict[str, Any]:
        return {"window": self.window, "kernel": int(self.cfg.get("kernel", 5)), "pooling": self.cfg.get("pooling", "avg")}
