"""``streamingllm``: attention sinks plus a sliding window of recent tokens (Xiao et al., 2023).

After prefill each layer keeps its first ``sink`` tokens and the most recent ``B`` tokens (the whole
budget is the window: ``local_fraction: 1.0``) and forgets the rest; during decode the window slides:
after each step the oldest non-sink token is evicted, so every step attends ``sink + B`` tokens plus
the current one. Sink default 4 (the paper's); set ``budget.sink=32`` to align with the PQCache-style
methods. Tokens keep their original positions (no re-positioning inside the window), as kvpress does
for this baseline; the paper's re-positioning matters only beyond the model's trained length.
"""

from __future__ import annotations

import torch

from kvbench.budget import MethodBudgetDefaults
from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import StreamingLLMParams


@register
class StreamingLLM(EvictionMethod):
    name = "streamingllm"
    Params = StreamingLLMParams
    budget_defaults = MethodBudgetDefaults(compensable=True)
    static_decode = False  # evicts the oldest window token at every decode step (host-side slots)

    def _limit(self) -> int:
        return self.ctx.budget.sink + self.ctx.budget.budget

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        budget = self.ctx.budget
        if kv.n <= self._limit():
            return
        keep = torch.cat(
            [torch.arange(budget.sink, device=kv.home), torch.arange(kv.n - budget.budget, kv.n, device=kv.home)]
        )
        kv.keep(keep.expand(kv.n_kv_heads, -1))

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        if kv.n > self._limit():
            oldest = self.ctx.budget.sink  # slots stay in position order: slot `sink` is the oldest non-sink
            kv.remove(torch.full((kv.n_kv_heads, 1), oldest, dtype=torch.long, device=kv.home))
