"""``pqcache``: product-quantized keys, PQ search at decode, offloaded KV behind a block cache.

PQCache (Zhang et al., SIGMOD 2025; seed-pqcache.md §2) treats decode-time token selection as
maximum-inner-product search:

* **prefill** — all K/V go to the host tier. For every layer and KV head the post-RoPE keys of the
  non-sink prompt tokens (the local window's too, as the authors' code does) are split into ``m``
  sub-spaces and clustered into ``2**b`` centroids each; every token gets ``m`` codes of ``b`` bits.
  As in the paper's Algorithm 1, a layer's k-means runs on **host copies** of its keys in this
  instance's CPU worker pool (``workers`` threads, :mod:`kvbench.methods.pqcache_workers`) while the
  model computes the next layers: on a GPU the keys come from the host tier the store offloads them
  to (or a side-stream copy when ``offload=false``), and the workers wait for that copy on their own
  threads, so clustering never queues on the model's stream. The first decode step of a layer waits
  for its codebook, so clustering that outlasts the prefill shows in TT2T. ``kmeans_device=model``
  keeps the batched GPU variant (the model's device, its own CUDA stream) as an option.
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

K-means schedule. ``kmeans_iters``: an integer cap, or ``adaptive`` — the paper's cost model (§3.3):
``T_max = (t_layer(s) − t_kmeans3(s)) / t_iter(s) + 3`` clipped to ``[3, 300]``, with the per-layer compute
time and the k-means costs fitted on this machine (``kvbench.methods.pqcache_cost``), the k-means
timed on the very workers and device it governs, and cached. ``null`` (the default) takes
``method.protocol``'s: ``pqcache`` — the authors' quality scripts (``run_llama.sh``/``run_mistral.sh``,
``MAX_ITER=0``) — is adaptive; ``pqcache_niah`` — their ``test_nah.py`` — fixes 10. ``kmeans_rules``:
``sklearn`` (default) is the reference's scikit-learn ``KMeans(n_init=1, tol=1e-4, algorithm="lloyd")``
from shared random points (``kmeans.SKLEARN``: stop once the centroids move less than the tolerance
or no label changes; an empty cluster takes the point farthest from its centroid), so the cap is
an upper bound and a problem may stop earlier; ``fixed`` runs exactly
``kmeans_iters`` updates and an empty cluster keeps its centroid (kvbench's earlier rule; ClusterKV
keeps its own rules). Every sample's telemetry records the protocol, the schedule it resolved to, the
cap used (``kmeans_iters``), the updates actually run (``kmeans_updates``), the rules, device and
workers, and for ``adaptive`` which fitted cost model decided.

Block cache. Blocks of ``cache_block`` tokens are counted from the first non-sink slot, as the
reference's cache indexes its offloaded middle buffer (``cache_manager.py``: block = index // 128 in a
buffer that starts at the sink): block ``i`` holds slots ``[sink + 128·i, sink + 128·(i + 1))``.

The pool belongs to the instance and lives for one request: ``start`` opens it with this instance's
``workers``, ``release`` shuts it down after the request, answered or failed (queued shares of layers
no decode step asked for are dropped; running ones finish outside the measured time).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import PQCACHE_PROTOCOL_ITERS, PQCacheParams
from kvbench.methods.pqcache_workers import KMeansWorkers, LayerJob
from kvbench.methods.primitives.kmeans import SKLEARN
from kvbench.methods.primitives.pq import PQCodebook, comm_ratio, gqa_topk, pq_encode, pq_scores
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


#: room for new tokens' codes allocated with a layer's code buffer (it doubles when a generation needs more)
CODE_SPARE_TOKENS = 256


class CodeBuffer:
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


class _Layer:
    """One layer's PQ state: the codebook (once clustering finished) and the coded prefix."""

    def __init__(self, job: LayerJob) -> None:
        self.job = job
        self.book: PQCodebook | None = None
        self.buffer: CodeBuffer | None = None  # holds book.codes (book.codes is a view of it)
        self.coded_end = 0  # codes exist for slots [sink, coded_end)
        self.iterations = 0
        self.prefetched: torch.Tensor | None = None  # this step's device copy of the codes (CUDA)
        self.event: Any = None


