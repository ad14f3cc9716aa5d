"""``random_eviction``: keep a uniformly random subset of the prompt within the budget (a control baseline).

After the dense prefill each layer keeps its sinks, its local window and, per KV head, ``B - local``
middle tokens drawn uniformly at random (the ``select`` part of the budget); nothing is evicted during
decode. It keeps tokens with no signal at all: what every eviction policy must beat at the same budget,
as kvpress's ``RandomPress`` is for its presses. Defaults follow ``RandomPress`` (no sinks, no window:
the whole budget is drawn at random; ``method.sink`` / ``method.local_fraction`` or ``budget.sink`` /
``budget.local`` add them). The draw is seeded by ``method.seed`` and the layer index on the host, so a
run is repeatable on any device and every layer draws its own set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.params import MethodParams
from kvbench.params import param


@dataclass(frozen=True)
class RandomParams(MethodParams):
    """The random-eviction control's parameters (kvpress's ``RandomPress`` defaults)."""

    sink: int = param(0, "no sinks by default (RandomPress); budget.sink adds them", min=0)
    local_fraction: float = param(0.0, "no recent window by default: the whole budget is drawn", min=0, max=1)
    seed: int = param(0, "seed of the draw (with the layer index)", min=0)


@register
class RandomEviction(EvictionMethod):
    name = "random_eviction"
    Params = RandomParams
    params: RandomParams

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        def draw(begin: int, end: int, select: int) -> torch.Tensor:
            generator = torch.Generator().manual_seed(self.params.seed * 1_000_003 + layer)
            scores = torch.rand(kv.n_kv_heads, end - begin, generator=generator)
            return torch.topk(scores, select, dim=1).indices + begin

        self.keep_chosen_middle(layer, kv, draw)
