"""``snapkv``: SnapKV (Li et al., 2024): the prompt's last tokens vote for the tokens worth keeping.

At prefill, after a layer's dense attention, the last ``window`` prompt queries (the observation
window, 32) take their causal softmax attention over the prompt; the attention they give each
earlier token is summed into a vote per query head, and votes are smoothed along the sequence by a
1-D pooling (``kernel`` 7, ``pooling: max``), so a selected token brings its neighbours. Every query
head keeps its own top-``select`` tokens, plus the last ``local`` prompt tokens and the sinks. Nothing
is evicted during decode: generated tokens are appended, so decode step ``t`` attends ``kept + t``
tokens (SnapKV compresses the prompt only).

GQA (``granularity``):

* ``query_head`` (default) — what the authors' code does (``repeat_kv`` before ``update_kv`` in
  ``snapkv/monkeypatch/*_hijack_4_37.py``) and KVCache-Factory's default ``kv_cache_granularity``: each
  query head selects from its own votes, so the query heads of one KV head keep different tokens. The
  store then holds K/V repeated per query head (``LayerKV.keep`` with one row per query head), and
  its bytes are what such a cache holds: ``group`` times a per-KV-head cache of the same budget. Each
  query head still attends ``sink + budget`` tokens, the same as every method at that budget.
* ``kv_head`` — one set per KV head: the votes of a KV head's query heads are reduced (``gqa``:
  ``sum`` | ``mean`` | ``max``) *before* pooling, as KVCache-Factory's ``kv_head`` mode does
  (``pyramidkv_utils._grouped_window_attn_cache``); the cache holds the model's KV heads only.

Budget (kvbench's shared accounting, ``kvbench/budget.py``): the kept window is the budget's
``local`` part (``local = min(window, B)``, ``select = B - local``; ``budget.local`` overrides the
kept window, the observation window stays ``window`` queries); "(C)" compensation applies.

Defaults are the authors' LongBench configs (``experiments/LongBench/config/ablation_c*_w32_k7_maxpool.json``:
window 32, kernel 7, max pooling; their code's defaults are kernel 5 and avg pooling: ``kernel=5
pooling=avg``). Under PQCache's protocol the same defaults apply: PQCache's released code has no SnapKV
or PyramidKV (``vq_pred.py`` only names ``snapkv`` in an output-path list) and its paper gives none of
their settings, so kvbench runs the SnapKV authors' choice there too. Choices where the paper is silent:

* ``sink`` 32: the same 32 attention sinks outside the budget as every PQCache-table method, so a
  comparison keeps the same number of tokens (SnapKV itself has no sinks, and its votes pick the first
  tokens anyway; ``budget.sink=0`` gives the original, then votes choose among all prefix tokens).
* Votes cover the prefix before the kept window, ``[0, s - local)``, and are pooled over that range
  with zero padding at its edges (the authors' code); sinks are then excluded from the ranking.
* Votes are in float32 whatever the model dtype.

Because the votes come from the prompt's end, what SnapKV keeps depends on what sits there: with the
question before the document (``task.question_position=start``) the window sees only the document's
end (PQCache Table 3).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvbench.budget import BudgetConfig, MethodBudgetDefaults, ResolvedBudget
from kvbench.engine.protocol import QueryStatistic
from kvbench.errors import ConfigError
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.attention_scores import group_reduce, pool1d, window_votes
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import GqaReduction, HeadSelection, SinkParams
from kvbench.methods.selection import topk_sorted
from kvbench.params import param


@dataclass(frozen=True)
class SnapKVParams(SinkParams):
    """No ``local_fraction``: the kept window is ``min(window, budget)`` (``budget.local`` overrides)."""

    sink: int = param(32, "the PQCache-table methods' 32 sinks (budget.sink=0: SnapKV's own)", min=0)
    window: int = param(32, "observation window = kept recent window (the authors' LongBench configs: 32)", min=1)
    kernel: int = param(7, "pooling kernel, odd (the authors' LongBench configs: 7; code default 5)", min=1)
    pooling: Literal["avg", "max"] = param(
        "max", "vote pooling (the authors' LongBench configs: max; code default avg)"
    )
    granularity: HeadSelection = param(
        "query_head",
        "query_head: every query head keeps its own tokens, K/V stored per query head (the authors' "
        "code) | kv_head: one set per KV head from votes reduced by method.gqa",
    )
    gqa: GqaReduction = param("sum", "granularity=kv_head: votes over a KV head's query heads: sum | mean | max")

    def validate(self) -> None:
        if self.kernel > 1 and self.kernel % 2 == 0:
            raise ConfigError(
                f"the pooling kernel must be odd, got method.kernel={self.kernel}",
                f"use method.kernel={self.kernel + 1} or {self.kernel - 1}",
            )


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
        self.per_query_head = p.granularity == "query_head"

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

    def prefill_statistics(self) -> tuple[QueryStatistic, ...]:
        return (self._votes(),)

    def _votes(self) -> QueryStatistic:
        """The observation window's raw votes ``[q_heads, s]`` (what the prefill's queries are read for)."""
        return QueryStatistic(window_votes, (self.window, self.ctx.spec.head_dim**-0.5))

    def scores(self, layer: int, query: torch.Tensor | None, key: torch.Tensor, local: int) -> torch.Tensor:
        """Pooled votes for the prefix before the kept window: ``[q_heads, s - local]`` per query head,
        or ``[kv_heads, s - local]`` reduced over the group (before pooling) at ``kv_head`` granularity."""
        spec = self.ctx.spec
        s = key.shape[-2]
        votes = self.query_statistic(self._votes(), layer, query, key)[:, : s - local]
        if not self.per_query_head:
            votes = group_reduce(votes, spec.group, self.gqa)
        return pool1d(votes, self.kernel, self.pooling)

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        budget = self.ctx.budget
        s = kv.n
        select = self.layer_select(layer)
        if budget.sink + budget.local + select >= s:
            return  # the budget covers the prompt: keep everything
        local = budget.local
        votes = self.scores(layer, query, key, local).to(kv.home)
        chosen = topk_sorted(votes[:, budget.sink :], select) + budget.sink
        fixed = torch.cat([torch.arange(budget.sink, device=kv.home), torch.arange(s - local, s, device=kv.home)])
        kv.keep(torch.cat([fixed.expand(chosen.shape[0], -1), chosen], dim=1))  # one row per query head: repeated K/V