@register
class PQCache(RetrievalMethod):
    name = "pqcache"
    Params = PQCacheParams
    params: PQCacheParams
    workers: KMeansWorkers | None = None  # this instance's pool, open from start to release

    @property
    def shares_prefill(self) -> bool:
        """Only with ``overlap: false``: overlapped k-means is timed against the prefill's compute (the
        first decode step waits for what the later layers did not hide, TT2T), which a shared prefill
        does not run, so ``overlap: true`` keeps its own prefill and its timing."""
        return super().shares_prefill and not self.params.overlap

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        m, b = self.params.m, self.params.b  # both set or both null (PQCacheParams.validate)
        if m is None or b is None:
            m, b = default_pq(ctx.budget.comm_ratio, ctx.spec.head_dim)
        if ctx.spec.head_dim % int(m):
            raise ValueError(f"head_dim {ctx.spec.head_dim} is not divisible by method.m={m}")
        self.m, self.b = int(m), int(b)
        self.layers: dict[int, _Layer] = {}
        self.iters_setting = self.schedule()
        self.kmeans_options = dict(SKLEARN) if self.params.kmeans_rules == "sklearn" else {}
        if self.workers is not None:  # (release normally closed it already)
            self.workers.shutdown()
        device = ctx.spec.device if self.params.kmeans_device == "model" else "cpu"
        self.workers = KMeansWorkers(self.params.workers, device)
        self.cost: dict[str, Any] | None = None
        if self.iters_setting == "adaptive":  # fitted (once per machine) before the generation starts
            from kvbench.methods.pqcache_cost import load_or_fit

            self.cost = load_or_fit(ctx, self.m, self.b, self.kmeans_backend(), self._time_layer_kmeans)
        self.timers = {"kmeans_s": 0.0, "wait_kmeans_s": 0.0, "pq_search_s": 0.0, "encode_s": 0.0}
        self.updates: list[int] = []

    @property
    def pool(self) -> KMeansWorkers:
        """This instance's k-means workers (open from :meth:`start` to :meth:`release`)."""
        assert self.workers is not None, "pqcache's k-means workers run from start() to release()"
        return self.workers

    def schedule(self) -> int | str:
        """The iteration setting this run uses: ``kmeans_iters``, else the protocol's."""
        setting = self.params.kmeans_iters
        return PQCACHE_PROTOCOL_ITERS[self.params.protocol] if setting is None else setting

    def kmeans_backend(self) -> dict[str, Any]:
        """Where the k-means runs (what a cost model is fitted on, and recorded with it)."""
        return {
            "device": str(self.pool.device),
            "workers": self.pool.workers,
            "threads": torch.get_num_threads(),
            "metric": self.params.metric,
        }

    def _time_layer_kmeans(self, tokens: int, iters: int) -> float:
        """Seconds of one layer's PQ construction at ``tokens`` tokens and exactly ``iters`` updates, on
        this instance's workers and k-means device (random keys of the layer's shape and dtype)."""
        spec = self.ctx.spec
        generator = torch.Generator().manual_seed(tokens)
        dtype = next(self.ctx.model.parameters()).dtype
        keys = torch.randn(spec.n_kv_heads, tokens, spec.head_dim, generator=generator).to(self.pool.device, dtype)
        if keys.is_cuda:  # the copy ran on the current stream; the workers' stream must not overtake it
            torch.cuda.synchronize(keys.device)
        start = time.perf_counter()
        self.pool.submit(
            keys,
            self.m,
            self.b,
            iters=iters,
            metric=self.params.metric,
            seed=self.params.seed,
            init=self.params.init,
            options={},
        ).result()
        return time.perf_counter() - start

    def cache_offset(self, ctx: Any) -> int:
        return ctx.budget.sink  # blocks index the middle tokens, as the reference's offloaded buffer

    def release(self) -> None:
        """The request is over (answered or failed): close this instance's k-means pool (see the
        module docstring). A failed request must not leave its queued shares running."""
        if self.workers is not None:
            self.workers.shutdown()

    # ------------------------------------------------------------------ prefill
    def kmeans_iterations(self, tokens: int) -> int:
        if self.cost is not None:
            from kvbench.methods.pqcache_cost import iterations_for

            return iterations_for(self.cost, tokens)
        return int(self.iters_setting)

    def _kmeans_keys(self, key: torch.Tensor, kv: LayerKV) -> tuple[torch.Tensor, Any]:
        """The layer's non-sink keys where the workers cluster them, and the CUDA event to wait for.

        ``kmeans_device=cpu`` on a CUDA model: the store's host tier already holds them (offloaded on
        the model's stream; the event follows that copy), else a pinned copy on a side stream. On a CPU
        model the keys are host tensors already. ``model``: the keys on the model's device."""
        sink = self.ctx.budget.sink
        keys = key[0, :, sink:].detach()
        if keys.device.type != "cuda":
            return keys, None
        current = torch.cuda.current_stream(keys.device)
        event = torch.cuda.Event()
        if self.params.kmeans_device == "model":
            event.record(current)
            return keys, event
        if kv.home.type == "cpu" and kv.n == key.shape[2]:
            event.record(current)
            return kv.keys[:, sink:], event
        if not hasattr(self, "_copy_stream"):
            self._copy_stream = torch.cuda.Stream(keys.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            host = torch.empty(keys.shape, dtype=keys.dtype, pin_memory=True)
            host.copy_(keys, non_blocking=True)
            event.record(self._copy_stream)
        keys.record_stream(self._copy_stream)
        return host, event

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        if layer in self.dense_layers:
            return
        keys, ready = self._kmeans_keys(key, kv)
        iters = self.kmeans_iterations(keys.shape[1])
        job = self.pool.submit(
            keys,
            self.m,
            self.b,
            iters=iters,
            metric=self.params.metric,
            seed=self.params.seed,
            init=self.params.init,
            options=self.kmeans_options,
            ready=ready,
            inline=not self.params.overlap,
        )
        state = _Layer(job)
        state.coded_end = kv.n
        state.iterations = iters
        self.layers[layer] = state

    def _codebook(self, layer: int) -> _Layer:
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
            state.buffer = CodeBuffer(codes, spare=CODE_SPARE_TOKENS, pin=pin)
            state.book = dataclasses.replace(
                book,
                centroids=book.centroids.to(device),
                codes=state.buffer.codes,
                phi=None if book.phi is None else book.phi.to(device),
                extra=None if book.extra is None else book.extra.to(device),
            )
        return state

    def _device_codes(self, layer: int, state: _Layer, middle: int) -> torch.Tensor:
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

    def _prefetch_next(self, layer: int) -> None:
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
            if current.book is not None and current.buffer is not None:  # codes cover slots [sink, coded_end)
                if hasattr(self, "_stream"):  # a prefetch may still read the rows about to be rewritten
                    self._stream.synchronize()
                current.book.codes = current.buffer.truncate(coded_end - sink)

    def telemetry(self) -> dict[str, Any]:
        if not self.started:
            return {}
        iters = sorted({s.iterations for s in self.layers.values()})
        return {
            "m": self.m,
            "b": self.b,
            "comm_ratio_used": comm_ratio(self.m, self.b, self.ctx.spec.head_dim),
            "protocol": self.params.protocol,
            "kmeans_schedule": self.iters_setting,  # adaptive, or the fixed cap
            "kmeans_iters": iters[0] if len(iters) == 1 else iters,  # the cap each layer got
            # updates actually run (the most over a layer's problems), mean over the layers a decode step awaited
            "kmeans_updates": sum(self.updates) / len(self.updates) if self.updates else None,
            "kmeans_rules": self.params.kmeans_rules,
            "kmeans_device": str(self.workers.device) if self.workers is not None else None,
            "kmeans_workers": self.params.workers,
            "cost_model": None
            if self.cost is None
            else {"kmeans": self.cost.get("kmeans"), "device": self.cost["device"]},
            **{k: round(v, 6) for k, v in self.timers.items()},
        }
