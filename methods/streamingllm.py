"""``streamingllm``: attention sinks plus a sliding window of recent tokens (Xiao et al., 2023).

After prefill each layer keeps its first ``sink`` tokens and the most recent ``B`` tokens (the whole
budget is the window: ``local_fraction: 1.0``) and forgets the rest; during decode the window slides:
every step attends the ``sink`` sinks, the ``B`` tokens before the current one and the current one.
Sink default 4 (the paper's); set ``budget.sink=32`` to align with the PQCache-style methods. Tokens
keep their original positions (no re-positioning inside the window), as kvpress does for this
baseline; the paper's re-positioning matters only beyond the model's trained length.

The decode step is static (:mod:`kvbench.engine.decode`): the window slides by *selection*, not by
eviction. New tokens are written after the held ones (slots stay in position order), and each step
attends slots ``[0, sink)`` and the last ``B + 1`` slots, computed on the device from the layer's length
— a fixed-shape index, no host read, no compaction of the buffers. The tokens that slid out stay in the
store until the request ends (at most ``max_new_tokens`` of them beyond the prefill's ``sink + B``) but
are never attended: every step attends exactly the positions the earlier per-step eviction kept, in the
same order (``tests/test_decode_static.py`` checks it against that implementation, kept in
``tests/reference_selection.py``). ``kv_bytes_ratio`` counts what the prefill kept, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.budget import MethodBudgetDefaults
from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import MethodParams
from kvbench.params import param


@dataclass(frozen=True)
class StreamingLLMParams(MethodParams):
    sink: int = param(4, "the paper's 4 initial tokens; budget.sink=32 aligns with PQCache-style methods", min=0)
    local_fraction: float = param(1.0, "the whole budget is the sliding window", min=0, max=1)


@register
class StreamingLLM(EvictionMethod):
    name = "streamingllm"
    Params = StreamingLLMParams
    budget_defaults = MethodBudgetDefaults(compensable=True)
    static_decode = True  # the window slides by a device-side index (module docstring)

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

    def _covers(self, kv: LayerKV) -> bool:
        """Whether the layer holds no more than the sinks, the window and the current token (host count:
        ``kv.n`` already counts the step's token); then the step attends everything."""
        return kv.n <= self._limit() + 1

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """Slots ``[0, sink)`` and the last ``B + 1`` (the window and the current token), ascending."""
        if self._covers(kv):
            return None
        assert kv.length is not None, "streamingllm's step reads the decoder's counters"
        sink, window = self.ctx.budget.sink, self.ctx.budget.budget + 1
        recent = kv.length - window + kv.iota(window)
        slots = torch.cat([kv.iota(sink), recent]) if sink else recent
        return Selection(slots=slots.expand(kv.n_kv_heads, -1))

    def decode_key(self) -> tuple[Any, ...]:
        """The step's form changes once: when the window starts to slide (every layer holds as many tokens)."""
        return (self._covers(self.ctx.store.layers[0]),)
