"""PQCache's pre-static decode step, kept as an independent reference for the static step.

:class:`LegacyPQCache` is ``methods/pqcache.py`` as it selected before the static decode step
(:mod:`kvbench.engine.decode`), copied verbatim: the host-side layout read from ``kv.n`` at every step,
each layer's codebook awaited in its own first ``select``, the codes of the tokens that left the local
window appended to a growing :class:`LegacyCodeBuffer` (one ``pq_encode`` of the whole range), the PQ
scores of exactly the middle tokens and ``gqa_topk`` (``kthvalue`` per row). It runs on the dynamic
per-layer step (``static_decode = False``); ``tests/test_static_pqcache.py`` checks that the static
method attends the same positions at every step and layer, generates the same tokens and counts the
same bytes and cache hits.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.pqcache import PQCache, _Layer
from kvbench.methods.primitives.pq import gqa_topk, pq_encode, pq_scores
from kvbench.methods.selection import compose

#: room for new tokens' codes allocated with a layer's code buffer (it doubles when a generation needs more)
CODE_SPARE_TOKENS = 256


class LegacyCodeBuffer:
    """A layer's codes ``[kv_heads, n, m]`` in one preallocated host buffer, pinned on CUDA.

    Decode appends the codes of the tokens that leave the local window every step. Concatenating
    them (``torch.cat``) would allocate a fresh, unpinned tensor per step, and the next step's copy of
    the codes to the device (the prefetch on a side stream) would then be synchronous: the buffer is
    allocated once with room to grow (doubling when a generation outgrows it, rare), written in place,
    and :attr:`codes` is a view of its first ``n`` rows (a view of pinned memory is pinned).
    """

    def __init__(self, codes: torch.Tensor, spare: int, pin: bool) -> None:
        heads, n, m = codes.shape
        self.pin = pin
        self.data = torch.empty(heads, n + max(spare, 1), m, dtype=codes.dtype, device=codes.device, pin_memory=pin)
        self.data[:, :n] = codes
        self.n = n

    @property
    def codes(self) -> torch.Tensor:
        return self.data[:, : self.n]

    def append(self, fresh: torch.Tensor) -> torch.Tensor:
        """Write ``fresh`` ``[kv_heads, k, m]`` after the current codes; returns :attr:`codes`."""
        end = self.n + fresh.shape[1]
        if end > self.data.shape[1]:
            grown = torch.empty(
                self.data.shape[0],
                max(end, 2 * self.data.shape[1]),
                self.data.shape[2],
                dtype=self.data.dtype,
                device=self.data.device,
                pin_memory=self.pin,
            )
            grown[:, : self.n] = self.codes
            self.data = grown
        self.data[:, self.n : end] = fresh
        self.n = end
        return self.codes

    def truncate(self, n: int) -> torch.Tensor:
        """Keep the first ``n`` tokens' codes (a rolled-back conversation); returns :attr:`codes`."""
        self.n = min(self.n, n)
        return self.codes


