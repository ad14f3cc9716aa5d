"""``pqcache``: product-quantized keys, PQ search at decode, offloaded KV behind a block cache.

PQCache (Zhang et al., SIGMOD 2025; seed-pqcache.md §2) treats decode-time token selection as
maximum-inner-product search:

* **prefill** — all K/V go to the host tier. For every layer and KV head the post-RoPE keys of the
  non-sink prompt tokens (the local window's too, as the authors' code does) are split into ``m``
  sub-spaces and clustered into ``2**b`` centroids each; every token gets ``m`` codes of ``b`` bits.
  K-means of a layer runs on a worker thread while the model computes the next layers; the first
  decode step of that layer waits for it, so clustering that outlasts the prefill shows in TT2T.
* **decode** — per layer: the query × centroid lookup table plus a gather-sum over the codes scores
  every middle token; per query head the scores go through a softmax (over the candidates, scaled
  by ``1/sqrt(d)``) and are summed over the GQA group (the authors' rule; ``gqa: logit_sum`` sums raw
  scores instead), the top ``select`` tokens are fetched through the block cache, and attention runs
  over sinks + top-k + local window + current token. Tokens leaving the local window get
  nearest-centroid codes.
* **accounting** — the middle tokens' codes move host→device every step (counted as index bytes at
  ``b`` bits each, the paper's theoretical figure); the extra communication ratio
  ``m·b / (16·d_h)`` is recorded. Centroids stay on the device; on CUDA the host codes are pinned and
  layer l+1's codes are copied on a side stream while layer l computes (the paper's prefetch).

``m``/``b`` default from ``budget.comm_ratio``: the code bits per token and head may be
``T = comm_ratio · 16 · d_h``; T ≥ 32 → 4×8 (InfiniteBench, 1/64 at d_h 128), T ≥ 16 → 2×6
(LongBench, 1/128 at d_h 128: the paper's choice within 16 bits), T ≥ 8 → 2×4, else 1×T.
``kmeans_iters``: an integer, or ``adaptive`` — the paper's cost model (§3.3):
``T_max = (t_layer(s) − t_kmeans3(s)) / t_iter(s) + 3`` clipped to ``[3, 300]``, with the per-layer compute time
and the k-means costs fitted on this machine (``kvbench.methods.pqcache_cost``) and cached.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import PQCacheParams
from kvbench.methods.primitives.pq import PQCodebook, comm_ratio, gqa_topk, pq_encode, pq_fit, pq_scores
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import compose


def default_pq(comm: float, head_dim: int) -> tuple[int, int]:
    """``(m, b)`` for an extra-communication budget (see the module docstring)."""
    bits = comm * 16 * head_dim
    if bits >= 32:
        return 4, 8
    if bits >= 16:
        return 2, 6
    if bits >= 8:
        return 2, 4
    return 1, max(1, int(bits))


class _Layer:
    """One layer's PQ state: the codebook (once clustering finished) and the coded prefix."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.book: PQCodebook | None = None
        self.coded_end = 0  # codes exist for slots [sink, coded_end)
        self.iterations = 0
        self.prefetched: torch.Tensor | None = None  # this step's device copy of the codes (CUDA)
        self.event: Any = None


