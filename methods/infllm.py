"""``infllm``: InfLLM's block memory (Xiao et al., 2024) as PQCache configures it (seed-pqcache.md §3.4).

Past tokens beyond the ``sink`` initial tokens and the local window are grouped into blocks of
``block_size`` (128) positions, starting after the sinks. Each block is represented by ``reps`` of its
tokens: per query head, the tokens that received the most attention from their local context (the
queries within ``budget.local`` positions after them); the block's key for that head is the mean of
those tokens' keys. At a decode step the block score is the query's dot product with the block keys,
averaged over all query heads — one ranking shared by every head, as InfLLM does — and the top
``ceil(select / block_size)`` blocks are attended whole (PQCache's ``topk`` formula), together with
the sinks, the tokens past the last full block ("remainder"), the local window and the current token.
Selected blocks go through a device cache of ``cache_tokens / block_size`` blocks (32, LRU).

``reps`` defaults to ``round(budget.comm_ratio · block_size)``, at least 1 (1 for 1/128, 2 for 1/64);
the representatives' keys are counted once per block as index traffic (``reps / block_size`` of the
keys' bytes, PQCache's accounting).

Deviations (documented choices): the prefill is dense (InfLLM prefills in 512-token chunks with
the same block retrieval, which changes the prefill itself); keys keep their true RoPE positions
(InfLLM gives all memory tokens one position); local attention scores are a softmax over each query's
local window only. Blocks formed during decode pick representatives from the attention the tokens got
at decode steps while in the local window.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import QueryStatistic, Selection
from kvbench.methods.params import InfLLMParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import topk_sorted


def local_attention_received(
    query: torch.Tensor, keys: torch.Tensor, window: int, scale: float, chunk: int = 256
) -> torch.Tensor:
    """Attention each key receives from the queries within ``window`` positions after it.

    ``query`` ``[H, s, d]``, ``keys`` ``[H, s, d]`` (already expanded to query heads). Every query ``j``
    takes a softmax over keys ``[j - window, j]``; returns the per-key sums ``[H, s]``. Chunked over
    queries, so memory is ``O(H · chunk · (chunk + window))``.
    """
    h, s, _ = query.shape
    received = torch.zeros(h, s, dtype=torch.float32, device=query.device)
    for start in range(0, s, chunk):
        end = min(start + chunk, s)
        lo = max(0, start - window)
        logits = torch.einsum("hqd,hkd->hqk", query[:, start:end].float(), keys[:, lo:end].float()) * scale
        qpos = torch.arange(start, end, device=query.device)[:, None]
        kpos = torch.arange(lo, end, device=query.device)[None, :]
        band = (kpos <= qpos) & (kpos >= qpos - window)
        probs = torch.softmax(logits.masked_fill(~band, float("-inf")), dim=-1)
        received[:, lo:end] += probs.sum(dim=1)
    return received


def received_from_kv_heads(query: torch.Tensor, keys: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """:func:`local_attention_received` with ``keys`` ``[H_kv, s, d]`` per KV head (repeated to the query
    heads of each GQA group first)."""
    return local_attention_received(
        query, keys.repeat_interleave(query.shape[0] // keys.shape[0], dim=0), window, scale
    )


@register
class InfLLM(RetrievalMethod):
    name = "infllm"
    Params = InfLLMParams
    params: InfLLMParams
    needs_attention_probs = True

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.block = self.params.block_size
        reps = self.params.reps
        self.reps = max(1, min(self.block, reps if reps is not None else round(ctx.budget.comm_ratio * self.block)))
        self._block_keys: dict[int, torch.Tensor] = {}  # layer -> [H, blocks, d]
        self._received: dict[int, torch.Tensor] = {}  # layer -> [H, >= n] local attention received

    def cache_offset(self, ctx: Any) -> int:
        return ctx.budget.sink

    def _expand(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.repeat_interleave(self.ctx.spec.group, dim=0)

    def prefill_statistics(self) -> tuple[QueryStatistic, ...]:
        return (self._local_received(),)

    def _local_received(self) -> QueryStatistic:
        """The attention each prompt token received from the queries of its local window ``[q_heads, s]``."""
        return QueryStatistic(received_from_kv_heads, (max(1, self.ctx.budget.local), self.ctx.spec.head_dim**-0.5))

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

    def telemetry(self) -> dict[str, Any]:
        if not self.started:
            return {}
        return {"reps": self.reps, "block_size": self.block, "comm_ratio_used": self.reps / self.block}
