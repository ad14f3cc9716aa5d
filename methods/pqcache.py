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

Static decode step (:mod:`kvbench.engine.decode`): the same positions, ties and tokens as the earlier
per-layer step (``tests/legacy_pqcache.py``), with fixed shapes and no host read.

* **host side** (:meth:`PQCache.before_step`, eager): at the first step that leaves tokens out, the
  wait for every layer's codebook (:meth:`PQCache._codebook`; the earlier step waited in each layer's
  first ``select``, a covering budget waits for none) and a code buffer with a row for every slot the
  store can hold (on the compute device with ``offload: false``, pinned host memory with ``offload:
  true`` on CUDA); then, every step, the earlier step's rule for which tokens need codes.
* **new codes**: a token's code depends on its key and the codebook only, so the step codes a token
  one step before it leaves the local window: the window's first token, slot ``length - 1 - local``
  (read from the device-side length), with :func:`~kvbench.methods.primitives.pq.pq_encode_static`
  (``pq_encode``'s labels for one token), written in place with ``index_copy_`` — the token the
  earlier step coded alone at the next step. The index it reads is the number of middle tokens, which
  also masks the scores and places the window, so the step spends one op on it. Whether a step codes
  (not while the window still holds prompt tokens, which the k-means coded) is part of
  :meth:`PQCache.decode_key`; when several tokens need codes at once (a budget that stops covering
  the cache), ``before_step`` codes them with the earlier single ``pq_encode`` of the range.
* **scores**: every column of the layer's bucket (slots ``[sink, bucket_end)``) is scored
  (:func:`~kvbench.methods.primitives.pq.pq_scores_static`: ``pq_scores``' numbers in a third of its
  ops); the columns that are not middle tokens are masked with ``-inf`` before the softmax (the
  authors' softmax over the candidates only: a masked column adds an exact 0 to its sum) or after the
  group reduction (``logit_sum``/``max``); the group sum is
  :func:`~kvbench.methods.primitives.pq.prefix_group_sum`, which adds a group's query heads in the
  order torch's CPU sum used over the middle columns alone (it differs in the last ``middle % 32``
  columns from five heads on, and tokens with equal codes rank by those last bits); the top ``select``
  come from :func:`~kvbench.methods.primitives.pq.topk_keyed`, one ``topk`` over the whole score row
  instead of ``kthvalue`` per row, ties to the lower slot.

Exact where the earlier step's softmax saw at least 16 middle tokens and its group sum 8 (torch's
short-row paths round otherwise). A covering budget attends densely (``select`` returns ``None``).

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
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvbench.engine.protocol import Selection
from kvbench.errors import ConfigError
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import GqaRule, KMeansInit, RetrievalParams
from kvbench.methods.pqcache_workers import KMeansWorkers, LayerJob
from kvbench.methods.primitives.kmeans import SKLEARN
from kvbench.methods.primitives.pq import (
    PQCodebook,
    comm_ratio,
    pq_encode,
    pq_encode_static,
    pq_encode_table,
    pq_scores_static,
    prefix_group_sum,
    topk_keyed,
)
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.params import param


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


