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

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import OracleParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import compose, exact_topk


@register
class Oracle(RetrievalMethod):
    name = "oracle"
    Params = OracleParams
    params: OracleParams

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        budget = self.ctx.budget
        spec = self.ctx.spec
        lay = self.layout(kv)
        per_query_head = self.params.per_query_head
        if budget.select >= lay.middle:
            rows = spec.n_heads if per_query_head else spec.n_kv_heads
            return compose(lay, lay.candidates(kv.home).expand(rows, -1), ascending=True)
        chosen = exact_topk(
            query,
            kv.keys,
            slice(lay.sink_end, lay.middle_end),  # the middle: a view of the logits, not a gather
            budget.select,
            group=spec.group,
            per_query_head=per_query_head,
            rule=self.params.gqa,
            scale=spec.head_dim**-0.5,
        )
        return compose(lay, chosen, ascending=True)  # exact_topk's rows are ascending
