"""``knorm``: keep the prompt tokens whose keys have the smallest L2 norm (a cheap eviction baseline).

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024,
arXiv 2406.11430) observe that a key's norm anticorrelates with the attention it later receives, so the
tokens with the lowest key norms are the ones to keep. kvpress ships it as ``KnormPress``: after the
prefill, per layer and KV head, score every token by ``-||k||`` and keep the top of the scores; no
sinks, no window, nothing evicted during decode. Those are the defaults here (``method.sink=0``,
``method.local_fraction=0``); ``budget.sink`` / ``budget.local`` add sinks and a window, and the norm
then chooses the ``select`` part of the budget among the middle tokens. RoPE rotates each pair of a
key's coordinates, which keeps its norm, so the post-RoPE keys kvbench stores give the paper's scores.
Ties (equal norms) keep the earlier token.
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
class KnormParams(MethodParams):
    """kvpress's ``KnormPress`` defaults: the whole budget is chosen by key norm."""

    sink: int = param(0, "no sinks by default (KnormPress); budget.sink adds them", min=0)
    local_fraction: float = param(0.0, "no recent window by default: the whole budget is chosen by norm", min=0, max=1)


@register
class Knorm(EvictionMethod):
    name = "knorm"
    Params = KnormParams
    params: KnormParams

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        def smallest_norms(begin: int, end: int, select: int) -> torch.Tensor:
            norms = key[0, :, begin:end].float().norm(dim=-1)  # [kv_heads, middle]
            # the smallest norms, the earlier token first among equal ones (a stable sort, not topk's order)
            return torch.sort(norms, dim=1, stable=True).indices[:, :select] + begin

        self.keep_chosen_middle(layer, kv, smallest_norms)
