"""Batched k-means over many independent problems at once (PQ sub-spaces, KV heads, layers).

PQCache clusters every (layer, KV head, sub-space) separately and ClusterKV every KV head; solving
them one by one wastes the batch dimension. Here ``x`` is ``[P, n, d]`` — ``P`` independent problems
of ``n`` points — and every step is one batched tensor op, the same code on CPU and CUDA.

Metrics
  * ``"l2"``: Lloyd's algorithm on squared Euclidean distance (PQCache's default, raw key sub-vectors).
  * ``"cosine"``: assignment to the centroid of largest cosine similarity; the centroid is the plain
    mean of the assigned *raw* vectors, never renormalised (ClusterKV's rule — not spherical k-means).
  * ``"ip"``: PQCache's ``METRIC="ip"`` option, the usual inner-product→L2 reduction: every point
    gets one extra coordinate ``sqrt(φ − ‖x‖²)``, ``φ`` the largest squared norm of the problem's
    points, so all augmented points have norm ``sqrt(φ)``; L2 k-means then runs in ``d + 1``
    dimensions. ``centroids`` drop the extra coordinate (a query appended with 0 scores a centroid by
    ``q·c`` alone); it is kept in ``KMeansResult.extra`` with ``phi`` so a new point can be coded in the
    same augmented space (``assign(..., phi=, extra=)``; a point longer than ``sqrt(φ)`` gets 0).

Initialisation
  * ``"random"``: ``k`` distinct random points (seeded CPU generator, so CPU and CUDA agree).
    ``shared_init=True`` uses the same point indices for every problem, as both papers' code does.
    With fewer (valid) points than clusters every point is used once and the list wraps around, so
    some centroids start as duplicates; ties go to the lowest centroid index, so duplicates stay
    empty (``k`` is never clipped: shapes stay batchable).
  * ``"kmeans++"``: D²-weighted seeding (RAFT's default, which ClusterKV's accuracy code uses).
  * ``"given"``: start from ``init_centroids`` ``[P, k, d]``.

Iterations and stopping, per problem
  Each problem runs at most ``iters`` centroid updates (each after one assignment) and stops earlier
  on its own when asked; the problems still running are the only ones computed. A final assignment
  always follows the last update, so ``labels`` match the returned ``centroids``.
  * ``stop_when_stable``: stop once an assignment changes no (valid) label — ClusterKV's "until
    convergence", capped; the centroids are then a fixed point and no further update is run.
  * ``tol`` > 0: scikit-learn's tolerance. After an update, stop (after one final assignment) when
    ``Σ_c ‖c_new − c_old‖² ≤ tol · mean_j var(x_j)``, the variance per coordinate over the problem's
    valid points, in the working space (``d + 1`` coordinates for ``ip``).
  ``iterations`` is the largest number of updates any problem ran, ``updates`` the count per problem.

Empty clusters (``empty``)
  * ``"keep"``: an empty cluster keeps its previous centroid (ClusterKV's rule).
  * ``"relocate"``: scikit-learn's rule (``_relocate_empty_clusters_dense``). After an assignment, the
    ``e`` empty clusters of a problem take its ``e`` points farthest from their own (old) centroid: the
    farthest point goes to the lowest-numbered empty cluster, and so on. Each point leaves its old
    cluster's sum and becomes the new centroid on its own; labels are not changed (the next
    assignment moves the point). Nothing is relocated when every point sits on its centroid (fewer
    distinct points than clusters), and a cluster that is still empty keeps its previous centroid.
    scikit-learn 1.9 differs in two details: it pairs the ``e`` farthest points with the empty
    clusters in ``argpartition`` order (the same set of points; the order is unspecified for
    ``e ≥ 2``), and it moves a still-empty cluster onto the largest one. (Distances here come from the
    assignment's ``‖x‖² − 2x·c + ‖c‖²``; for ``cosine`` the distance is ``1 − cos``.)
  ``SKLEARN`` holds the options that make this scikit-learn's ``KMeans(algorithm="lloyd", n_init=1,
  tol=1e-4)`` from the same initial centroids (PQCache's reference clustering). Its ``n_iter_`` counts
  one iteration more than ``updates`` when it stops on unchanged labels (it runs the no-op update).
  faiss (``faiss_backend``) instead splits the largest cluster into an empty one and never stops early.

faiss as the CPU default? No user's semantics allow it, so this implementation is the default on
  CPU and CUDA and ``faiss_backend`` stays an oracle and a yardstick (``kvbench bench kmeans_faiss``).
  PQCache clusters with scikit-learn's rules (``SKLEARN``: tolerance stop, relocation of empty
  clusters onto the farthest points) or, with ``kmeans_rules`` otherwise, a fixed schedule that keeps
  empty centroids; ClusterKV keeps empty centroids and stops once no label changes. faiss has no
  early stop and splits the largest cluster into an empty one: neither rule. Speed does not call for
  it either: with oneDNN scoring, one thread, the bench's problems (one Llama-3.1-8B layer's PQ
  construction, 10 iterations, the codes included) ran at 0.81-0.95x faiss-cpu's time for m×b = 2×6
  and 0.94-1.11x for 4×8 (d = 32, k = 256, where faiss uses its fused distance + argmin kernel) over
  three runs on the shared, loaded 2-core machine (before oneDNN and shares: 1.09-1.12x and
  1.54-1.56x); with 2 threads, faiss's OpenMP barriers made it 3-48x slower than its own
  single-threaded run while the shares took 0.8-1.8x of theirs.

Speed (CPU)
  An assignment step is one GEMM: the points carry a trailing 1 and the centroids ``[c, −‖c‖²/2]``,
  so the product is ``x·c − ‖c‖²/2`` (largest = nearest) without a separate bias pass. The scores
  are laid out ``[g, k, chunk]`` and reduced over ``k`` by ``max_pool2d`` on a channels-last view,
  whose CPU kernel keeps the running maximum and its index in vector registers (``Tensor.min(dim)``
  scans one row at a time: 4-10x slower, as costly as the GEMM). A step covers ``chunk`` points
  (up to ``CPU_CHUNK``) of ``g`` problems (``group_size``), ``CPU_DISTANCE_BUDGET`` scores (4 MiB)
  in all, so the block is still in cache when the reduction reads it, and the GEMMs are large
  enough for MKL to run near its peak (with several threads, 4x larger steps: fewer barriers).
  Centroid sums use ``index_put_`` with ``accumulate=True`` straight from the chunk (``index_add_``
  dispatches one op per row on CPU; ``scatter_add_`` is 3x slower). The float32 working copy (points,
  ``ip`` coordinate, trailing 1) is built once when it fits ``WORK_CACHE_BYTES``. Profile of the
  earlier version (one [P, chunk, k] ``baddbmm`` + ``min`` per 64 MiB chunk, ``scatter_add_`` sums):
  ``min`` 30 %, the broadcast copy of ``‖c‖²`` into the block 25-40 %, ``baddbmm`` 20 %,
  ``scatter_add_`` 7-25 %. Now the GEMM is 55-65 % of the time. On CUDA the reduction is
  ``Tensor.max(dim=1)`` and a step covers all problems with up to ``DISTANCE_BUDGET`` scores.
  The GEMM: ``bmm`` calls MKL's SGEMM, which on AMD CPUs runs its AVX2 kernels; oneDNN's fp32
  ``linear`` (``mkldnn._linear_pointwise``) uses AVX-512 where the CPU has it. On the AMD Zen 5 test
  machine one [256, 33]×[33, 4096] product took 0.28 ms with oneDNN, 0.61 ms with ``bmm`` (same
  bits), so a step of at least ``ONEDNN_MIN_PRODUCTS`` multiply-adds calls oneDNN once per problem
  (it has no batched fp32 product that keeps fp32 precision). Profile after that, one thread, 32
  problems of 8192 points into 256 clusters (d = 32): GEMM 55-67 %, ``max_pool2d`` 8-13 %,
  ``index_put_`` 8-20 %.
  Threads: with ``t = torch.get_num_threads() > 1`` and several problems, the problems are split into
  ``min(t, P)`` contiguous shares, each clustered by a single-threaded call on its own thread (torch
  releases the GIL in its kernels), from the initial centroids the whole batch drew; every rule is
  per problem, so the result is the single-threaded one bit for bit. The problems are independent, so
  a thread never waits for another until the end, where intra-op threading (OpenMP, MKL) puts a
  barrier in every op, a few hundred per call: on the 2-core machine shared with other busy
  processes, 16 problems of 8192 points into 64 clusters took 1.66 s with 2 OpenMP threads, 0.40 s
  in 2 shares and 0.21 s on one thread (faiss with 2 threads: 2.4 s). A single problem (or CUDA)
  runs as one batched call over all intra-op threads, whose steps are then ``CPU_PARALLEL_SCALE``
  times larger (fewer barriers). Side effect: ``torch.set_num_threads(1)`` in a share's thread also
  sets the process-wide count that threads starting their first parallel op read; it is put back
  when the call returns (threads already running keep their own count).

Memory: the input is read in chunks of ``chunk`` points (default ``default_chunk``); at most
``g × chunk × k`` float32 scores and one float32 copy of a chunk exist at a time (or the whole
working copy, when it fits ``WORK_CACHE_BYTES``), plus a few float32 values per point (norms;
distances with ``empty="relocate"``), so a large fp16 input is never converted as a whole. Scores are
float32 whatever the input dtype; centroids are float32.
Ties in the assignment go to the lowest centroid index (both reductions keep the first maximum).
Determinism: on CPU a call is bitwise reproducible (``index_put_`` accumulates serially); on CUDA sums
are atomic adds (``ATOMIC_SUMS``) and may differ in the last bits between runs. Host reads:
``stop_when_stable`` and ``tol`` read one flag per problem per iteration, ``empty="relocate"`` the
number of empty clusters; nothing else is read back (on CUDA ``bincount`` would read each step's
label range: hence ``ATOMIC_SUMS``).

Layout: this module is the face — the options, the tunables above (read when a call starts, so tests
and tools/profile_kmeans.py may set them), the step sizes and the driver (:func:`kmeans`: initial
centroids, shares over threads, the sweep-and-update loop with its per-problem stops).
:mod:`~kvbench.methods.primitives.kmeans_sweep` is the mechanism (working space, GEMM assignment,
sweeps, relocation, means) and :mod:`~kvbench.methods.primitives.kmeans_init` the initialisations.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvbench.methods.primitives.kmeans_init import _gather_rows, _kmeans_plus_plus_rows, _random_rows
from kvbench.methods.primitives.kmeans_sweep import (
    _augment_centroids,
    _best,
    _means,
    _onednn_linear,
    _phi,
    _pick,
    _Points,
    _relocate,
    _rows,
    _Sweep,
    _sweep,
    _table,
)

__all__ = [  # (and _best, _onednn_linear, _Points: the tests and the kmeans_faiss benchmark read them here)
    "INITS",
    "METRICS",
    "SKLEARN",
    "KMeansResult",
    "_Points",
    "_best",
    "_onednn_linear",
    "assign",
    "default_chunk",
    "finish",
    "group_size",
    "initial_rows",
    "ip_augment",
    "kmeans",
]

METRICS = ("l2", "cosine", "ip")
INITS = ("random", "kmeans++", "given")
EMPTY_RULES = ("keep", "relocate")

# scikit-learn's KMeans(algorithm="lloyd", tol=1e-4) semantics (PQCache's reference clustering).
SKLEARN = {"stop_when_stable": True, "tol": 1e-4, "empty": "relocate"}

# float32 scores in flight in one assignment step: 256 MiB on CUDA (over all problems), 4 MiB on CPU
# (a block that stays in the L2/L3 cache between the GEMM that writes it and the reduction that reads
# it is ~3x faster than one that streams through memory). On CPU a step covers up to CPU_CHUNK points
# of as many problems as fit: MKL's GEMM is ~1.4x faster on one [256, 4096] block than on 32 [256, 128].
# With several threads, steps are 4x larger (16 MiB, still within the L3 cache): every step costs a
# few thread barriers, and on a CPU shared with other busy processes a barrier can wait for a whole
# scheduler slice (measured on the 2-core machine under load: 12 s with 4 MiB steps vs 36 s).
DISTANCE_BUDGET = 1 << 26
CPU_DISTANCE_BUDGET = 1 << 20
CPU_CHUNK = 4096
CPU_PARALLEL_SCALE = 4
MIN_CHUNK = 128
# Products (k × points × (D + 1) multiply-adds) from which a CPU step uses oneDNN, one call per
# problem (~10 µs of overhead per call; below this, one batched MKL ``bmm``).
ONEDNN_MIN_PRODUCTS = 1 << 21
# The working copy of the points (float32, with the bias column) is built once when it is at most this
# large, instead of being refilled chunk by chunk in every sweep.
WORK_CACHE_BYTES = 1 << 28
# On CUDA the working copy is kept up to 1 GiB (ClusterKV's 8 heads x 128k keys of 129 float32 columns:
# 541 MB). With this and 256 MiB steps (DISTANCE_BUDGET), one 128k-token ClusterKV layer clustered
# 1.67x faster on an H200 than with 256 MiB and 64 MiB: fewer, larger steps (tools/profile_kmeans.py,
# RESULTS.md §9c).
CUDA_WORK_CACHE_BYTES = 1 << 30
# How a sweep adds up the clusters' point counts and coordinate sums. ``None`` (the default): atomic
# ``index_add_`` on CUDA, where ``bincount`` reads the labels' range back to the host twice per step
# and ``index_put_(accumulate=True)`` sorts every step's indices first; ``bincount`` and the serial,
# bitwise reproducible ``index_put_`` on CPU, where ``index_add_`` runs one op per row. ``True`` or
# ``False`` forces one path on every device (tests compare them; tools/profile_kmeans.py times both).
ATOMIC_SUMS: bool | None = None


@dataclass
class KMeansResult:
    centroids: Tensor  # [P, k, d] float32
    labels: Tensor  # [P, n] int64 (nearest centroid; computed for invalid points too)
    iterations: int  # centroid updates run: the most over the problems
    inertia: Tensor  # [P] float32: Σ over valid points of ‖x − c‖² (l2; augmented space for ip) or 1 − cos
    counts: Tensor  # [P, k] int64: valid points per cluster under ``labels``
    phi: Tensor | None = None  # [P] (ip only): the squared-norm bound of the augmentation
    extra: Tensor | None = None  # [P, k] (ip only): the centroids' augmented coordinate
    updates: Tensor | None = None  # [P] int64: centroid updates each problem ran


def _on_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _atomic_sums(device: torch.device) -> bool:
    """Whether sweeps on ``device`` accumulate with atomic ``index_add_`` (see ``ATOMIC_SUMS``)."""
    return device.type == "cuda" if ATOMIC_SUMS is None else ATOMIC_SUMS


def _cpu_step() -> tuple[int, int]:
    """(scores, points per problem) of one CPU step: ``CPU_DISTANCE_BUDGET`` and ``CPU_CHUNK`` on one
    thread, ``CPU_PARALLEL_SCALE`` times both on several (see the constants)."""
    scale = 1 if torch.get_num_threads() == 1 else CPU_PARALLEL_SCALE
    return CPU_DISTANCE_BUDGET * scale, CPU_CHUNK * scale


def default_chunk(problems: int, k: int, n: int | None = None, device: torch.device | str | None = None) -> int:
    """Points of each problem per assignment step (``MIN_CHUNK`` at least). CUDA: all problems at
    once within ``DISTANCE_BUDGET`` scores (P=16, k=64: 65536 points, 256 MiB of scores plus one
    256 MiB float32 chunk). CPU, one thread: ``CPU_DISTANCE_BUDGET // k`` points, at most
    ``CPU_CHUNK``, of ``group_size`` problems at a time (larger with several threads)."""
    if _on_cuda(device):
        rows = max(MIN_CHUNK, DISTANCE_BUDGET // max(1, problems * k))
    else:
        budget, most = _cpu_step()
        rows = max(MIN_CHUNK, min(most, budget // max(1, k)))
    return rows if n is None else max(1, min(rows, n))


def group_size(problems: int, k: int, step: int, device: torch.device | str | None = None) -> int:
    """Problems per assignment step: all on CUDA, as many as the CPU step's score budget allows."""
    if _on_cuda(device):
        return problems
    return max(1, min(problems, _cpu_step()[0] // max(1, k * step)))


def _points(x: Tensor, metric: str, phi: Tensor | None, step: int, group: int) -> _Points:
    """The sweeps' view of ``x``, its working copy kept whole up to ``WORK_CACHE_BYTES``
    (``CUDA_WORK_CACHE_BYTES`` on CUDA), as this module's settings are when it is called."""
    cache_bytes = CUDA_WORK_CACHE_BYTES if x.is_cuda else WORK_CACHE_BYTES
    return _Points(x, metric, phi, step, group, cache_bytes)


def _tuned_sweep(
    points: _Points, table: Tensor, rows: Tensor | None, labels: Tensor, valid: Tensor | None, **options: bool
) -> _Sweep:
    """:func:`~kvbench.methods.primitives.kmeans_sweep._sweep` with this module's ``ATOMIC_SUMS`` and
    ``ONEDNN_MIN_PRODUCTS`` as they are when it is called (tests and tools/profile_kmeans.py set them)."""
    atomic = _atomic_sums(table.device)
    return _sweep(points, table, rows, labels, valid, atomic=atomic, onednn_min=ONEDNN_MIN_PRODUCTS, **options)


def _result(
    centroids: Tensor,
    d: int,
    labels: Tensor,
    iterations: int,
    inertia: Tensor,
    counts: Tensor,
    phi: Tensor | None,
    updates: Tensor,
) -> KMeansResult:
    """The result from working-space ``centroids`` ``[P, k, D]``: their first ``d`` coordinates, and
    for ``ip`` the augmented one as ``extra``."""
    return KMeansResult(
        centroids=centroids[..., :d].contiguous(),
        labels=labels,
        iterations=iterations,
        inertia=inertia,
        counts=counts,
        phi=phi,
        extra=None if phi is None else centroids[..., d].contiguous(),
        updates=updates,
    )


# ----------------------------------------------------------------------------- working space, initialisation
def ip_augment(x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The whole problem in the ``ip`` working space: float32 points ``[P, n, d + 1]`` and ``φ`` ``[P]``
    (for backends that need the augmented data materialised, e.g. faiss)."""
    phi = _phi(x, valid, default_chunk(x.shape[0], 1, x.shape[1]))
    return _rows(x, 0, x.shape[1], phi), phi


def initial_rows(
    x: Tensor,
    k: int,
    *,
    init: str = "random",
    metric: str = "l2",
    seed: int = 0,
    shared_init: bool = True,
    valid: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """The point indices ``[P, k]`` that ``kmeans`` starts from for ``init`` "random" or "kmeans++"
    (shared with the faiss backend so both start from the same centroids)."""
    problems, n, _ = x.shape
    if init == "random":
        return _random_rows(problems, n, k, seed, shared_init, valid, x.device)
    if init == "kmeans++":
        step = chunk or default_chunk(problems, 1, n)
        phi = _phi(x, valid, step) if metric == "ip" else None
        inner = "l2" if metric == "ip" else metric
        return _kmeans_plus_plus_rows(x, k, seed, shared_init, valid, inner, phi, step)
    raise ValueError(f"initial_rows handles init 'random' or 'kmeans++', not {init!r}")


# ----------------------------------------------------------------------------- public API


def _check(x: Tensor, metric: str, valid: Tensor | None) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown k-means metric {metric!r}; use one of {METRICS}")
    if x.dim() != 3 or x.shape[1] == 0 or x.shape[2] == 0:
        raise ValueError(f"k-means expects points [P, n, d] with n, d > 0, got {tuple(x.shape)}")
    if valid is not None and (valid.shape != x.shape[:2] or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a bool tensor {tuple(x.shape[:2])}, got {valid.dtype} {tuple(valid.shape)}")


def _label(
    x: Tensor, centroids: Tensor, metric: str, phi: Tensor | None, chunk: int | None, valid: Tensor | None
) -> tuple[Tensor, _Sweep]:
    """One assignment of every point to working-space ``centroids`` ``[P, k, D]`` (no update)."""
    problems, n, _ = x.shape
    step = chunk or default_chunk(problems, centroids.shape[1], n, x.device)
    inner = "l2" if metric == "ip" else metric
    labels = torch.empty(problems, n, dtype=torch.long, device=x.device)
    points = _points(x, inner, phi, step, group_size(problems, centroids.shape[1], step, x.device))
    sweep = _tuned_sweep(points, _table(centroids, inner), None, labels, valid, accumulate=False, compare=False)
    return labels, sweep


def assign(
    x: Tensor,
    centroids: Tensor,
    metric: str = "l2",
    chunk: int | None = None,
    *,
    phi: Tensor | None = None,
    extra: Tensor | None = None,
) -> Tensor:
    """Nearest centroid ``[P, n]`` (int64) of every point of ``x`` ``[P, n, d]`` among ``centroids``
    ``[P, k, d]`` — how a token is coded after the clustering (e.g. leaving the local window).

    ``metric="ip"`` needs the ``phi`` ``[P]`` and ``extra`` ``[P, k]`` of the ``KMeansResult``: the point
    is augmented with ``sqrt(max(φ − ‖x‖², 0))`` and matched by L2 in the augmented space."""
    _check(x, metric, None)
    problems, n, d = x.shape
    if centroids.dim() != 3 or centroids.shape[0] != problems or centroids.shape[2] != d:
        raise ValueError(f"centroids {tuple(centroids.shape)} do not fit points {tuple(x.shape)}")
    cent = centroids.to(device=x.device, dtype=torch.float32)
    if metric == "ip":
        if phi is None or extra is None:
            raise ValueError("assign(metric='ip') needs phi and extra from the KMeansResult")
        cent = torch.cat([cent, extra.float()[..., None]], dim=-1)
        phi = phi.float()
    else:
        phi = None
    return _label(x, cent, metric, phi, chunk, None)[0]


def kmeans(
    x: Tensor,
    k: int,
    *,
    iters: int,
    metric: str = "l2",
    seed: int = 0,
    init: str = "random",
    init_centroids: Tensor | None = None,
    shared_init: bool = True,
    stop_when_stable: bool = False,
    tol: float = 0.0,
    empty: str = "keep",
    chunk: int | None = None,
    valid: Tensor | None = None,
) -> KMeansResult:
    """Cluster each of the ``P`` problems of ``x`` ``[P, n, d]`` into ``k`` clusters, all batched.

    ``valid`` ``[P, n]`` (bool) marks the points that count, for ragged problems padded to one ``n``:
    invalid points are never initial centroids, never move a centroid and add nothing to the inertia,
    but they still get a label (their nearest centroid). Stopping (``stop_when_stable``, ``tol``) and
    the empty-cluster rule (``empty``) are per problem, see the module notes; ``**SKLEARN`` gives
    scikit-learn's semantics."""
    _check(x, metric, valid)
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    if init not in INITS:
        raise ValueError(f"unknown k-means init {init!r}; use one of {INITS}")
    if empty not in EMPTY_RULES:
        raise ValueError(f"unknown empty-cluster rule {empty!r}; use one of {EMPTY_RULES}")
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    problems, n, d = x.shape
    device = x.device
    step = chunk or default_chunk(problems, k, n, device)

    if init == "given":
        if init_centroids is None or init_centroids.shape != (problems, k, d):
            shape = None if init_centroids is None else tuple(init_centroids.shape)
            raise ValueError(f"init='given' needs init_centroids of shape {(problems, k, d)}, got {shape}")
        centroids = init_centroids.to(device=device, dtype=torch.float32, copy=True)
    else:
        index = initial_rows(
            x, k, init=init, metric=metric, seed=seed, shared_init=shared_init, valid=valid, chunk=step
        )
        centroids = _gather_rows(x, index)
    workers = _share_workers(problems, device)
    options: dict[str, Any] = {
        "iters": iters,
        "metric": metric,
        "stop_when_stable": stop_when_stable,
        "tol": tol,
        "empty": empty,
    }
    if workers > 1:
        return _kmeans_shares(x, centroids, valid, chunk, workers, options)
    return _lloyd(x, centroids, valid, step, **options)


def _lloyd(
    x: Tensor,
    centroids: Tensor,
    valid: Tensor | None,
    step: int,
    *,
    iters: int,
    metric: str,
    stop_when_stable: bool,
    tol: float,
    empty: str,
) -> KMeansResult:
    """:func:`kmeans` on the calling thread from the initial ``centroids`` ``[P, k, d]`` (float32, updated
    in place): sweeps and updates until every problem has stopped (see the module notes)."""
    problems, n, d = x.shape
    k, device = centroids.shape[1], x.device
    phi = _phi(x, valid, step) if metric == "ip" else None
    inner = "l2" if metric == "ip" else metric
    if phi is not None:
        centroids = _augment_centroids(centroids, phi)  # for initial rows: the augmented points themselves

    points = _points(x, inner, phi, step, group_size(problems, k, step, device))
    threshold = tol * points.mean_variance(valid) if tol > 0 else None
    # With a data-dependent stop each problem leaves the batch on its own (host reads per iteration);
    # otherwise all problems run the same schedule and nothing is read back.
    adaptive = stop_when_stable or threshold is not None
    labels = torch.zeros(problems, n, dtype=torch.long, device=device)
    updates = torch.zeros(problems, dtype=torch.long, device=device)
    inertia = torch.zeros(problems, dtype=torch.float32, device=device)
    counts = torch.zeros(problems, k, dtype=torch.long, device=device)
    last = torch.full((problems,), iters == 0, dtype=torch.bool, device=device)  # next sweep is final
    rows: Tensor | None = None  # the problems still running (None: all)
    sweeps = 0
    while True:
        current = _pick(rows, centroids)
        final = _pick(rows, last)
        # On a fixed schedule only the final sweep's distances (the inertia) are needed.
        sweep = _tuned_sweep(
            points,
            _table(current, inner),
            rows,
            labels,
            valid,
            accumulate=sweeps < iters,
            compare=stop_when_stable and sweeps > 0,
            measure=adaptive or sweeps >= iters,
            keep_distance=empty == "relocate" and sweeps < iters,
        )
        sweeps += 1
        done = final if sweep.changed is None else final | ~sweep.changed
        if rows is None:
            inertia = torch.where(done, sweep.inertia, inertia)
            counts = torch.where(done[:, None], sweep.counts, counts)
        else:
            inertia[rows] = torch.where(done, sweep.inertia, inertia[rows])
            counts[rows] = torch.where(done[:, None], sweep.counts, counts[rows])
        if bool(done.all()) if adaptive else sweeps > iters:
            break
        if empty == "relocate":
            _relocate(sweep, points, rows, labels)
        assert sweep.sums is not None  # an update follows every sweep but the final one, which accumulates
        moved = _means(sweep.sums, sweep.counts, current)
        going = ~done
        finished_now = _pick(rows, updates) + 1 >= iters
        if threshold is not None:
            shift = (moved - current).square().sum(dim=(1, 2))
            finished_now = finished_now | (shift <= _pick(rows, threshold))
        index = torch.arange(problems, device=device) if rows is None else rows
        if adaptive:
            keep = going.nonzero().squeeze(1)
            index, moved, finished_now = index[keep], moved[keep], finished_now[keep]
            rows = index
        centroids[index] = moved
        updates[index] += 1
        last[index] = finished_now

    return _result(centroids, d, labels, int(updates.max()) if adaptive else iters, inertia, counts, phi, updates)


def _share_workers(problems: int, device: torch.device) -> int:
    """Threads that cluster contiguous shares of the problems at once (1: one batched call on the
    calling thread): on CPU, ``torch.get_num_threads()`` of them, at most one per problem."""
    if device.type != "cpu" or problems < 2:
        return 1
    return min(problems, torch.get_num_threads())


def _kmeans_shares(
    x: Tensor, centroids: Tensor, valid: Tensor | None, chunk: int | None, workers: int, options: dict[str, Any]
) -> KMeansResult:
    """``kmeans`` on CPU with several threads: the problems are split into ``workers`` contiguous
    shares, each clustered by a single-threaded ``kmeans`` call (from the initial ``centroids`` the
    whole batch drew) on its own thread, and the results are concatenated. Every rule is per problem,
    so the result is the single-threaded result, bit for bit. See "Threads" in the module notes."""
    problems = x.shape[0]
    bounds = [problems * w // workers for w in range(workers + 1)]
    shares = [slice(bounds[w], bounds[w + 1]) for w in range(workers)]
    caller_threads = torch.get_num_threads()

    def run(share: slice) -> KMeansResult:
        torch.set_num_threads(1)  # this worker thread's intra-op pool (and MKL's)
        return kmeans(
            x[share],
            centroids.shape[1],
            init="given",
            init_centroids=centroids[share],
            chunk=chunk,
            valid=None if valid is None else valid[share],
            **options,
        )

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvbench-kmeans-share") as pool:
            parts = list(pool.map(run, shares))
    finally:
        # torch.set_num_threads also sets the process-wide count that threads not yet started read;
        # put back the caller's (the caller's own setting is per thread and was never changed).
        torch.set_num_threads(caller_threads)

    def cat(field: str) -> Tensor | None:
        values = [getattr(part, field) for part in parts]
        return None if values[0] is None else torch.cat(values)

    return KMeansResult(
        centroids=torch.cat([part.centroids for part in parts]),
        labels=torch.cat([part.labels for part in parts]),
        iterations=max(part.iterations for part in parts),
        inertia=torch.cat([part.inertia for part in parts]),
        counts=torch.cat([part.counts for part in parts]),
        phi=cat("phi"),
        extra=cat("extra"),
        updates=cat("updates"),
    )


def finish(
    x: Tensor,
    centroids: Tensor,
    *,
    metric: str,
    iterations: int,
    valid: Tensor | None = None,
    chunk: int | None = None,
) -> KMeansResult:
    """A ``KMeansResult`` for centroids found elsewhere (the faiss backend): one final assignment with
    this module's rules. For ``ip`` the centroids carry the augmented coordinate (``[P, k, d + 1]``)."""
    problems, n, d = x.shape
    step = chunk or default_chunk(problems, centroids.shape[1], n, x.device)
    phi = _phi(x, valid, step) if metric == "ip" else None
    cent = centroids.to(device=x.device, dtype=torch.float32)
    labels, sweep = _label(x, cent, metric, phi, chunk, valid)
    updates = torch.full((problems,), iterations, dtype=torch.long, device=x.device)
    return _result(cent, d, labels, iterations, sweep.inertia, sweep.counts, phi, updates)
