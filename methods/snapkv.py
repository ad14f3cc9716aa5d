"""``snapkv``: SnapKV (Li et al., 2024): the prompt's last tokens vote for the tokens worth keeping.

At prefill, after a layer's dense attention, the last ``window`` prompt queries (the observation
window, 32) take their causal softmax attention over the prompt; the attention they give each
earlier token is summed into a vote (per query head). Votes are smoothed along the sequence by a 1-D
pooling (``kernel`` 5, ``pooling: avg``), so a selected token brings its neighbours; the pooled votes
are reduced over the query heads of each KV head (``gqa``: ``sum`` | ``mean`` | ``max``), and every
KV head keeps its top-``select`` tokens, the last ``local`` prompt tokens and the sinks. Nothing is
evicted during decode: generated tokens are appended, so decode step ``t`` attends ``kept + t``
tokens (SnapKV compresses the prompt only).

Budget (kvbench's shared accounting, ``kvbench/budget.py``): the kept window is the budget's
``local`` part (``local = min(window, B)``, ``select = B - local``; ``budget.local`` overrides the
kept window, the observation window stays ``window`` queries); "(C)" compensation applies.

Defaults are SnapKV's authors' (window 32, kernel 5, avg pooling); KVCache-Factory runs SnapKV with
window 8, kernel 7, max pooling (``window=8 kernel=7 pooling=max``). Choices where the paper is silent:

* ``sink`` 32: the same 32 attention sinks outside the budget as every PQCache-table method, so a
  comparison keeps the same number of tokens (SnapKV itself has no sinks, and its votes pick the first
  tokens anyway; ``budget.sink=0`` gives the original, then votes choose among all prefix tokens).
* Votes cover the prefix before the kept window, ``[0, s - local)``, and are pooled over that range
  with zero padding at its edges (the authors' code); sinks are then excluded from the ranking.
* Pooling is per query head, before the GQA reduction (as kvpress); the two orders agree for
  ``avg`` with ``sum``/``mean``. ``sum`` and ``mean`` always pick the same tokens.
* Votes are in float32 whatever the model dtype.

Because the votes come from the prompt's end, what SnapKV keeps depends on what sits there: with the
question before the document (``task.question_position=start``) the window sees only the document's
end (PQCache Table 3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvbench.budget import BudgetConfig, MethodBudgetDefaults, ResolvedBudget
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.attention_scores import group_reduce, pool1d, window_votes
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import SnapKVParams
from kvbench.methods.selection import topk_sorted


@register
class SnapKV(EvictionMethod):
    name = "snapkv"
    Params = SnapKVParams
    params: SnapKVParams
    #: no ``local_fraction``: the kept window is the budget's local part (see ``resolve_budget``)
    budget_defaults = MethodBudgetDefaults(local_fraction=0.0, compensable=True)

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        p = self.params
        self.window, self.kernel, self.pooling, self.gqa = p.window, p.kernel, p.pooling, p.gqa

    def resolve_budget(self, budget: BudgetConfig, context: int, capacity: int, n_layers: int) -> ResolvedBudget:
        """The shared budget with the kept window as its local part (``budget.local`` overrides it)."""
        resolved = super().resolve_budget(budget, context, capacity, n_layers)
        if budget.local is not None:
            return resolved
        local = min(self.window, resolved.budget)
        return dataclasses.replace(resolved, local=local, select=resolved.budget - local)

    def layer_select(self, layer: int) -> int:
        """Prefix tokens ``layer`` keeps besides sinks and the window (PyramidKV varies it by layer)."""
        budget = self.ctx.budget
        return budget.layer_budget(layer) - budget.local

    def scores(self, query: torch.Tensor, key: torch.Tensor, local: int) -> torch.Tensor:
        """Pooled, group-reduced votes ``[kv_heads, s - local]`` for the prefix before the kept window."""
        spec = self.ctx.spec
        s = key.shape[-2]
        votes = window_votes(query[0], key[0], self.window, spec.head_dim**-0.5)[:, : s - local]
        votes = pool1d(votes, self.kernel, self.pooling)
        return group_reduce(votes, spec.group, self.gqa)

    def on_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV) -> None:
        budget = self.ctx.budget
        s = kv.n
        select = self.layer_select(layer)
        if budget.sink + budget.local + select >= s:
            return  # the budget covers the prompt: keep everything
        local = budget.local
        votes = self.scores(query, key, local).to(kv.home)
        chosen = topk_sorted(votes[:, budget.sink :], select) + budget.sink
        fixed = torch.cat([torch.arange(budget.sink, device=kv.home), torch.arange(s - local, s, device=kv.home)])
        kv.keep(torch.cat([fixed.expand(kv.n_kv_heads, -1), chosen], dim=1))