class LegacyPQCache(PQCache):
    name = "_legacy_pqcache"
    static_decode = False

    def before_step(self, ctx: Any) -> None:
        """(The earlier step had no host-side hook: each layer waited for its codebook in ``select``.)"""

    def decode_key(self) -> Any:
        return ()

    def _codebook(self, layer: int) -> _Layer:  # type: ignore[override]
        state = self.layers[layer]
        if state.book is None:
            start = time.perf_counter()
            book, seconds = state.job.result()
            self.timers["wait_kmeans_s"] += time.perf_counter() - start
            self.timers["kmeans_s"] += seconds
            self.updates.append(book.iterations)
            device = torch.device(self.ctx.spec.device)
            codes = book.codes.to(self.ctx.store[layer].home)
            # host codes on CUDA are pinned (copied to the device asynchronously), with room for the
            # tokens this generation will encode
            pin = device.type == "cuda" and codes.device.type == "cpu"
            state.buffer = LegacyCodeBuffer(codes, spare=CODE_SPARE_TOKENS, pin=pin)  # type: ignore[assignment]
            state.book = dataclasses.replace(
                book,
                centroids=book.centroids.to(device),
                codes=state.buffer.codes,
                phi=None if book.phi is None else book.phi.to(device),
                extra=None if book.extra is None else book.extra.to(device),
            )
        return state

    def _device_codes(self, layer: int, state: _Layer, middle: int) -> torch.Tensor:  # type: ignore[override]
        """The layer's codes on the compute device: the copy prefetched during the previous layer
        (CUDA side stream) plus this step's new codes, else a direct copy."""
        book = state.book
        assert book is not None  # (after _codebook)
        device = book.centroids.device
        if state.prefetched is not None:
            torch.cuda.current_stream(device).wait_event(state.event)
            codes = state.prefetched
            if codes.shape[1] < middle:
                codes = torch.cat([codes, book.codes[:, codes.shape[1] : middle].to(device)], dim=1)
            state.prefetched = state.event = None
            return codes[:, :middle]
        return book.codes[:, :middle].to(device)

    def _prefetch_next(self, layer: int) -> None:  # type: ignore[override]
        """While this layer computes, copy the next layer's codes on a side stream (PQCache Alg. 2)."""
        following = self.layers.get(layer + 1)
        book = None if following is None else following.book
        if following is None or book is None or book.centroids.device.type != "cuda":
            return
        device = book.centroids.device
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            following.prefetched = book.codes.to(device, non_blocking=True)
            following.event = torch.cuda.Event()
            following.event.record(self._stream)

    # ------------------------------------------------------------------ decode
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        budget, spec = self.ctx.budget, self.ctx.spec
        lay = self.layout(kv)
        candidates = lay.candidates(kv.home)
        if budget.select >= lay.middle:
            return compose(lay, candidates.expand(spec.n_kv_heads, -1), ascending=True)
        state = self._codebook(layer)
        book, buffer = state.book, state.buffer
        assert book is not None and buffer is not None  # (_codebook waits for it)
        if lay.middle_end > state.coded_end:  # tokens that left the local window get nearest-centroid codes
            start = time.perf_counter()
            keys = kv.keys[:, state.coded_end : lay.middle_end].float().to(book.centroids.device)
            fresh = pq_encode(keys, book.centroids, metric=book.metric, phi=book.phi, extra=book.extra)
            book.codes = buffer.append(fresh.to(buffer.data.device))  # in place, no reallocation
            state.coded_end = lay.middle_end
            self.timers["encode_s"] += time.perf_counter() - start
        start = time.perf_counter()
        codes = self._device_codes(layer, state, lay.middle)  # codes start at the first non-sink slot
        self._prefetch_next(layer)
        if kv.offload:
            kv.count_index_bytes(spec.n_kv_heads * math.ceil(lay.middle * self.m * self.b / 8))
        q = query[0, :, 0, :].float().view(spec.n_kv_heads, spec.group, -1).to(book.centroids.device)
        scores = pq_scores(q, book.centroids, codes)  # [kv_heads, group, middle]
        # softmax over the candidates (the authors' rule), summed over the group; or logit_sum / max
        rule = self.params.gqa
        chosen = gqa_topk(scores, budget.select, rule, spec.head_dim**-0.5).to(kv.home) + lay.sink_end
        self.timers["pq_search_s"] += time.perf_counter() - start
        return compose(lay, chosen, ascending=True)  # gqa_topk: ascending per row

    def snapshot(self) -> dict[int, int]:  # type: ignore[override]
        """Where each layer's codes end (decode appends nearest-centroid codes of the tokens that leave
        the local window; the codebook itself never changes)."""
        return {layer: state.coded_end for layer, state in self.layers.items()}

    def restore(self, state: dict[int, int]) -> None:  # type: ignore[override]
        sink = self.ctx.budget.sink
        for layer, coded_end in state.items():
            current = self.layers[layer]
            current.coded_end = coded_end
            current.prefetched = current.event = None  # a prefetched copy may hold codes of dropped tokens
            if current.book is not None and current.buffer is not None:  # codes cover slots [sink, coded_end)
                if hasattr(self, "_stream"):  # a prefetch may still read the rows about to be rewritten
                    self._stream.synchronize()
                current.book.codes = current.buffer.truncate(coded_end - sink)
