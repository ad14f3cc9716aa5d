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

Static decode step (:mod:`kvbench.engine.decode`). A block completes at a host-known step, so its
representative keys are built in :meth:`InfLLM.before_step` (eager, with the same batches of blocks
and the same ops as before) into a preallocated ``[H, max_blocks, d]`` buffer per layer; the number of
full blocks is part of :meth:`InfLLM.decode_key`, so within a regime the block ranking has one shape.
The selection is sinks, the ``take`` chosen blocks and a fixed-width tail of ``local + block_size``
slots from the end of the last full block: the remainder and the local window with the current
token, which grow by one each step until the next block completes. Tail entries past the current
token are padding (``Selection.valid`` false; they point at the current token, so slots stay
ascending and the host tier counts nothing for them). The local attention received lives in a
buffer sized to the layer's capacity, updated in place by a ``scatter_add_`` of the tail's
probabilities (only the tail can lie in the local window; padded entries carry zero probability).
A budget that takes every full block (or there is none) attends everything: the dense step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from kvbench.engine.protocol import QueryStatistic, Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import RetrievalParams
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import topk_keyed
from kvbench.params import param

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


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


@dataclass(frozen=True)
class _Regime:
    """Host-made constants of one regime (a number of full blocks), on the compute device."""

    blocks: int  # full blocks
    device: torch.device  # the layers' compute device
    take: int  # blocks selected
    tail: torch.Tensor  # [1, local + block]: slots from the end of the last full block
    window: torch.Tensor  # [local + block]: tail + local (a tail slot is in the local window when >= current)
    block_slots: torch.Tensor  # [blocks, block]: the slots of every full block
    prefix: torch.Tensor  # [1, sink]: the sinks
    reversed_iota: torch.Tensor  # [blocks]: blocks - 1, ..., 0 (topk_keyed's keys)


@dataclass(frozen=True)
class InfLLMParams(RetrievalParams):
    sink: int = param(32, "n_init: initial tokens always attended, outside the budget", min=0)
    block_size: int = param(128, "tokens per memory block", min=1)
    reps: int | None = param(
        None, "representatives per block; null: round(budget.comm_ratio * block_size), >= 1", min=1
    )
    cache_tokens: int = param(4096, "device block cache in tokens: 32 blocks (PQCache's setting)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (null: the whole cache)", min=0)
    cache_policy: Literal["lfu", "lru"] = param("lru", "block-cache replacement rule (InfLLM: LRU)")


