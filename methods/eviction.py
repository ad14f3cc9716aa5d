"""What every eviction method shares: a budget, and a prefill guard.

Eviction methods (StreamingLLM, H2O, SnapKV, PyramidKV) decide after the dense prefill of each layer
which tokens to keep, and the store forgets the rest. The family's rules: it needs a token budget, it
cannot extend a held cache by several tokens at once with its policy active (decode steps only), and
a layer that was asked to shrink but kept every token fails the run (:meth:`check_after_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from kvbench.engine.protocol import KVMethod
from kvbench.errors import CompressionNotApplied
from kvbench.methods.params import MethodParams
from kvbench.params import Params

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext
    from kvbench.kv.store import LayerKV


class EvictionMethod(KVMethod):
    family = "eviction"
    needs_budget = True
    extends_with_many_tokens = False
    Params: ClassVar[type[Params]] = MethodParams  # sink and local_fraction (every shipped method names its own)

    def check_after_prefill(self, ctx: GenerationContext) -> None:
        budget = ctx.budget
        if not budget.compresses:
            return
        lazy = [
            layer
            for layer in ctx.compressing_layers()
            if ctx.store[layer].n >= ctx.store[layer].seen > budget.sink + budget.layer_budget(layer)
        ]
        if lazy:
            raise CompressionNotApplied(
                f"method {self.name} was asked to keep {budget.total} of {budget.context} tokens "
                f"but layer(s) {lazy[:5]} kept all of them",
                "this is a bug in the method; report it with the run's config.yaml",
            )

    def keep_chosen_middle(self, layer: int, kv: LayerKV, choose: Callable[[int, int, int], torch.Tensor]) -> None:
        """Keep the sinks, the local window and, per KV head, the ``select`` middle tokens that
        ``choose(begin, end, select)`` names (``[kv_heads, select]`` positions in ``[begin, end)``): the
        prefill step of a method that scores each middle token once (random, key norm). Nothing happens
        when the budget covers the prompt."""
        budget = self.ctx.budget
        s, select = kv.n, budget.layer_budget(layer) - budget.local
        if budget.sink + budget.local + select >= s:
            return  # the budget covers the prompt: keep everything
        chosen = choose(budget.sink, s - budget.local, select).to(kv.home)
        fixed = torch.cat(
            [torch.arange(budget.sink, device=kv.home), torch.arange(s - budget.local, s, device=kv.home)]
        )
        kv.keep(torch.cat([fixed.expand(kv.n_kv_heads, -1), chosen], dim=1))  # (keep sorts each row)
