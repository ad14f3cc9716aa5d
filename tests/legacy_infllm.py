"""InfLLM's decode-time code as it was before the static decode step, kept as an independent reference.

:class:`LegacyInfLLM` is the pre-conversion decode code of :class:`~kvbench.methods.infllm.InfLLM`,
verbatim: per-layer dicts of representative keys (extended by ``torch.cat`` when ``select`` finds new
full blocks) and of the local attention received (grown by doubling in ``after_attention``), a
host-side layout read from ``kv.n`` at every step, ``topk_sorted`` over the block scores. It runs on
the dynamic per-layer step (``static_decode = False``); ``tests/test_static_infllm.py`` checks that the
static method attends exactly the same positions, generates the same tokens and counts the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.infllm import InfLLM
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import topk_sorted


class LegacyInfLLM(InfLLM):
    name = "_legacy_infllm"
    static_decode = False
    # the hooks the static step added, back to what the method had (the family's rules, no host-side step)
    covers = RetrievalMethod.covers
    decode_key = RetrievalMethod.decode_key
    recall_candidates = RetrievalMethod.recall_candidates

    def before_step(self, ctx: Any) -> None:
        """Nothing: blocks are built in ``select``."""

    def _expand(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.repeat_interleave(self.ctx.spec.group, dim=0)

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self._block_keys: dict[int, torch.Tensor] = {}  # layer -> [H, blocks, d]
        self._received: dict[int, torch.Tensor] = {}  # layer -> [H, >= n] local attention received

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        if layer in self.dense_layers:
            return
        spec = self.ctx.spec
        self._received[layer] = self.query_statistic(self._local_received(), layer, query, key)
        # the blocks' representative keys live on the compute device (InfLLM keeps them in GPU memory)
        self._block_keys[layer] = torch.empty(spec.n_heads, 0, spec.head_dim, device=kv.device)

    def _extend_blocks(self, layer: int, kv: LayerKV, full_blocks: int) -> torch.Tensor:
        """Representative keys of the first ``full_blocks`` blocks, built as blocks complete."""
        reps = self._block_keys[layer]
        done = reps.shape[1]
        if full_blocks > done:
            sink = self.ctx.budget.sink
            start, end = sink + done * self.block, sink + full_blocks * self.block
            keys = self._expand(kv.keys[:, start:end].to(reps.device).float())  # [H, new*block, d]
            h, _, d = keys.shape
            keys = keys.view(h, full_blocks - done, self.block, d)
            score = self._received[layer][:, start:end].view(h, full_blocks - done, self.block).to(keys.device)
            top = torch.topk(score, self.reps, dim=-1).indices  # [H, new, reps]
            chosen = torch.gather(keys, 2, top[..., None].expand(-1, -1, -1, d)).mean(dim=2)
            reps = torch.cat([reps, chosen.to(reps.device)], dim=1)
            self._block_keys[layer] = reps
            if kv.offload:
                kv.count_index_bytes((full_blocks - done) * self.reps * kv.n_kv_heads * kv.head_dim * kv.element_bytes)
        return reps

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        budget, spec = self.ctx.budget, self.ctx.spec
        lay = self.layout(kv)
        full_blocks = max(0, lay.middle) // self.block
        blocks_end = lay.sink_end + full_blocks * self.block
        fixed = torch.cat(
            [torch.arange(0, lay.sink_end, device=kv.home), torch.arange(blocks_end, kv.n, device=kv.home)]
        )
        take = min(math.ceil(budget.select / self.block), full_blocks)
        if take == 0:
            return Selection(slots=fixed.expand(spec.n_kv_heads, -1))
        reps = self._extend_blocks(layer, kv, full_blocks)
        q = query[0, :, 0, :].to(reps.device).float()  # [H, d]
        scores = torch.einsum("hd,hbd->b", q, reps) / spec.n_heads
        chosen = topk_sorted(scores[None], take)[0].to(kv.home)  # block indices, for the store
        offsets = chosen[:, None] * self.block + torch.arange(self.block, device=kv.home)
        selected = (lay.sink_end + offsets).reshape(1, -1)
        selected = selected.expand(spec.n_kv_heads, -1)
        slots, _ = torch.sort(torch.cat([fixed.expand(spec.n_kv_heads, -1), selected], dim=1), dim=1)
        candidates = torch.arange(lay.sink_end, blocks_end, device=kv.home)
        return Selection(slots=slots, selected=selected, candidates=candidates)

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        """Accumulate the attention that tokens inside the local window receive (for future blocks)."""
        if layer not in self._received or probs is None:
            return
        received = self._received[layer]
        if received.shape[1] < kv.n:  # room for this token and the next ones (amortised doubling, not a
            # copy of the whole row at every step); the spare columns are zeros, which no block reads
            extra = max(kv.n, 2 * received.shape[1]) - received.shape[1]
            grow = torch.zeros(received.shape[0], extra, device=received.device)
            received = self._received[layer] = torch.cat([received, grow], dim=1)
        slots = (
            selection.slots if selection is not None else torch.arange(kv.n, device=kv.home).expand(kv.n_kv_heads, -1)
        )
        slots = slots.repeat_interleave(probs.shape[0] // slots.shape[0], dim=0).to(received.device)
        window_start = kv.n - 1 - self.ctx.budget.local
        in_window = slots >= window_start
        received.scatter_add_(1, slots, probs.to(received.device).float() * in_window)

    def snapshot(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The blocks' representative keys (extended as blocks fill, never modified in place) and the
        local attention every token received (decode steps add to it in place: copied)."""
        return dict(self._block_keys), {layer: r.clone() for layer, r in self._received.items()}

    def restore(self, state: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]) -> None:
        blocks, received = state
        self._block_keys = dict(blocks)
        self._received = {layer: r.clone() for layer, r in received.items()}
