"""Today's (pre-static) decode selections, kept as independent references for the static step.

Each class is the method as it selected before the static decode step (:mod:`kvbench.engine.decode`):
host-side layouts, ``kv.n`` read at every step, variable shapes. They run on the dynamic per-layer step
(``static_decode = False``); ``tests/test_decode_static.py`` checks that the static methods attend exactly
the same positions at every step and layer (the selection digest) and generate the same tokens.
"""

from __future__ import annotations

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.oracle import Oracle
from kvbench.methods.selection import compose, exact_topk
from kvbench.methods.streamingllm import StreamingLLM


class LegacyOracle(Oracle):
    name = "_legacy_oracle"
    static_decode = False

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
            slice(lay.sink_end, lay.middle_end),
            budget.select,
            group=spec.group,
            per_query_head=per_query_head,
            rule=self.params.gqa,
            scale=spec.head_dim**-0.5,
        )
        return compose(lay, chosen, ascending=True)


class LegacyStreamingLLM(StreamingLLM):
    """StreamingLLM sliding its window by eviction, as before the static step: each decode step drops the
    layer's oldest non-sink token once the layer holds more than the sinks, the window and the current
    token (a host-side compaction of the buffers). The earlier code evicted right *after* attending, this
    reference right *before*: the same tokens are attended at every step, and the selection digest, which
    folds what a dense step holds, then records what the step attended."""

    name = "_legacy_streamingllm"
    static_decode = False

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        if kv.n > self._limit() + 1:
            oldest = self.ctx.budget.sink  # slots stay in position order: slot `sink` is the oldest non-sink
            kv.remove(torch.full((kv.n_kv_heads, 1), oldest, dtype=torch.long, device=kv.home))
        return None

    def decode_key(self) -> tuple:
        return ()


LEGACY = {"oracle": LegacyOracle, "streamingllm": LegacyStreamingLLM}