class CodeBuffer:
    """A layer's codes ``[kv_heads, n, m]`` in one preallocated buffer (row ``i``: slot ``sink + i``),
    pinned on CUDA when it lives on the host.

    Decode writes the codes of new tokens in place: a static step writes its one token's row at a
    device-side index, so the buffer has a row for every slot the store can hold (:meth:`reserve`,
    sized with the store before the first step that selects) and never moves while a regime's steps
    run. Concatenating instead (``torch.cat``) would allocate a fresh, unpinned tensor per step, and
    the next step's copy of the codes to the device (the prefetch on a side stream) would then be
    synchronous. :attr:`codes` is a view of the first ``n`` rows, the coded prefix (a view of pinned
    memory is pinned). Rows past it hold zeros or codes of tokens a rollback dropped: valid indices
    into the lookup table, which a static step reads for every column of its bucket and masks.

    The memory is sub-space major (:attr:`by_subspace`, ``[kv_heads, m, rows]``; :attr:`data` is its
    ``[kv_heads, rows, m]`` view): each sub-space's codes of a bucket are then one contiguous run, and
    a gather of the lookup table with a contiguous index runs twice as fast on a CPU.
    """

    def __init__(self, codes: torch.Tensor, spare: int, pin: bool) -> None:
        heads, n, m = codes.shape
        self.pin = pin
        self.by_subspace = torch.zeros(
            heads, m, n + max(spare, 1), dtype=codes.dtype, device=codes.device, pin_memory=pin
        )
        self.data[:, :n] = codes
        self.n = n

    @property
    def data(self) -> torch.Tensor:
        """``[kv_heads, rows, m]``: every row (a view)."""
        return self.by_subspace.transpose(1, 2)

    @property
    def codes(self) -> torch.Tensor:
        return self.data[:, : self.n]

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows (doubling when it grows: rare, and only between steps)."""
        heads, m, size = self.by_subspace.shape
        if rows <= size:
            return
        grown = torch.zeros(
            heads,
            m,
            max(rows, 2 * size),
            dtype=self.by_subspace.dtype,
            device=self.by_subspace.device,
            pin_memory=self.pin,
        )
        grown[:, :, :size] = self.by_subspace
        self.by_subspace = grown

    def append(self, fresh: torch.Tensor) -> torch.Tensor:
        """Write ``fresh`` ``[kv_heads, k, m]`` after the current codes; returns :attr:`codes`."""
        end = self.n + fresh.shape[1]
        self.reserve(end)
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
        # holds the codes; book.codes is a view of its coded prefix, set again after a request and a rollback
        # (a step that codes a token only moves the prefix's end, buffer.n: a new view would be an op per step)
        self.buffer: CodeBuffer | None = None
        self.coded_end = 0  # codes exist for slots [sink, coded_end)
        self.iterations = 0
        self.prefetched: torch.Tensor | None = None  # this step's device copy, [kv_heads, m, width] (CUDA offload)
        self.event: Any = None
        # the static step's constants (made with the codebook) and this step's host-side decisions
        self.table: torch.Tensor | None = None  # pq_encode_table of the codebook
        self.transposed: torch.Tensor | None = None  # the centroids as pq_scores_static reads them
        self.phi: torch.Tensor | None = None  # (metric ip)
        self.prepared = -1  # the step (the store's n) whose host-side work is done
        self.encodes = False  # this step codes the local window's first token (it has no code yet)


#: PQCache's ``method.protocol``: the k-means iteration cap of the authors' script it names, which
#: ``method.kmeans_iters=null`` takes (``run_llama.sh``/``run_mistral.sh`` set ``MAX_ITER=0``, adaptive,
#: for every quality table; ``test_nah.py`` fixes 10). A run records ``protocol`` and ``kmeans_iters``
#: in its config.yaml, and the schedule it resolved to in every sample's telemetry.
PQCACHE_PROTOCOL_ITERS: dict[str, int | str] = {"pqcache": "adaptive", "pqcache_niah": 10}


@dataclass(frozen=True)
class PQCacheParams(RetrievalParams):
    sink: int = param(32, "the authors' code: 32 sinks outside the budget", min=0)
    local_fraction: float = param(0.5, "local = top-k = half the budget", min=0, max=1)
    cache_tokens: int = param(4096, "device block cache in tokens (the authors' 4096)", min=0)
    cache_blocks: int | None = param(32, "blocks admitted per step, the most selected (the authors' 32)", min=0)
    m: int | None = param(
        None, "PQ sub-spaces; null (with b): from budget.comm_ratio (2x6 at 1/128, 4x8 at 1/64)", min=1
    )
    b: int | None = param(None, "bits per code: 2**b centroids per sub-space; set with m", min=1, max=16)
    protocol: Literal["pqcache", "pqcache_niah"] = param(
        "pqcache",
        "the authors' script whose k-means schedule kmeans_iters=null takes: pqcache (their quality "
        "scripts, run_llama.sh/run_mistral.sh: adaptive) | pqcache_niah (their test_nah.py: 10 iterations)",
    )
    kmeans_iters: int | Literal["adaptive"] | None = param(
        None,
        "k-means iteration cap, or adaptive (the paper's cost model, fitted per machine on the k-means it "
        "governs); null: the protocol's (pqcache: adaptive, pqcache_niah: 10)",
        min=1,
    )
    kmeans_rules: Literal["sklearn", "fixed"] = param(
        "sklearn",
        "sklearn (the authors' scikit-learn KMeans): stop at tol 1e-4 or unchanged labels, an empty "
        "cluster takes the farthest point | fixed: exactly kmeans_iters updates, an empty cluster keeps its centroid",
    )
    kmeans_device: Literal["cpu", "model"] = param(
        "cpu",
        "cpu: host copies of the keys, clustered by CPU workers (the paper's Alg. 1) | model: batched "
        "k-means on the model's device (on a GPU, on its own stream)",
    )
    metric: Literal["l2", "ip", "cosine"] = param("l2", "k-means metric: l2 (authors' default) | ip | cosine")
    init: KMeansInit = param("random", "random points shared by all groups (authors') | kmeans++")
    gqa: GqaRule = param("softmax_sum", "group rule on approximate scores: softmax_sum (authors') | logit_sum | max")
    seed: int = param(4321, "k-means initialisation seed (the authors')")
    overlap: bool = param(True, "cluster on the workers while later layers compute (false: inside the prefill)")
    workers: int = param(
        1,
        "k-means worker threads of this method instance; a layer's KV heads x sub-spaces "
        "are split among them (the authors run h_kv*m processes)",
        min=1,
        max=512,
    )

    def validate(self) -> None:
        if (self.m is None) != (self.b is None):
            given, missing = ("m", "b") if self.m is not None else ("b", "m")
            raise ConfigError(
                f"method.{given}={getattr(self, given)} without method.{missing} (alone, it would be "
                "replaced by the comm_ratio default)",
                "set both, e.g. method.m=2 method.b=6, or neither",
            )


@register
class PQCache(RetrievalMethod):
    name = "pqcache"
    Params = PQCacheParams
    static_decode = True
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
        # per bucket width: topk_keyed's reversed iota and a zero row (the mask of the non-middle columns)
        self._bucket: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._ones: torch.Tensor | None = None  # pq_encode_static's constant column
        self._slot_parts: tuple[torch.Tensor, torch.Tensor] | None = None  # see _selection_parts

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
        self._submit_kmeans(keys, iters, {}).result()
        return time.perf_counter() - start

    def _submit_kmeans(self, keys: torch.Tensor, iters: int, options: dict[str, Any], **how: Any) -> LayerJob:
        """The workers' PQ construction of ``keys`` with this run's ``m``, ``b``, metric, seed and init, the
        one a layer's prefill runs and its cost model times; ``how``: ``ready``, ``inline``."""
        p = self.params
        return self.pool.submit(
            keys, self.m, self.b, iters=iters, metric=p.metric, seed=p.seed, init=p.init, options=options, **how
        )

    def cache_offset(self, ctx: Any) -> int:
        return ctx.budget.sink  # blocks index the middle tokens, as the reference's offloaded buffer

    def release(self) -> None:
        """The request is over (answered or failed): close this instance's k-means pool (see the
        module docstring; a failed request must not leave its queued shares running) and point each
        codebook's ``codes`` at its coded prefix."""
        if self.workers is not None:
            self.workers.shutdown()
        for state in getattr(self, "layers", {}).values():  # book.codes: the coded prefix (see _Layer)
            if state.book is not None and state.buffer is not None:
                state.book.codes = state.buffer.codes

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
        job = self._submit_kmeans(keys, iters, self.kmeans_options, ready=ready, inline=not self.params.overlap)
        state = _Layer(job)
        state.coded_end = kv.n
        state.iterations = iters
        self.layers[layer] = state

    def _codebook(self, layer: int, kv: LayerKV) -> _Layer:
        """``layer``'s state with its codebook: waited for once (the k-means may still run on the workers),
        then kept on the compute device, with a code buffer that has a row for every slot ``kv`` can
        hold and the static step's constants."""
        state = self.layers[layer]
        if state.book is None:
            start = time.perf_counter()
            book, seconds = state.job.result()
            self.timers["wait_kmeans_s"] += time.perf_counter() - start
            self.timers["kmeans_s"] += seconds
            self.updates.append(book.iterations)
            device = torch.device(self.ctx.spec.device)
            codes = book.codes.to(kv.home)
            # host codes on CUDA are pinned (copied to the device asynchronously)
            pin = device.type == "cuda" and codes.device.type == "cpu"
            spare = kv.capacity - self.ctx.budget.sink - codes.shape[1]
            state.buffer = CodeBuffer(codes, spare=spare, pin=pin)
            state.book = dataclasses.replace(
                book,
                centroids=book.centroids.to(device),
                codes=state.buffer.codes,
                phi=None if book.phi is None else book.phi.to(device),
                extra=None if book.extra is None else book.extra.to(device),
            )
            centroids = state.book.centroids
            groups, m, k, sub = centroids.shape
            state.table = pq_encode_table(centroids, metric=book.metric, extra=state.book.extra)
            state.transposed = centroids.float().reshape(groups * m, k, sub).transpose(1, 2)
            state.phi = state.book.phi
            if self._ones is None:
                self._ones = torch.ones(groups * m, 1, 1, device=device)
        return state

    # ------------------------------------------------------------------ decode: the host side
    def _prepare(self, layer: int, kv: LayerKV) -> None:
        """The host side of this step for ``layer`` (the store's ``n`` counts the step's token). Once the
        budget leaves tokens out: the codebook and room for every slot; the codes of every middle token
        (tokens in ``[coded_end, middle_end)`` lack them only when several need them at once: coded here
        with one ``pq_encode`` of the range, as before); and whether the step codes the first token of the
        local window (:attr:`_Layer.encodes`: it has no code yet), the one the next step's layout moves
        into the middle — the one the earlier step coded at the next step, alone, the same way."""
        state = self.layers[layer]
        state.prepared, state.encodes = kv.n, False
        lay = self.layout(kv)
        if self.ctx.budget.select >= lay.middle:  # covering: the dense step, no codebook needed yet
            return
        self._codebook(layer, kv)
        book, buffer = state.book, state.buffer
        assert book is not None and buffer is not None
        buffer.reserve(kv.capacity - lay.sink_end)
        if lay.middle_end > state.coded_end:
            start = time.perf_counter()
            keys = kv.keys[:, state.coded_end : lay.middle_end].float().to(book.centroids.device)
            fresh = pq_encode(keys, book.centroids, metric=book.metric, phi=book.phi, extra=book.extra)
            buffer.append(fresh.to(buffer.data.device))
            state.coded_end = lay.middle_end
            self.timers["encode_s"] += time.perf_counter() - start
        if lay.middle_end == state.coded_end:  # (a prompt token in the window has its k-means code)
            state.encodes = True
            state.coded_end += 1
            buffer.n = state.coded_end - lay.sink_end

    def before_step(self, ctx: Any) -> None:
        """Every layer's host side (:meth:`_prepare`), and the constants of the step (made once, so the
        step issues no op for them): :meth:`_selection_parts` and :meth:`_bucket_constants`."""
        for layer in self.layers:
            self._prepare(layer, ctx.store[layer])
        kv = self.compressing_kv()
        self._selection_parts(kv.device)
        if kv.bucket_end > ctx.budget.sink:
            self._bucket_constants(kv.bucket_end - ctx.budget.sink, kv.device)

    def _bucket_constants(self, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reversed iota for topk_keyed, float zeros)``, ``[width]`` each, made once per bucket width."""
        key = (width, device)
        found = self._bucket.get(key)
        if found is None:
            self._bucket.clear()
            reversed_iota = torch.arange(width - 1, -1, -1, device=device)
            found = self._bucket[key] = (reversed_iota, torch.zeros(width, device=device))
        return found

    def decode_key(self) -> tuple[bool, bool]:
        """The covering regime, and whether the step codes the first token of the local window."""
        kv = self.compressing_kv()
        return self.covers(kv), any(state.encodes for state in self.layers.values())

    # ------------------------------------------------------------------ decode: the device step
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """Sinks, the top ``select`` middle tokens by PQ score and the local window (module docstring)."""
        if self.covers(kv):
            return None
        state = self.layers[layer]
        if state.prepared != kv.n:  # (the dynamic step, engine.decode=dynamic, has no before_step)
            self._prepare(layer, kv)
        spec, budget = self.ctx.spec, self.ctx.budget
        sink, width = budget.sink, kv.bucket_end - budget.sink
        assert kv.length is not None and state.transposed is not None
        # [1]: the number of middle tokens, which is also the column (and code row) of the window's first
        # token: columns j <-> slots sink + j
        middle = kv.length - (1 + budget.local + sink)
        start = time.perf_counter()
        codes = self._step_codes(layer, state, kv, width, middle)  # [kv_heads, width, m]
        if kv.offload:  # (host-side accounting, as before: the middle tokens' codes)
            kv.count_index_bytes(spec.n_kv_heads * math.ceil(self.layout(kv).middle * self.m * self.b / 8))
        q = query[0, :, 0, :].view(spec.n_kv_heads, spec.group, -1)
        scores = pq_scores_static(q, state.transposed, codes)  # [kv_heads, group, width]
        reversed_iota, zeros = self._bucket_constants(width, kv.device)
        columns = kv.iota(width)
        # -inf on the columns that are not middle tokens (the window, the current token, unheld slots), 0
        # elsewhere: added, it masks them and leaves every other score as it is
        outside = zeros.masked_fill(columns >= middle, float("-inf"))
        rule = self.params.gqa
        if rule == "softmax_sum":  # softmax over the candidates only (the authors' rule), summed over the group
            scaled = torch.add(outside, scores, alpha=spec.head_dim**-0.5)  # (the scaled scores, masked)
            grouped = prefix_group_sum(torch.softmax(scaled, dim=-1), middle, 0, columns)
        elif rule == "logit_sum":
            grouped = prefix_group_sum(scores, middle, 0, columns).add_(outside)
        else:
            grouped = scores.amax(dim=1).add_(outside)
        chosen = topk_keyed(grouped, budget.select, reversed_iota=reversed_iota, nonnegative=rule == "softmax_sum")
        zeros, offsets = self._selection_parts(kv.device)
        rows, select = chosen.shape
        slots = torch.cat([zeros, chosen, middle.expand(rows, budget.local + 1)], dim=1) + offsets
        self.timers["pq_search_s"] += time.perf_counter() - start  # (issuing the ops: eager steps only)
        return Selection(slots=slots, selected=slots[:, sink : sink + select])

    def _selection_parts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A selection's slots are ``cat([zeros, chosen column, middle]) + offsets``: the sinks, the chosen
        middle tokens and the window (``middle_end`` to the current token) in one ``cat`` and one ``add``.
        ``(zeros [kv_heads, sink], offsets [sink + select + local + 1])``, made once."""
        if self._slot_parts is None:
            budget = self.ctx.budget
            sink, local = budget.sink, budget.local
            offsets = [
                torch.arange(sink, device=device),
                torch.full((budget.select,), sink, device=device),
                torch.arange(sink, sink + local + 1, device=device),
            ]
            zeros = torch.zeros(self.ctx.spec.n_kv_heads, sink, dtype=torch.long, device=device)
            self._slot_parts = (zeros, torch.cat(offsets))
        return self._slot_parts

    def _step_codes(self, layer: int, state: _Layer, kv: LayerKV, width: int, middle: torch.Tensor) -> torch.Tensor:
        """The codes of slots ``[sink, sink + width)`` on the compute device, after the step coded the
        local window's first token when it does (slot ``sink + middle``, row ``middle``)."""
        buffer = state.buffer
        assert buffer is not None and state.table is not None
        data, device = buffer.data, kv.device
        resident = data.device == device
        codes = data[:, :width] if resident else self._device_codes(state, width, device)  # (sub-space major)
        if state.encodes:
            start = time.perf_counter()
            row = middle if resident else middle.to(data.device)  # (offload on a GPU: a host read, allowed)
            keys, _ = kv.bucket()
            key = keys[:, self.ctx.budget.sink :].index_select(1, row)  # [kv_heads, 1, d]
            if not resident:
                key = key.to(device)
            fresh = pq_encode_static(key, state.table, self.m, phi=state.phi, ones=self._ones).to(data.dtype)
            data.index_copy_(1, row, fresh if resident else fresh.to(data.device))
            if not resident:
                codes.index_copy_(1, middle, fresh)
            self.timers["encode_s"] += time.perf_counter() - start  # (issuing the ops: eager steps only)
        self._prefetch_next(layer, width)
        return codes

    def _device_codes(self, state: _Layer, width: int, device: torch.device) -> torch.Tensor:
        """A host-tier layer's codes of ``width`` rows on the device (``[kv_heads, width, m]``, a view of
        sub-space major memory): the copy prefetched during the previous layer (CUDA side stream), else a
        direct copy."""
        assert state.buffer is not None
        prefetched, event = state.prefetched, state.event
        state.prefetched = state.event = None
        if prefetched is not None and prefetched.shape[2] == width:
            torch.cuda.current_stream(device).wait_event(event)
            return prefetched.transpose(1, 2)
        return state.buffer.by_subspace[:, :, :width].to(device).transpose(1, 2)

    def _prefetch_next(self, layer: int, width: int) -> None:
        """While this layer computes, copy the next layer's codes to the device on a side stream
        (PQCache Alg. 2; host-tier codes on CUDA only)."""
        following = self.layers.get(layer + 1)
        if following is None or following.book is None or following.buffer is None:
            return
        book, buffer = following.book, following.buffer
        if book.centroids.device.type != "cuda" or buffer.data.device == book.centroids.device:
            return
        device = book.centroids.device
        if not hasattr(self, "_stream"):
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            following.prefetched = buffer.by_subspace[:, :, :width].to(device, non_blocking=True)
            following.event = torch.cuda.Event()
            following.event.record(self._stream)

    def snapshot(self) -> dict[int, int]:
        """Where each layer's codes end (decode codes new tokens; the codebook itself never changes). Host
        numbers suffice: a later step writes only rows from there on."""
        return {layer: state.coded_end for layer, state in self.layers.items()}

    def restore(self, state: dict[int, int]) -> None:
        sink = self.ctx.budget.sink
        for layer, coded_end in state.items():
            current = self.layers[layer]
            current.coded_end = coded_end
            current.prepared, current.encodes = -1, False  # (the next step's host side runs again)
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
