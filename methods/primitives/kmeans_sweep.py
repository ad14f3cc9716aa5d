"""The mechanism of :mod:`kvbench.methods.primitives.kmeans`: the working space (points in float32
chunks with a trailing 1, the ``ip`` coordinate), the centroid table, one assignment step as a GEMM and a
reduction, a sweep over all points that assigns and accumulates in one pass, scikit-learn's relocation
of empty clusters, and the centroid means. Every tunable comes in as an argument (the working-copy
cache, the oneDNN threshold, atomic sums): :mod:`~kvbench.methods.primitives.kmeans` holds them and
passes its current values, and its module notes explain the choices ("Speed (CPU)", "Memory").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


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


def _sq_norm(x: Tensor) -> Tensor:
    """Squared norms over the last dimension (``vector_norm`` is several times faster than a
    squared sum on CPU)."""
    return torch.linalg.vector_norm(x, dim=-1).square()


def _normalize(x: Tensor) -> Tensor:
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)


Select = Tensor | slice | None  # problems: an index tensor, a range of them, or all


def _pick(rows: Select, t: Tensor) -> Tensor:
    """The rows (problems) ``rows`` of ``t``."""
    if rows is None:
        return t
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def _compose(rows: Tensor | None, part: slice) -> Select:
    """The problems ``part`` of the selection ``rows``, in the caller's numbering."""
    return part if rows is None else rows[part]


class _Points:
    """The points as the sweeps read them: float32 chunks ``[g, c, D + 1]`` of the working space
    (``D = d``, or ``d + 1`` with the ``ip`` coordinate) for ``g ≤ group`` problems, ending in a
    constant 1 that meets the centroid table's bias column (see ``_table``). The squared norms of all
    points are computed once. When the whole working copy fits in ``cache_bytes`` (the caller's
    ``WORK_CACHE_BYTES``) it is built once and chunks are views of it (no copy per sweep); otherwise
    one buffer is refilled per chunk."""

    def __init__(self, x: Tensor, metric: str, phi: Tensor | None, step: int, group: int, cache_bytes: int = 0) -> None:
        problems, n, d = x.shape
        self.x, self.metric, self.phi, self.step, self.group = x, metric, phi, step, group
        self.n, self.d = n, d
        self.width = d + (phi is not None)
        self.raw = torch.cat([_sq_norm(x[:, s : s + step].float()) for s in range(0, n, step)], dim=1)  # [P, n]
        self._cache: Tensor | None = None
        if problems * n * (self.width + 1) * 4 <= cache_bytes:
            self._buffer = torch.empty(problems * n * (self.width + 1), dtype=torch.float32, device=x.device)
            self._cache = self._fill(slice(None), 0, n)
        else:
            self._buffer = torch.empty(group * min(step, n) * (self.width + 1), dtype=torch.float32, device=x.device)

    def chunk(self, rows: Select, start: int, stop: int) -> Tensor:
        if self._cache is not None:
            return _pick(rows, self._cache[:, start:stop])
        return self._fill(rows, start, stop)

    def _fill(self, rows: Select, start: int, stop: int) -> Tensor:
        block = _pick(rows, self.x[:, start:stop])
        count = block.shape[0]
        out = self._buffer[: count * (stop - start) * (self.width + 1)].view(count, stop - start, self.width + 1)
        out[..., : self.d].copy_(block)
        if self.phi is not None:
            room = _pick(rows, self.phi)[:, None] - _pick(rows, self.raw)[:, start:stop]
            torch.sqrt(room.clamp_min(0), out=out[..., self.d])
        out[..., self.width].fill_(1.0)
        return out

    def distance(self, score: Tensor, rows: Select, start: int, stop: int) -> Tensor:
        """Distance ``[A, c]`` to the chosen centroid from its score (see ``_table``)."""
        raw = _pick(rows, self.raw)[:, start:stop]
        if self.metric == "cosine":
            return 1.0 - score / raw.sqrt().clamp_min(1e-12)
        if self.phi is not None:  # augmented points have squared norm max(φ, ‖x‖²)
            raw = torch.maximum(raw, _pick(rows, self.phi)[:, None])
        return (raw - 2.0 * score).clamp_min(0)

    def at(self, rows: Tensor | None, index: Tensor) -> Tensor:
        """Working-space coordinates ``[A, m, D]`` of the points ``index`` ``[A, m]``."""
        owner = torch.arange(index.shape[0], device=index.device) if rows is None else rows
        points = self.x[owner[:, None], index].float()
        if self.phi is None:
            return points
        room = self.phi[owner][:, None] - self.raw[owner[:, None], index]
        return torch.cat([points, room.clamp_min(0).sqrt()[..., None]], dim=-1)

    def mean_variance(self, valid: Tensor | None) -> Tensor:
        """``mean_j var(x_j)`` over each problem's valid points ``[P]`` (scikit-learn's ``_tolerance``
        scale), two passes in float64 over chunks of all problems."""
        problems = self.x.shape[0]
        weight = None if valid is None else valid.double()
        total = torch.full((problems,), float(self.n), dtype=torch.float64, device=self.x.device)
        if weight is not None:
            total = weight.sum(dim=1).clamp_min(1)
        mean = torch.zeros(problems, self.width, dtype=torch.float64, device=self.x.device)
        for start in range(0, self.n, self.step):
            stop = min(self.n, start + self.step)
            block = _rows(self.x, start, stop, self.phi).double()
            mean += (block if weight is None else block * weight[:, start:stop, None]).sum(dim=1)
        mean /= total[:, None]
        spread = torch.zeros(problems, dtype=torch.float64, device=self.x.device)
        for start in range(0, self.n, self.step):
            stop = min(self.n, start + self.step)
            square = (_rows(self.x, start, stop, self.phi).double() - mean[:, None]).square().sum(-1)
            spread += (square if weight is None else square * weight[:, start:stop]).sum(dim=1)
        return (spread / total / self.width).float()


