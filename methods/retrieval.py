"""What every retrieval method shares: an offloaded store, a block cache, dense layers, the layout.

Retrieval methods keep every token and pick, at each decode step, which middle tokens each head
attends. They differ only in how they rank; this base class wires the rest the same way for all of
them, so their bytes, hits, recall and attended counts are comparable in one table:

* ``offload`` (default true): middle tokens live in the host tier; sinks and the local window are
  device-resident; ``cache_tokens`` > 0 puts a block cache (``cache_block`` tokens per block, LRU/LFU,
  ``cache_blocks`` blocks admitted per step) between them — PQCache's 4096 tokens / 128 / 32.
* ``dense_layers``: layers that attend everything (Quest and ClusterKV leave layers 0-1 dense).

These parameters are :class:`~kvbench.methods.params.RetrievalParams`, which every retrieval
method's ``Params`` extends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvbench.engine.protocol import KVMethod
from kvbench.errors import CompressionNotApplied
from kvbench.kv.block_cache import BlockCache
from kvbench.kv.store import LayerKV
from kvbench.methods.params import RetrievalParams
from kvbench.methods.selection import Layout, StaticLayout, layout, static_layout

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


class RetrievalMethod(KVMethod):
    """Family rules: a budget; no multi-token extension of a held cache (selection is per decode
    step); the first decode step must attend fewer tokens than the layer holds on every compressing
    layer (:meth:`check_after_first_step`)."""

    family = "retrieval"
    needs_budget = True
    extends_with_many_tokens = False
    Params = RetrievalParams
    static_decode = False  # a method whose select() has the static form sets it (kvbench.engine.decode)
    params: RetrievalParams

    @property
    def offload(self) -> bool:
        return self.params.offload

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return self.params.dense_layers

    def start(self, ctx: GenerationContext) -> None:
        super().start(ctx)
        p = self.params
        block = p.cache_block
        for layer in ctx.store.layers:
            layer.set_residency(ctx.budget.sink, ctx.budget.local + 1)
            if p.cache_tokens > 0 and self.offload:
                layer.attach_cache(
                    BlockCache(
                        p.cache_tokens // block,
                        block_size=block,
                        policy=p.cache_policy,
                        update_blocks=p.cache_blocks if p.cache_blocks is not None else p.cache_tokens // block,
                        offset=self.cache_offset(ctx),
                    )
                )

    def cache_offset(self, ctx: GenerationContext) -> int:
        """Where cache blocks start (InfLLM's blocks start after its initial tokens)."""
        return 0

    def layout(self, kv: LayerKV) -> Layout:
        return layout(kv, self.ctx.budget.sink, self.ctx.budget.local)

    def static_layout(self, kv: LayerKV) -> StaticLayout:
        return static_layout(kv, self.ctx.budget.sink, self.ctx.budget.local)

    def compressing_kv(self) -> LayerKV:
        """A layer the method selects in (every one holds as many tokens: retrieval never evicts)."""
        dense = set(self.dense_layers)
        layers = self.ctx.store.layers
        return next((kv for i, kv in enumerate(layers) if i not in dense), layers[0])

    def covers(self, kv: LayerKV) -> bool:
        """Whether the budget attends every middle token of ``kv`` (the dense path: ``select`` returns None)."""
        return self.ctx.budget.select >= self.layout(kv).middle

    def recall_candidates(self, kv: LayerKV) -> torch.Tensor | None:
        """The middle slots (the legacy layout's candidates)."""
        return self.layout(kv).candidates(kv.home)

    def decode_key(self) -> tuple[Any, ...]:
        """A static step's selection changes form only when the budget starts to leave tokens out."""
        return (self.covers(self.compressing_kv()),)

    def check_after_first_step(self, ctx: GenerationContext) -> None:
        budget, tele = ctx.budget, ctx.telemetry
        if not budget.compresses:
            return
        lazy = [
            layer
            for layer in ctx.compressing_layers()
            if tele.attended[layer] and tele.attended[layer][0] >= tele.available[layer][0]
        ]
        if lazy:
            raise CompressionNotApplied(
                f"method {self.name} was asked to attend {budget.total} of {budget.context} prompt "
                f"tokens but layer(s) {lazy[:5]} attended all of them",
                "this is a bug in the method; report it with the run's config.yaml",
            )
