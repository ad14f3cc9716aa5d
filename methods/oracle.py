"""``oracle``: the exact top-k at every decode step (ideal selective attention).

At each decode step every KV head attends its sink tokens, its local window, the current token and
the ``select`` middle tokens with the highest *exact* attention: per query head softmax of
``q·k/sqrt(d)`` over all held tokens, summed over the GQA group (the PQCache authors' Oracle,
seed-pqcache.md §2.7/§3.4). ``gqa`` switches the group rule (``softmax_sum`` | ``logit_sum`` | ``max``);
``per_query_head: true`` lets every query head pick its own tokens instead.

The Oracle reads every key to score it, so its cache stays on the device (``offload: false``): it
is a quality ceiling for the retrieval methods, not a system design.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import GqaRule, RetrievalParams
from kvbench.methods.primitives.pq import group_scores
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import group_logits, topk_keyed
from kvbench.params import param


@dataclass(frozen=True)
class OracleParams(RetrievalParams):
    gqa: GqaRule = param("softmax_sum", "group rule on exact scores: softmax_sum (PQCache's) | logit_sum | max")
    per_query_head: bool = param(False, "every query head picks its own tokens")
    offload: bool = param(False, "the Oracle reads every key, so its cache stays on the device")


@register
class Oracle(RetrievalMethod):
    name = "oracle"
    Params = OracleParams
    params: OracleParams

    static_decode = True

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """The exact top-``select`` middle tokens (static step: scores over the layer's bucket, the slots
        outside the middle masked; ties to the lower slot, as :func:`~kvbench.methods.selection.exact_topk`)."""
        if self.covers(kv):
            return None
        spec, select = self.ctx.spec, self.ctx.budget.select
        lay = self.static_layout(kv)
        keys, _ = kv.bucket()
        logits = group_logits(query, keys, spec.group)  # [kv_heads, group, end]
        rule, scale = self.params.gqa, spec.head_dim**-0.5
        if self.params.per_query_head:
            scores = logits[..., lay.sink :].reshape(spec.n_heads, lay.width)
        elif rule == "softmax_sum":  # softmax over the held tokens, as the authors' Oracle
            held = torch.softmax((logits * scale).masked_fill(lay.unheld(), float("-inf")), dim=-1)
            scores = held[..., lay.sink :].sum(dim=1)
        else:
            scores = group_scores(logits[..., lay.sink :], rule, scale)
        middle_end = lay.middle_end()
        scores = scores.masked_fill(lay.outside(middle_end), float("-inf"))
        nonnegative = rule == "softmax_sum" and not self.params.per_query_head  # (softmax sums, or -inf)
        chosen = topk_keyed(scores, select, nonnegative=nonnegative, offset=lay.sink)
        return lay.compose(chosen, middle_end)