def _table(centroids: Tensor, metric: str) -> Tensor:
    """The centroids as GEMM operand ``[P, k, D + 1]``: a point's score is its product with a row.

    l2/ip: ``[c, −‖c‖²/2]`` → ``x·c − ‖c‖²/2 = (‖x‖² − ‖x − c‖²) / 2``, largest for the nearest ``c``.
    cosine: ``[c/‖c‖, 0]`` → ``x·ĉ``, which ranks the centroids as the cosine does (``‖x‖`` is common)."""
    if metric == "cosine":
        return F.pad(_normalize(centroids), (0, 1))
    return torch.cat([centroids, -0.5 * _sq_norm(centroids)[..., None]], dim=-1)


def _best(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Largest score and its centroid (lowest index on ties) per point, from ``scores`` ``[g, k, c]``."""
    problems, k, c = scores.shape
    if scores.device.type != "cpu":
        return scores.max(dim=1)
    # [g, k, c] is the channels-last layout of a [g, c/w, k, w] image: pooling over the whole height
    # reduces over k with the points in the vector lanes (see the module notes). The kernel runs its
    # g·w output pixels in parallel, so a single problem is split into w column blocks for the threads.
    threads = torch.get_num_threads()
    w = next((w for w in (4 * threads, 2 * threads, threads) if problems < threads and c % w == 0), 1)
    image = scores.view(problems, k, w, c // w).permute(0, 3, 1, 2)
    value, index = F.max_pool2d(image, (k, 1), return_indices=True)  # [g, c/w, 1, w], channels-last
    index = index.permute(0, 2, 3, 1).reshape(problems, c)  # flat positions h·w + column block
    return value.permute(0, 2, 3, 1).reshape(problems, c), index if w == 1 else index // w


@functools.cache
def _onednn_linear() -> Callable[..., Tensor] | None:
    """oneDNN's fp32 ``linear`` (``mkldnn._linear_pointwise``, the op inductor emits), when this torch
    build has it: it uses the CPU's AVX-512 units where MKL's SGEMM (what ``bmm`` calls) runs its
    AVX2 kernels, e.g. on AMD Zen 5 (see "Speed (CPU)" in the module notes)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        probe = torch.ones(2, 3)
        if not torch.equal(op(probe, probe, None, "none", [], ""), probe @ probe.T):
            return None
    except (AttributeError, RuntimeError):
        return None
    return op


def _assign_block(table: Tensor, block: Tensor, out: Tensor, onednn_min: int) -> tuple[Tensor, Tensor]:
    """Best score and centroid ``[g, c]`` of every point of ``block`` ``[g, c, D + 1]`` against
    ``table`` ``[g, k, D + 1]``, with the scores ``[g, k, c]`` written into ``out`` (or, with oneDNN from
    ``onednn_min`` multiply-adds on, one problem at a time: it has no batched fp32 product that keeps
    fp32 precision)."""
    problems, k, width = table.shape
    linear = _onednn_linear() if table.device.type == "cpu" else None
    if linear is None or k * block.shape[1] * width < onednn_min:
        return _best(torch.bmm(table, block.transpose(1, 2), out=out))
    parts = [_best(linear(table[p], block[p], None, "none", [], "")[None]) for p in range(problems)]
    if problems == 1:
        return parts[0]
    return torch.cat([value for value, _ in parts]), torch.cat([index for _, index in parts])


@dataclass
class _Sweep:
    inertia: Tensor  # [A]
    counts: Tensor  # [A, k] int64
    sums: Tensor | None  # [A, k, D] float32, when accumulated
    changed: Tensor | None  # [A] bool, when compared
    distance: Tensor | None  # [A, n] float32 (invalid points −inf), when kept


def _sweep(
    points: _Points,
    table: Tensor,
    rows: Tensor | None,
    labels: Tensor,
    valid: Tensor | None,
    *,
    accumulate: bool,
    compare: bool,
    atomic: bool,
    onednn_min: int,
    measure: bool = True,
    keep_distance: bool = False,
) -> _Sweep:
    """One pass over the points of the problems ``rows`` (all when None; ``table`` holds their
    centroids): assign each point to its nearest centroid (written into ``labels``) and, in the same
    pass, accumulate the per-cluster sums the next update needs (``accumulate``), note which problems
    changed a valid label (``compare``), sum the distances (``measure``; else ``inertia`` stays 0) and
    keep them per point (``keep_distance``, for the relocation). Steps cover ``points.group`` problems × ``points.step``
    points. ``atomic``: counts and sums by atomic ``index_add_`` instead of ``bincount`` and serial
    ``index_put_`` (``ATOMIC_SUMS``); ``onednn_min``: see :func:`_assign_block`."""
    count, k, _ = table.shape
    n, step, width, device = points.n, points.step, points.width, table.device
    # Bin k of every problem collects the invalid points, so they never move a centroid.
    counts = torch.zeros(count * (k + 1), dtype=torch.long, device=device)
    sums = torch.zeros(count, k + 1, width, dtype=torch.float32, device=device) if accumulate else None
    inertia = torch.zeros(count, dtype=torch.float32, device=device)
    changed = torch.zeros(count, dtype=torch.bool, device=device) if compare else None
    distance = torch.empty(count, n, dtype=torch.float32, device=device) if keep_distance else None
    group = min(points.group, count)
    # the counts' increments, made once per sweep (a step's chunk never holds more points)
    ones = torch.ones(group * min(step, n), dtype=torch.long, device=device) if atomic else None
    scores = torch.empty(group * k * min(step, n), dtype=torch.float32, device=device)
    for first in range(0, count, group):
        part = slice(first, min(count, first + group))
        size = part.stop - part.start
        problems = _compose(rows, part)  # in the numbering of x and labels
        block_table = table[part]
        keep_all = None if valid is None else _pick(problems, valid)
        owner = torch.arange(part.start, part.stop, device=device)[:, None]
        offset = owner * (k + 1)
        for start in range(0, n, step):
            stop = min(n, start + step)
            block = points.chunk(problems, start, stop)
            out = scores[: size * k * (stop - start)].view(size, k, stop - start)
            score, index = _assign_block(block_table, block, out, onednn_min)
            dist = points.distance(score, problems, start, stop) if measure or keep_distance else None
            keep = None if keep_all is None else keep_all[:, start:stop]
            if changed is not None:  # (compare)
                differs = index != labels[problems, start:stop]
                changed[part] |= (differs if keep is None else differs & keep).any(dim=1)
            labels[problems, start:stop] = index
            if keep is not None:
                index = index.masked_fill(~keep, k)
                dist = None if dist is None else dist.masked_fill(~keep, 0.0)
            if dist is not None:
                inertia[part] += dist.sum(dim=1)
            if distance is not None and dist is not None:  # (keep_distance computes dist)
                distance[part, start:stop] = dist if keep is None else dist.masked_fill(~keep, float("-inf"))
            flat = (index + offset).view(-1)
            if atomic:  # (see ATOMIC_SUMS: no host sync, one atomic add per point and coordinate)
                assert ones is not None
                counts.index_add_(0, flat, ones[: flat.numel()])
                if sums is not None:
                    sums.view(-1, width).index_add_(0, flat, block[..., :width].reshape(-1, width))
            else:
                counts += torch.bincount(flat, minlength=count * (k + 1))
                if sums is not None:  # (a [g, c, D] view of the chunk: flattening it would copy)
                    sums.index_put_((owner.expand_as(index), index), block[..., :width], accumulate=True)
    return _Sweep(
        inertia=inertia,
        counts=counts.view(count, k + 1)[:, :k],
        sums=None if sums is None else sums[:, :k],
        changed=changed,
        distance=distance,
    )


def _relocate(sweep: _Sweep, points: _Points, rows: Tensor | None, labels: Tensor) -> None:
    """scikit-learn's empty-cluster relocation, in place on ``sweep.sums``/``counts`` (module notes)."""
    counts, sums, distance = sweep.counts, sweep.sums, sweep.distance
    assert sums is not None and distance is not None, "relocation needs a sweep with accumulate and keep_distance"
    empty = counts == 0
    most = int(empty.sum(dim=1).max())
    if most == 0:
        return
    count, n = distance.shape
    far_distance, far = distance.topk(min(most, n), dim=1)  # farthest first
    most = far.shape[1]
    # The empty clusters in ascending order first (a stable sort of the "filled" flags).
    targets = torch.sort(~empty, dim=1, stable=True).indices[:, :most]
    slot = torch.arange(most, device=far.device)[None, :]
    # sklearn relocates nothing when every point sits on its centroid; invalid points (−inf) never move.
    take = (slot < empty.sum(dim=1, keepdim=True)) & (distance.amax(dim=1, keepdim=True) > 0) & (far_distance >= 0)
    source = torch.gather(labels if rows is None else labels.index_select(0, rows), 1, far)
    moved = points.at(rows, far) * take[..., None]
    problem = torch.arange(count, device=far.device)[:, None].expand_as(far)
    sums.index_put_((problem, source), -moved, accumulate=True)
    counts.index_put_((problem, source), -take.long(), accumulate=True)
    target_sums = torch.where(take[..., None], moved, torch.gather(sums, 1, targets[..., None].expand_as(moved)))
    sums.scatter_(1, targets[..., None].expand_as(moved), target_sums)
    counts.scatter_(1, targets, torch.where(take, 1, torch.gather(counts, 1, targets)))


def _means(sums: Tensor, counts: Tensor, previous: Tensor) -> Tensor:
    """Plain arithmetic means; an empty cluster keeps its previous centroid."""
    means = sums / counts.clamp_min(1).to(sums.dtype)[..., None]
    return torch.where((counts > 0)[..., None], means, previous)
