"""Prefill as a per-layer plan the engine drives.

The engine runs a prompt's prefill itself, one decoder layer at a time
(:meth:`kvbench.engine.context.GenerationContext.run_prefill`), and asks a :class:`PrefillPlan` what
to do around each layer:

1. :meth:`PrefillPlan.before_layer` — before layer ``i`` runs: a reuse method installs the cached K/V
   of the rows it will not recompute into the store (chunk caches re-rotated to their new positions,
   an exact prefix), loading them from its chunk store;
2. the layer runs on the *active* rows only (their hidden states, their real positions' rotary
   embedding); its attention calls :meth:`PrefillPlan.attend` with the fresh post-RoPE Q/K/V of those
   rows: write them into the store, attend over everything the layer holds, let the method evict,
   index or measure deviations;
3. :meth:`PrefillPlan.after_layer` — which active rows stay active for the next layer (``None``: all);
   CacheBlend shrinks the set after its check layer, the source of its TTFT saving.

Then the engine takes the final norm and head of the last active row (always the prompt's last
token). :class:`DensePrefill` is the plan of every method that starts from a full prefill (``full``,
eviction, retrieval): every row active at every layer, K/V appended in order, transformers' own SDPA
kernel, then the method's ``on_prefill`` hook — token-identical to ``model.generate``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvbench.engine import attention

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


class PrefillPlan:
    """One prompt's prefill: which rows run, what each layer's attention does, which rows stay.

    ``input_ids`` ``[n]`` and ``positions`` ``[n]`` describe the rows that enter layer 0 (for a reuse
    method that takes most of the prompt from caches, only the rows it computes); the engine keeps the
    current active positions in :attr:`active` (``[t]``, on the host).
    """

    def __init__(self, ctx: GenerationContext, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.ctx = ctx
        self.input_ids = input_ids
        self.positions = positions
        self.active = positions

    def before_layer(self, layer: int) -> None:
        """Prepare the store of ``layer`` before it runs (nothing for a dense prefill)."""

    def attend(
        self,
        layer: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """Attention of the active rows (``query`` ``[1, H, t, d]``, ``key``/``value`` ``[1, kv, t, d]``,
        post-RoPE) at layer ``layer``; returns ``[1, t, H, d]``."""
        raise NotImplementedError

    #: whether a layer's attention may decide the rows that continue before the layer's output
    #: projection and MLP run (:meth:`rows_after_attention`; CacheBlend's check layer)
    cuts_in_layer = False

    def rows_after_attention(self) -> torch.Tensor | None:
        """Asked by the layer once its attention has run (when :attr:`cuts_in_layer`): indices into the
        active rows that go on through the output projection and the MLP — the same ones
        :meth:`after_layer` then returns — or None for all."""
        return None

    def after_layer(self, layer: int) -> torch.Tensor | None:
        """Indices into the active rows that stay active for the next layer; ``None`` keeps all."""
        return None

    def telemetry(self) -> dict[str, Any]:
        """Plan-specific per-sample figures (reuse: tokens recomputed per layer, loads)."""
        return {}


class DensePrefill(PrefillPlan):
    """Every row at every layer, appended in order: the stock prefill, then the method's ``on_prefill``."""

    def attend(
        self,
        layer: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        kv = self.ctx.store[layer]
        if kv.n:
            raise RuntimeError(f"a dense prefill found layer {layer} already holding {kv.n} tokens")
        kv.append(key[0], value[0], self.active)
        out = attention.dense(module, query, key, value, scaling)
        self.ctx.method.on_prefill(layer, query, key, value, kv)
        return out