@register
class InfLLM(RetrievalMethod):
    name = "infllm"
    Params = InfLLMParams
    params: InfLLMParams
    needs_attention_probs = True
    static_decode = True

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.block = self.params.block_size
        reps = self.params.reps
        self.reps = max(1, min(self.block, reps if reps is not None else round(ctx.budget.comm_ratio * self.block)))
        self._block_keys: dict[int, torch.Tensor] = {}  # layer -> [H, max_blocks, d], the first _built filled
        self._built: dict[int, int] = {}  # layer -> blocks whose representative keys exist
        self._received: dict[int, torch.Tensor] = {}  # layer -> [H, >= capacity] local attention received
        self._regime: _Regime | None = None  # the constants of the last selective regime (made once)
        self._decided: tuple[int, int, _Regime | None] = (-1, 0, None)  # (n, full blocks, regime; None: covering)

    def cache_offset(self, ctx: Any) -> int:
        return ctx.budget.sink

    def _expand(self, keys: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, ...]`` → ``[H, ...]``, each KV head's rows repeated for its query heads (expand and
        reshape: ``repeat_interleave``'s values without its output-size read)."""
        h, group = keys.shape[0], self.ctx.spec.group
        return keys[:, None].expand(h, group, *keys.shape[1:]).reshape(h * group, *keys.shape[1:])

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
        self._block_keys[layer] = torch.zeros(spec.n_heads, 0, spec.head_dim, device=kv.device)
        self._built[layer] = 0

    # ------------------------------------------------------------------ host side
    def _full_blocks(self, kv: LayerKV) -> int:
        """Complete blocks in the middle of ``kv`` at this step (host)."""
        return self.layout(kv).middle // self.block

    def _take(self, full_blocks: int) -> int:
        """Blocks attended: PQCache's ``ceil(select / block_size)``, at most the full ones."""
        return min(math.ceil(self.ctx.budget.select / self.block), full_blocks)

    def attend_limit(self, ctx: GenerationContext, layer: int) -> int:
        """Whole blocks: the sinks, ``ceil(select / block_size)`` blocks, the remainder past the last full
        block (under one block), the window and the current token."""
        budget = ctx.budget
        return budget.sink + math.ceil(budget.select / self.block) * self.block + self.block - 1 + budget.local + 1

    def covers(self, kv: LayerKV) -> bool:
        """Whether every full block is taken (or there is none): the selection is every held token."""
        full_blocks = self._full_blocks(kv)
        return self._take(full_blocks) == full_blocks

    def decode_key(self) -> tuple[bool, int]:
        """Whether the step is dense (covering), else the number of full blocks (it fixes every shape of
        the selection; the dense step's ops do not depend on it)."""
        kv = self.compressing_kv()
        return (True, 0) if self.covers(kv) else (False, self._full_blocks(kv))

    def recall_candidates(self, kv: LayerKV) -> torch.Tensor | None:
        """The slots of the full blocks (what the earlier ``select`` ranked)."""
        sink = self.layout(kv).sink_end
        return torch.arange(sink, sink + self._full_blocks(kv) * self.block, device=kv.home)

    def before_step(self, ctx: Any) -> None:
        """Buffers sized to the layers' capacity, the representative keys of blocks completed by this step,
        and the regime's constants: everything the step reads that changes only at host-known steps."""
        kv = self.compressing_kv()
        self._step_regime(kv)
        for layer in self._received:
            self._prepare(layer, ctx.store[layer], self._decided[1])

    def _prepare(self, layer: int, kv: LayerKV, full_blocks: int) -> None:
        """Grow ``layer``'s buffers to the store's capacity (new columns zero) and build its new blocks.
        Host checks only once done: a static step finds it done by :meth:`before_step`; the dynamic step
        (``engine.decode=dynamic``, no ``before_step``) does it from ``select``."""
        received = self._received[layer]
        if received.shape[1] < kv.capacity:
            grown = torch.zeros(received.shape[0], kv.capacity, device=received.device)
            grown[:, : received.shape[1]] = received
            self._received[layer] = grown
        reps = self._block_keys[layer]
        most = max(0, kv.capacity - self.ctx.budget.sink) // self.block
        if reps.shape[1] < most:
            grown = torch.zeros(reps.shape[0], most, reps.shape[2], device=reps.device)
            grown[:, : reps.shape[1]] = reps
            self._block_keys[layer] = grown
        if self._take(full_blocks) > 0 and full_blocks > self._built[layer]:
            self._extend_blocks(layer, kv, full_blocks)

    def _ready(self, layer: int, kv: LayerKV, full_blocks: int) -> bool:
        """Whether :meth:`_prepare` has nothing to do (host checks)."""
        built = self._built[layer] >= full_blocks or self.ctx.budget.select == 0
        return built and self._received[layer].shape[1] >= kv.capacity

    def _extend_blocks(self, layer: int, kv: LayerKV, full_blocks: int) -> None:
        """Representative keys of blocks ``[built, full_blocks)``, all at once (one batch, as before)."""
        done = self._built[layer]
        sink = self.ctx.budget.sink
        start, end = sink + done * self.block, sink + full_blocks * self.block
        reps = self._block_keys[layer]
        keys = self._expand(kv.keys[:, start:end].to(reps.device).float())  # [H, new*block, d]
        h, _, d = keys.shape
        keys = keys.view(h, full_blocks - done, self.block, d)
        score = self._received[layer][:, start:end].view(h, full_blocks - done, self.block).to(keys.device)
        top = torch.topk(score, self.reps, dim=-1).indices  # [H, new, reps]
        chosen = torch.gather(keys, 2, top[..., None].expand(-1, -1, -1, d)).mean(dim=2)
        reps[:, done:full_blocks] = chosen.to(reps.device)
        self._built[layer] = full_blocks
        if kv.offload:
            kv.count_index_bytes((full_blocks - done) * self.reps * kv.n_kv_heads * kv.head_dim * kv.element_bytes)

    def _step_regime(self, kv: LayerKV) -> _Regime | None:
        """This step's :class:`_Regime` (None: a covering step), decided once per held length."""
        if self._decided[0] != kv.n:
            full_blocks = self._full_blocks(kv)
            covering = self._take(full_blocks) == full_blocks
            self._decided = (kv.n, full_blocks, None if covering else self._constants(kv, full_blocks))
        return self._decided[2]

    def _constants(self, kv: LayerKV, full_blocks: int) -> _Regime:
        """The :class:`_Regime` of ``full_blocks`` full blocks (made when the number changes)."""
        found = self._regime
        if found is None or found.blocks != full_blocks or found.device != kv.device:
            sink, local, device = self.ctx.budget.sink, self.ctx.budget.local, kv.device
            blocks_end = sink + full_blocks * self.block
            tail = torch.arange(blocks_end, blocks_end + local + self.block, device=device)
            found = self._regime = _Regime(
                blocks=full_blocks,
                device=device,
                take=self._take(full_blocks),
                tail=tail[None],
                window=tail + local,
                block_slots=torch.arange(sink, blocks_end, device=device).view(full_blocks, self.block),
                prefix=torch.arange(sink, device=device)[None],
                reversed_iota=torch.arange(full_blocks - 1, -1, -1, device=device),
            )
        return found

    # ------------------------------------------------------------------ the device step
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """Sinks, the top ``take`` blocks by representative score and the tail (module docstring)."""
        regime = self._step_regime(kv)
        if not self._ready(layer, kv, self._decided[1]):
            self._prepare(layer, kv, self._decided[1])  # (the dynamic step only: the static step's before_step did it)
        if regime is None:
            return None
        rows = self.ctx.spec.n_kv_heads
        parts = [regime.prefix]
        selected = None
        if regime.take > 0:
            q = query[0, :, 0, :]  # [H, d]
            reps = self._block_keys[layer][:, : regime.blocks]
            scores = torch.einsum("hd,hbd->b", q if q.dtype == torch.float32 else q.float(), reps)
            scores = (scores / self.ctx.spec.n_heads).view(1, -1)
            chosen = topk_keyed(scores, regime.take, reversed_iota=regime.reversed_iota).view(-1)  # block indices
            selected = regime.block_slots.index_select(0, chosen).view(1, -1)
            parts.append(selected)
            selected = selected.expand(rows, -1)
        unclamped = torch.cat([*parts, regime.tail], dim=1)  # [1, K] ascending
        assert kv.current is not None
        valid = unclamped <= kv.current  # padding: the tail past the current token
        slots = torch.minimum(unclamped, kv.current)
        return Selection(slots=slots.expand(rows, -1), selected=selected, valid=valid.expand(rows, -1))

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        """Accumulate the attention that tokens inside the local window receive (for future blocks): in
        place, on the tail of a selection (the only part that can lie in the window) or on the whole
        bucket of a dense step. ``received`` gains exactly what it gained before (entries out of the
        window and padded ones add zero)."""
        if layer not in self._received or probs is None:
            return
        received = self._received[layer]
        if received.shape[1] < kv.capacity:  # (the dynamic step: the store grew since the last step)
            self._prepare(layer, kv, self._full_blocks(kv))
            received = self._received[layer]
        assert kv.current is not None
        current = _on(kv.current, received.device)
        probs = _on(probs, received.device)
        probs = probs if probs.dtype == torch.float32 else probs.float()
        if selection is None or probs.shape[1] != selection.slots.shape[1]:  # every held slot, in order
            width = probs.shape[1]
            iota = kv.iota(width) if width == kv.bucket_end else torch.arange(width, device=received.device)
            in_window = iota + self.ctx.budget.local >= current
            received[:, :width].add_(probs * in_window)
            return
        regime = self._decided[2]
        assert regime is not None
        width = regime.window.shape[0]
        in_window = regime.window >= current
        tail = selection.slots[:1, -width:].expand(probs.shape[0], -1)
        received.scatter_add_(1, tail, probs[:, -width:] * in_window)

    # ------------------------------------------------------------------ rollback
    def snapshot(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The built blocks' representative keys and the local attention every held token received
        (decode steps change both in place: copied)."""
        store = self.ctx.store
        return (
            {layer: reps[:, : self._built[layer]].clone() for layer, reps in self._block_keys.items()},
            {layer: r[:, : store[layer].n].clone() for layer, r in self._received.items()},
        )

    def restore(self, state: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]) -> None:
        """Back to :meth:`snapshot`'s state, in place (a captured step keeps reading the same buffers);
        columns past the snapshot are zeroed, as they were then."""
        blocks, received = state
        for layer, reps in blocks.items():
            self._block_keys[layer] = _fill(self._block_keys.get(layer), reps)
            self._built[layer] = reps.shape[1]
        for layer, r in received.items():
            self._received[layer] = _fill(self._received.get(layer), r)

    def telemetry(self) -> dict[str, Any]:
        if not self.started:
            return {}
        return {"reps": self.reps, "block_size": self.block, "comm_ratio_used": self.reps / self.block}


def _fill(buffer: torch.Tensor | None, saved: torch.Tensor) -> torch.Tensor:
    """``buffer`` holding ``saved`` in its first columns and zeros after (a copy of ``saved`` when there is
    no buffer wide enough)."""
    if buffer is None or buffer.shape[1] < saved.shape[1] or buffer.shape[0] != saved.shape[0]:
        return saved.clone()
    buffer[:, : saved.shape[1]].copy_(saved)
    buffer[:, saved.shape[1] :].zero_()
    return buffer


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, with no op when it is there already (a decode step counts its ops)."""
    return tensor if tensor.device == device else tensor.to(device)
