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
    empty and keep their value (``k`` is never clipped: shapes stay batchable).
  * ``"kmeans++"``: D²-weighted seeding (RAFT's default, which ClusterKV's accuracy code uses).
  * ``"given"``: start from ``init_centroids`` ``[P, k, d]``.

Iterations: ``iters`` centroid updates (each after one assignment), or fewer with
``stop_when_stable`` once an assignment changes no label (ClusterKV's "until convergence", capped).
A final assignment always follows the last update, so ``labels`` match the returned ``centroids``.
An empty cluster keeps its previous centroid (ClusterKV's rule; scikit-learn and faiss relocate it).

Memory: the input is read in chunks of ``chunk`` points (default ``default_chunk``); at most
``P × chunk × k`` float32 distances and one float32 copy of a chunk exist at a time, so an fp16 input
is never converted as a whole. Distances are float32 whatever the input dtype; centroids are float32.
The default budget is 64 MiB of distances per step (``MIN_CHUNK`` points at least).
Ties in the assignment go to the lowest centroid index (``torch.min``/``max`` return the first).
Determinism: on CPU a call is bitwise reproducible; on CUDA ``scatter_add_`` sums in atomic order, so
centroids may differ in the last bits between runs. Only ``stop_when_stable`` reads a value back to
the host (one flag per iteration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

METRICS = ("l2", "cosine", "ip")
INITS = ("random", "kmeans++", "given")

# float32 distances in flight in one assignment step, over all problems (64 MiB).
DISTANCE_BUDGET = 1 << 24
MIN_CHUNK = 128


@dataclass
class KMeansResult:
    centroids: Tensor  # [P, k, d] float32
    labels: Tensor  # [P, n] int64 (nearest centroid; computed for invalid points too)
    iterations: int  # centroid updates actually run
    inertia: Tensor  # [P] float32: Σ over valid points of ‖x − c‖² (l2; augmented space for ip) or 1 − cos
    counts: Tensor  # [P, k] int64: valid points per cluster under ``labels``
    phi: Tensor | None = None  # [P] (ip only): the squared-norm bound of the augmentation
    extra: Tensor | None = None  # [P, k] (ip only): the centroids' augmented coordinate


def default_chunk(problems: int, k: int, n: int | None = None) -> int:
    """Points per assignment step: ``DISTANCE_BUDGET`` float32 distances over all problems.

    P=16, k=64 gives 16384 points per step: 64 MiB of distances plus one 64 MiB float32 chunk."""
    rows = max(MIN_CHUNK, DISTANCE_BUDGET // max(1, problems * k))
    return rows if n is None else max(1, min(rows, n))


# ----------------------------------------------------------------------------- working space


def _rows(x: Tensor, start: int, stop: int, phi: Tensor | None) -> Tensor:
    """float32 points ``[P, stop-start, d]``, with the augmented coordinate when ``phi`` is given."""
    block = x[:, start:stop].float()
    if phi is None:
        return block
    room = (phi[:, None, None] - _sq_norm(block)[..., None]).clamp_min(0)
    return torch.cat([block, room.sqrt()], dim=-1)


def _augment_centroids(centroids: Tensor, phi: Tensor) -> Tensor:
    """Centroids in the augmented space, treating each as a point (for given initial centroids)."""
    room = (phi[:, None, None] - _sq_norm(centroids)[..., None]).clamp_min(0)
    return torch.cat([centroids, room.sqrt()], dim=-1)


def _phi(x: Tensor, valid: Tensor | None, step: int) -> Tensor:
    """Largest squared norm over each problem's valid points (0 for a problem without any)."""
    problems, n, _ = x.shape
    phi = torch.zeros(problems, dtype=torch.float32, device=x.device)
    for start in range(0, n, step):
        norms = _sq_norm(x[:, start : start + step].float())
        if valid is not None:
            norms = norms.masked_fill(~valid[:, start : start + step], 0.0)
        phi = torch.maximum(phi, norms.amax(dim=1))
    return phi


def ip_augment(x: Tensor, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The whole problem in the ``ip`` working space: float32 points ``[P, n, d + 1]`` and ``φ`` ``[P]``
    (for backends that need the augmented data materialised, e.g. faiss)."""
    phi = _phi(x, valid, default_chunk(x.shape[0], 1, x.shape[1]))
    return _rows(x, 0, x.shape[1], phi), phi


def _sq_norm(x: Tensor) -> Tensor:
    """Squared norms over the last dimension (``vector_norm`` is several times faster than a
    squared sum on CPU)."""
    return torch.linalg.vector_norm(x, dim=-1).square()


def _normalize(x: Tensor) -> Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


def _scorer(centroids: Tensor, metric: str, measure: bool) -> Callable[[Tensor], tuple[Tensor, Tensor | None]]:
    """A function mapping a float32 block ``[P, c, D]`` to (nearest centroid, distance to it — only
    when ``measure``)."""
    if metric == "cosine":
        unit_t = _normalize(centroids).transpose(1, 2)

        def nearest_cosine(block: Tensor) -> tuple[Tensor, Tensor | None]:
            similarity, index = torch.bmm(_normalize(block), unit_t).max(dim=-1)
            return index, (1.0 - similarity) if measure else None

        return nearest_cosine

    c_t = centroids.transpose(1, 2)
    c_sq = _sq_norm(centroids)[:, None, :]  # [P, 1, k]

    def nearest_l2(block: Tensor) -> tuple[Tensor, Tensor | None]:
        # ‖x‖² − 2x·c + ‖c‖²; ‖x‖² is the same for every centroid, so it joins only after the argmin.
        partial = torch.baddbmm(c_sq, block, c_t, alpha=-2.0)  # the only [P, c, k] buffer
        value, index = partial.min(dim=-1)
        return index, (value + _sq_norm(block)).clamp_min(0) if measure else None

    return nearest_l2


@dataclass
class _Sweep:
    inertia: Tensor | None  # [P], when measured
    counts: Tensor  # [P, k] int64
    sums: Tensor | None  # [P, k, D] float32, when accumulated
    changed: Tensor | None  # bool scalar, when compared


def _sweep(
    x: Tensor,
    centroids: Tensor,
    metric: str,
    phi: Tensor | None,
    step: int,
    valid: Tensor | None,
    labels: Tensor,
    *,
    accumulate: bool,
    compare: bool,
    measure: bool,
) -> _Sweep:
    """One pass over the points: assign each to its nearest centroid (written into ``labels``) and,
    in the same pass, accumulate the per-cluster sums the next update needs (``accumulate``), note
    whether any valid label changed (``compare``) and sum the distances (``measure``)."""
    problems, n, _ = x.shape
    k, width = centroids.shape[1], centroids.shape[2]
    nearest = _scorer(centroids, metric, measure)
    device = x.device
    # Bin k collects the invalid points, so they never move a centroid.
    counts = torch.zeros(problems, k + 1, dtype=torch.long, device=device)
    sums = torch.zeros(problems, k + 1, width, dtype=torch.float32, device=device) if accumulate else None
    inertia = torch.zeros(problems, dtype=torch.float32, device=device) if measure else None
    changed = torch.zeros((), dtype=torch.bool, device=device) if compare else None
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = _rows(x, start, stop, phi)
        index, distance = nearest(block)
        if compare:
            differs = index != labels[:, start:stop]
            if valid is not None:
                differs &= valid[:, start:stop]
            changed |= differs.any()
        labels[:, start:stop] = index
        if valid is not None:
            keep = valid[:, start:stop]
            index = index.masked_fill(~keep, k)
            if distance is not None:
                distance = distance.masked_fill(~keep, 0.0)
        if inertia is not None:
            inertia += distance.sum(dim=1)
        counts.scatter_add_(1, index, torch.ones_like(index))
        if sums is not None:
            sums.scatter_add_(1, index[..., None].expand(-1, -1, width), block)
    return _Sweep(
        inertia=inertia,
        counts=counts[:, :k],
        sums=None if sums is None else sums[:, :k],
        changed=changed,
    )


def _means(sums: Tensor, counts: Tensor, previous: Tensor) -> Tensor:
    """Plain arithmetic means; an empty cluster keeps its previous centroid."""
    filled = counts > 0
    means = sums / counts.clamp_min(1).to(sums.dtype)[..., None]
    return torch.where(filled[..., None], means, previous)


# ----------------------------------------------------------------------------- initialisation


def _random_rows(
    problems: int, n: int, k: int, seed: int, shared: bool, valid: Tensor | None, device: torch.device
) -> Tensor:
    """``k`` distinct random valid point indices per problem ``[P, k]``, wrapping when there are fewer."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    take = min(n, k)
    if shared:
        perm = torch.randperm(n, generator=generator)[None, :]
    else:
        perm = torch.rand(problems, n, generator=generator).argsort(dim=1)
    if valid is None:
        order = perm[:, :take].to(device).expand(problems, take)
        available = torch.full((problems,), n, dtype=torch.long, device=device)
    else:
        # Rank of every point in the random order; invalid points move behind every valid one, so an
        # all-valid mask picks exactly the rows that ``valid=None`` picks.
        rank = torch.empty_like(perm).scatter_(1, perm, torch.arange(n).expand_as(perm))
        rank = rank.to(device).expand(problems, n) + n * (~valid).long()
        order = rank.argsort(dim=1)[:, :take]
        available = valid.sum(dim=1)
    slot = torch.arange(k, device=device)[None, :] % available.clamp(1, take)[:, None]
    return torch.gather(order, 1, slot)


def _distance_to(x: Tensor, point: Tensor, metric: str, phi: Tensor | None, step: int) -> Tensor:
    """Distance ``[P, n]`` of every point to one point per problem ``point`` ``[P, D]``."""
    parts = []
    unit = _normalize(point)[:, None, :] if metric == "cosine" else None
    for start in range(0, x.shape[1], step):
        block = _rows(x, start, start + step, phi)
        if unit is not None:
            parts.append(1.0 - (_normalize(block) * unit).sum(-1))
        else:
            parts.append(_sq_norm(block - point[:, None, :]))
    return torch.cat(parts, dim=1).clamp_min(0)


def _kmeans_plus_plus_rows(
    x: Tensor, k: int, seed: int, shared: bool, valid: Tensor | None, metric: str, phi: Tensor | None, step: int
) -> Tensor:
    """D²-weighted seeding: each next centroid is a point drawn with probability proportional to its
    distance to the nearest centroid so far. Draws are inverse-CDF lookups of uniforms from a seeded
    CPU generator, so nothing syncs with the host and CPU and CUDA pick the same points; with
    ``shared`` every problem uses the same uniforms (a problem alone draws what it draws in a batch)."""
    problems, n, _ = x.shape
    device = x.device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (1, k) if shared else (problems, k)
    uniforms = torch.rand(shape, generator=generator, dtype=torch.float64).to(device).expand(problems, k)
    allowed = torch.ones(problems, n, dtype=torch.float64, device=device) if valid is None else valid.double()
    # A problem without valid points draws among all of them (its centroids are never updated anyway).
    allowed = torch.where(allowed.sum(dim=1, keepdim=True) > 0, allowed, torch.ones_like(allowed))
    weights = allowed
    nearest = torch.full((problems, n), float("inf"), dtype=torch.float32, device=device)
    rows = torch.arange(problems, device=device)
    chosen = []
    for i in range(k):
        # When every point already coincides with a centroid, fall back to a uniform draw.
        usable = torch.where(weights.sum(dim=1, keepdim=True) > 0, weights, allowed)
        cumulative = usable.cumsum(dim=1)
        target = uniforms[:, i : i + 1] * cumulative[:, -1:]
        pick = torch.searchsorted(cumulative, target, right=True)[:, 0].clamp_max(n - 1)
        chosen.append(pick)
        point = _rows(x[rows, pick][:, None, :], 0, 1, phi)[:, 0]
        nearest = torch.minimum(nearest, _distance_to(x, point, metric, phi, step))
        weights = nearest.double() * allowed
    return torch.stack(chosen, dim=1)


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


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    return torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1])).float()


# ----------------------------------------------------------------------------- public API


def _check(x: Tensor, metric: str, valid: Tensor | None) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown k-means metric {metric!r}; use one of {METRICS}")
    if x.dim() != 3 or x.shape[1] == 0 or x.shape[2] == 0:
        raise ValueError(f"k-means expects points [P, n, d] with n, d > 0, got {tuple(x.shape)}")
    if valid is not None and (valid.shape != x.shape[:2] or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a bool tensor {tuple(x.shape[:2])}, got {valid.dtype} {tuple(valid.shape)}")


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
    cent = centroids.float()
    if metric == "ip":
        if phi is None or extra is None:
            raise ValueError("assign(metric='ip') needs phi and extra from the KMeansResult")
        cent = torch.cat([cent, extra.float()[..., None]], dim=-1)
        phi = phi.float()
    else:
        phi = None
    labels = torch.empty(problems, n, dtype=torch.long, device=x.device)
    step = chunk or default_chunk(problems, cent.shape[1], n)
    _sweep(x, cent, "l2" if metric == "ip" else metric, phi, step, None, labels,
           accumulate=False, compare=False, measure=False)
    return labels


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
    chunk: int | None = None,
    valid: Tensor | None = None,
) -> KMeansResult:
    """Cluster each of the ``P`` problems of ``x`` ``[P, n, d]`` into ``k`` clusters, all batched.

    ``valid`` ``[P, n]`` (bool) marks the points that count, for ragged problems padded to one ``n``:
    invalid points are never initial centroids, never move a centroid and add nothing to the inertia,
    but they still get a label (their nearest centroid)."""
    _check(x, metric, valid)
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    if init not in INITS:
        raise ValueError(f"unknown k-means init {init!r}; use one of {INITS}")
    problems, n, d = x.shape
    step = chunk or default_chunk(problems, k, n)
    phi = _phi(x, valid, step) if metric == "ip" else None
    inner = "l2" if metric == "ip" else metric

    if init == "given":
        if init_centroids is None or init_centroids.shape != (problems, k, d):
            shape = None if init_centroids is None else tuple(init_centroids.shape)
            raise ValueError(f"init='given' needs init_centroids of shape {(problems, k, d)}, got {shape}")
        centroids = init_centroids.to(device=x.device, dtype=torch.float32, copy=True)
        if phi is not None:
            centroids = _augment_centroids(centroids, phi)
    else:
        index = initial_rows(x, k, init=init, metric=metric, seed=seed, shared_init=shared_init,
                             valid=valid, chunk=step)
        centroids = _gather_rows(x, index)
        if phi is not None:
            centroids = _augment_centroids(centroids, phi)  # == the augmented points themselves

    labels = torch.empty(problems, n, dtype=torch.long, device=x.device)
    updates = 0
    while True:
        update = updates < iters
        # Distances only matter for the inertia of the final sweep, which is either the one after
        # the last update or, with stop_when_stable, any sweep that finds no change.
        sweep = _sweep(x, centroids, inner, phi, step, valid, labels, accumulate=update,
                       compare=stop_when_stable and updates > 0, measure=stop_when_stable or not update)
        if sweep.changed is not None and not bool(sweep.changed):
            break  # converged: another update would reproduce the same centroids
        if not update:
            break  # this sweep was the final assignment
        centroids = _means(sweep.sums, sweep.counts, centroids)
        updates += 1

    return KMeansResult(
        centroids=centroids[..., :d].contiguous(),
        labels=labels,
        iterations=updates,
        inertia=sweep.inertia,
        counts=sweep.counts,
        phi=phi,
        extra=None if phi is None else centroids[..., d].contiguous(),
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
    problems, n, _ = x.shape
    d = x.shape[-1]
    step = chunk or default_chunk(problems, centroids.shape[1], n)
    phi = _phi(x, valid, step) if metric == "ip" else None
    cent = centroids.to(device=x.device, dtype=torch.float32)
    labels = torch.empty(problems, n, dtype=torch.long, device=x.device)
    sweep = _sweep(x, cent, "l2" if metric == "ip" else metric, phi, step, valid, labels,
                   accumulate=False, compare=False, measure=True)
    return KMeansResult(
        centroids=cent[..., :d].contiguous(),
        labels=labels,
        iterations=iterations,
        inertia=sweep.inertia,
        counts=sweep.counts,
        phi=phi,
        extra=None if phi is None else cent[..., d].contiguous(),
    )