@register
class PQCache(RetrievalMethod):
    name = "pqcache"
    Params = PQCacheParams
    params: PQCacheParams
    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    @property
    def shares_prefill(self) -> bool:
        """Only with ``overlap: false``: overlapped k-means is timed against the prefill's compute (the
        first decode step waits for what the later layers did not hide, TT2T), which a shared prefill
        does not run, so ``overlap: true`` keeps its own prefill and its timing."""
        return super().shares_prefill and not self.params.overlap

    @classmethod
    def pool(cls, workers: int) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvbench-kmeans")
            return cls._pool

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        m, b = self.params.m, self.params.b  # both set or both null (PQCacheParams.validate)
        if m is None or b is None:
            m, b = default_pq(ctx.budget.comm_ratio, ctx.spec.head_dim)
        if ctx.spec.head_dim % int(m):
            raise ValueError(f"head_dim {ctx.spec.head_dim} is not divisible by method.m={m}")
        self.m, self.b = int(m), int(b)
        self.layers: dict[int, _Layer] = {}
        self.iters_setting = self.params.kmeans_iters
        self.cost: dict[str, Any] | None = None
        if self.iters_setting == "adaptive":  # fitted (once per machine) before the generation starts
            from kvbench.methods.pqcache_cost import load_or_fit

            self.cost = load_or_fit(ctx, self.m, self.b)
        self.timers = {"kmeans_s": 0.0, "wait_kmeans_s": 0.0, "pq_search_s": 0.0, "encode_s": 0.0}

    def cache_offset(self, ctx: Any) -> int:
        return 0

    # ------------------------------------------------------------------ prefill
    def kmeans_iterations(self, tokens: int) -> int:
        if self.cost is not None:
            from kvbench.methods.pqcache_cost import iterations_for

            return iterations_for(self.cost, tokens)
        return int(self.iters_setting)

    def on_prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv: LayerKV) -> None:
        if layer in self.dense_layers:
            return
        sink = self.ctx.budget.sink
        keys = key[0, :, sink:].detach()
        iters = self.kmeans_iterations(keys.shape[1])
        seed, metric, init = self.params.seed, self.params.metric, self.params.init

        def build() -> tuple[PQCodebook, float]:
            start = time.perf_counter()
            with torch.inference_mode():  # inference mode is per thread
                book = pq_fit(keys.float(), self.m, self.b, iters=iters, metric=metric, seed=seed, init=init)
            return book, time.perf_counter() - start

        state = _Layer(self.pool(self.params.workers).submit(build) if self.params.overlap else _done(build()))
        state.coded_end = kv.n
        state.iterations = iters
        self.layers[layer] = state

    def _codebook(self, layer: int) -> _Layer:
        state = self.layers[layer]
        if state.book is None:
            start = time.perf_counter()
            book, seconds = state.future.result()
            self.timers["wait_kmeans_s"] += time.perf_counter() - start
            self.timers["kmeans_s"] += seconds
            device = torch.device(self.ctx.spec.device)
            codes = book.codes.to(self.ctx.store[layer].home)
            if device.type == "cuda":
                codes = codes.pin_memory()  # host codes, copied to the device asynchronously
            state.book = dataclasses.replace(
                book,
                centroids=book.centroids.to(device),
                codes=codes,
                phi=None if book.phi is None else book.phi.to(device),
                extra=None if book.extra is None else book.extra.to(device),
            )
        return state

    def _device_codes(self, layer: int, state: _Layer, middle: int) -> torch.Tensor:
        """The layer's codes on the compute device: the copy prefetched during the previous layer
        (CUDA side stream) plus this step's new codes, else a direct copy."""
        book = state.book
        device = book.centroids.device
        if state.prefetched is not None:
            torch.cuda.current_stream(device).wait_event(state.event)
            codes = state.prefetched
            if codes.shape[1] < middle:
                codes = torch.cat([codes, book.codes[:, codes.shape[1] : middle].to(device)], dim=1)
            state.prefetched = state.event = None
            return codes[:, :middle]
        return book.codes[:, :middle].to(device)

    def _prefetch_next(self, layer: int) -> None:
        """While this layer computes, copy the next layer's codes on a side stream (PQCache Alg. 2)."""
        following = self.layers.get(layer + 1)
        if following is None or following.book is None or following.book.centroids.device.type != "cuda":
            return
        device = following.book.centroids.device
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            following.prefetched = following.book.codes.to(device, non_blocking=True)
            following.event = torch.cuda.Event()
            following.event.record(self._stream)

    # ------------------------------------------------------------------ decode
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection:
        budget, spec = self.ctx.budget, self.ctx.spec
        lay = self.layout(kv)
        candidates = lay.candidates(kv.home)
        if budget.select >= lay.middle:
            return compose(lay, candidates.expand(spec.n_kv_heads, -1))
        state = self._codebook(layer)
        book = state.book
        if lay.middle_end > state.coded_end:  # tokens that left the local window get nearest-centroid codes
            start = time.perf_counter()
            keys = kv.keys[:, state.coded_end : lay.middle_end].float().to(book.centroids.device)
            fresh = pq_encode(keys, book.centroids, metric=book.metric, phi=book.phi, extra=book.extra)
            book.codes = torch.cat([book.codes, fresh.to(book.codes.device)], dim=1)
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
        return compose(lay, chosen)

    def snapshot(self) -> dict[int, int]:
        """Where each layer's codes end (decode appends nearest-centroid codes of the tokens that leave
        the local window; the codebook itself never changes)."""
        return {layer: state.coded_end for layer, state in self.layers.items()}

    def restore(self, state: dict[int, int]) -> None:
        sink = self.ctx.budget.sink
        for layer, coded_end in state.items():
            current = self.layers[layer]
            current.coded_end = coded_end
            current.prefetched = current.event = None  # a prefetched copy may hold codes of dropped tokens
            if current.book is not None:  # codes cover slots [sink, coded_end)
                current.book.codes = current.book.codes[:, : coded_end - sink]

    def telemetry(self) -> dict[str, Any]:
        if self.ctx is None:
            return {}
        iters = sorted({s.iterations for s in self.layers.values()})
        return {
            "m": self.m,
            "b": self.b,
            "comm_ratio_used": comm_ratio(self.m, self.b, self.ctx.spec.head_dim),
            "kmeans_iters": iters[0] if len(iters) == 1 else iters,
            **{k: round(v, 6) for k, v in self.timers.items()},
        }


def _done(result: Any) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
