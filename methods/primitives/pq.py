"""Product quantization of keys and asymmetric PQ search (PQCache §2.4, §2.7, §2.11).

Per group ``g`` (a KV head, possibly of one layer) the keys ``[n, d]`` split into ``m`` sub-spaces of
``d/m`` dimensions, each clustered into ``2**b`` centroids; a token is stored as ``m`` codes. A query
scores every token without reading its key: the lookup table ``LUT[r, j, c] = <q_r[j], C[j, c]>`` is
computed once, then ``score[r, t] = Σ_j LUT[r, j, code[t, j]]`` (asymmetric distance computation for
inner products). Everything is batched over groups ``G`` and the ``R`` query heads of a group (GQA).

Codes use the smallest integer dtype that holds ``2**b`` values (``code_dtype``): uint8 up to b = 8,
int16 up to 15, int32 above. Scores are float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.engine.ranking import GQA_RULES, group_scores, topk_ascending, topk_keyed
from kvbench.methods.primitives.kmeans import KMeansResult, assign, kmeans
from kvbench.methods.primitives.kmeans_sweep import _sq_norm, _table


@dataclass
class PQCodebook:
    centroids: Tensor  # [G, m, 2**b, d/m] float32
    codes: Tensor  # [G, n, m], dtype code_dtype(b)
    iterations: int = 0  # k-means updates run: the most over the sub-space problems (they may stop early)
    metric: str = "l2"
    phi: Tensor | None = None  # [G, m] (ip only), see kmeans
    extra: Tensor | None = None  # [G, m, 2**b] (ip only), see kmeans

    @property
    def m(self) -> int:
        return self.centroids.shape[1]

    @property
    def bits(self) -> int:
        return max(1, (self.centroids.shape[2] - 1).bit_length())


def code_dtype(bits: int) -> torch.dtype:
    """Smallest integer dtype holding ``2**bits`` non-negative codes."""
    if bits <= 8:
        return torch.uint8
    if bits <= 15:
        return torch.int16
    if bits <= 31:
        return torch.int32
    raise ValueError(f"{bits}-bit codes are not supported")


def _subspaces(keys: Tensor, m: int) -> Tensor:
    """``[G, n, d]`` → ``[G * m, n, d / m]``: problem ``g * m + j`` is group ``g``, sub-space ``j``."""
    groups, n, d = keys.shape
    if d % m:
        raise ValueError(f"head_dim {d} is not divisible into {m} sub-spaces")
    return keys.reshape(groups, n, m, d // m).permute(0, 2, 1, 3).reshape(groups * m, n, d // m)


def _codes(labels: Tensor, groups: int, m: int, bits: int) -> Tensor:
    """``[G * m, n]`` labels → ``[G, n, m]`` codes."""
    return labels.reshape(groups, m, -1).permute(0, 2, 1).to(code_dtype(bits)).contiguous()


def subspace_problems(keys: Tensor, m: int, first: int = 0, last: int | None = None) -> Tensor:
    """Problems ``first .. last - 1`` of ``_subspaces(keys, m)`` ``[last - first, n, d / m]`` (problem
    ``g * m + j`` is group ``g``, sub-space ``j``), copying only those: a worker that clusters a share
    of a layer's problems reads just its share."""
    groups, n, d = keys.shape
    if d % m:
        raise ValueError(f"head_dim {d} is not divisible into {m} sub-spaces")
    last = groups * m if last is None else last
    index = torch.arange(first, last, device=keys.device)
    return keys.unflatten(-1, (m, d // m))[index // m, :, index % m]


def codebook_from(result: KMeansResult, groups: int, m: int, b: int, metric: str) -> PQCodebook:
    """The codebook of ``groups`` groups from the k-means ``result`` of their ``groups * m`` sub-space
    problems (in ``_subspaces`` order)."""
    d_sub = result.centroids.shape[-1]
    return PQCodebook(
        centroids=result.centroids.reshape(groups, m, 2**b, d_sub),
        codes=_codes(result.labels, groups, m, b),
        iterations=result.iterations,
        metric=metric,
        phi=None if result.phi is None else result.phi.reshape(groups, m),
        extra=None if result.extra is None else result.extra.reshape(groups, m, 2**b),
    )


def fit_with(
    kmeans_fn: Callable[..., KMeansResult],
    keys: Tensor,
    m: int,
    b: int,
    *,
    iters: int,
    metric: str = "l2",
    seed: int = 0,
    valid: Tensor | None = None,
    **options,
) -> PQCodebook:
    """``pq_fit`` on any k-means with ``kmeans``'s signature (the faiss backend reuses it)."""
    if keys.dim() != 3:
        raise ValueError(f"pq_fit expects keys [G, n, d], got {tuple(keys.shape)}")
    groups, n, d = keys.shape
    mask = None if valid is None else valid.repeat_interleave(m, dim=0)  # [G, n] → [G * m, n]
    result = kmeans_fn(_subspaces(keys, m), 2**b, iters=iters, metric=metric, seed=seed, valid=mask, **options)
    return codebook_from(result, groups, m, b, metric)


def pq_fit(
    keys: Tensor,
    m: int,
    b: int,
    *,
    iters: int,
    metric: str = "l2",
    seed: int = 0,
    init: str = "random",
    shared_init: bool = True,
    stop_when_stable: bool = False,
    tol: float = 0.0,
    empty: str = "keep",
    chunk: int | None = None,
    valid: Tensor | None = None,
) -> PQCodebook:
    """Train ``m`` codebooks of ``2**b`` centroids per group and encode ``keys`` ``[G, n, d]``.

    One batched ``kmeans`` call solves all ``G·m`` sub-space problems. ``init="random"`` with shared
    indices matches the PQCache authors' initialisation (the same random points for every group);
    ``**kmeans.SKLEARN`` (``stop_when_stable``, ``tol``, ``empty``) their scikit-learn stopping and
    empty-cluster rules. ``valid`` ``[G, n]`` excludes padded tokens from the fit (they still get codes)."""
    return fit_with(
        kmeans,
        keys,
        m,
        b,
        iters=iters,
        metric=metric,
        seed=seed,
        valid=valid,
        init=init,
        shared_init=shared_init,
        stop_when_stable=stop_when_stable,
        tol=tol,
        empty=empty,
        chunk=chunk,
    )


def pq_encode(
    keys: Tensor,
    centroids: Tensor,
    *,
    metric: str = "l2",
    phi: Tensor | None = None,
    extra: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Nearest-centroid codes ``[G, n, m]`` of ``keys`` ``[G, n, d]`` (tokens leaving the local window).

    ``metric`` is the one the codebook was fitted with; ``ip`` also needs the codebook's ``phi``/``extra``."""
    groups, m, k, sub = centroids.shape
    flat_phi = None if phi is None else phi.reshape(groups * m)
    flat_extra = None if extra is None else extra.reshape(groups * m, k)
    labels = assign(
        _subspaces(keys, m), centroids.reshape(groups * m, k, sub), metric, chunk, phi=flat_phi, extra=flat_extra
    )
    return _codes(labels, groups, m, max(1, (k - 1).bit_length()))


def pq_encode_table(centroids: Tensor, *, metric: str = "l2", extra: Tensor | None = None) -> Tensor:
    """The matrices :func:`pq_encode`'s nearest-centroid search multiplies a point by, one per sub-space
    problem: ``[G·m, 2**b, D + 1]`` (``D = d/m``, one more for ``ip``; the k-means module's centroid
    table, see ``kmeans._table``). Made once per codebook for :func:`pq_encode_static`."""
    groups, m, k, sub = centroids.shape
    cent = centroids.reshape(groups * m, k, sub).float()
    if metric == "ip":
        if extra is None:
            raise ValueError("pq_encode_table(metric='ip') needs the codebook's extra")
        cent = torch.cat([cent, extra.reshape(groups * m, k).float()[..., None]], dim=-1)
    return _table(cent, "l2" if metric == "ip" else metric)


def pq_encode_static(
    keys: Tensor, table: Tensor, m: int, *, phi: Tensor | None = None, ones: Tensor | None = None
) -> Tensor:
    """:func:`pq_encode`'s codes ``[G, t, m]`` (int64) of ``keys`` ``[G, t, d]`` from its
    :func:`pq_encode_table`, in a few ops of fixed shapes and no host read (a static decode step codes
    its new token with it).

    The same numbers as :func:`pq_encode` of the same ``t`` tokens: the same points (the sub-space
    coordinates, the ``ip`` coordinate from ``phi`` ``[G, m]``, a constant 1), the same batched product
    with the same table, the best score per point with ties to the lower centroid (``argmax`` here,
    the k-means sweep's ``max_pool2d`` or ``max`` there; no chunking, which ``pq_encode`` only does
    past ``ONEDNN_MIN_PRODUCTS`` products, far above one token). ``ones``: ``[G·m, t, 1]`` float32
    ones, made once by a caller that encodes every step."""
    groups, t, d = keys.shape
    # [G·m, t, d/m]; one token's sub-spaces are a view of its key
    x = keys.view(groups * m, 1, d // m) if t == 1 and d % m == 0 and keys.is_contiguous() else _subspaces(keys, m)
    parts = [x]
    if phi is not None:
        room = phi.reshape(-1, 1).float() - _sq_norm(x.float())
        parts.append(room.clamp_min(0).sqrt()[..., None])
    parts.append(ones if ones is not None else torch.ones(x.shape[0], t, 1, device=x.device))
    points = torch.cat(parts, dim=-1)  # float32 (type promotion)
    labels = torch.bmm(table, points.transpose(1, 2)).argmax(dim=1)  # [G·m, t]
    return labels.view(groups, m, t).transpose(1, 2)


def pq_scores_static(queries: Tensor, transposed: Tensor, codes: Tensor) -> Tensor:
    """:func:`pq_scores` in a third of its ops, bit for bit (a static decode step scores every column of
    its bucket with it). ``transposed``: the centroids ``[G, m, 2**b, d/m]`` as
    ``centroids.reshape(G·m, 2**b, d/m).transpose(1, 2)`` (a view, made once per codebook).

    The lookup table is the very product ``pq_scores``' ``einsum`` computes (one ``bmm`` of the same
    operands in the same layout, without its permutes), and each sub-space's part is gathered from its
    ``[G, R, 2**b]`` slice of the table in place (no permuted copy); parts are summed in sub-space
    order, as there. ``codes`` ``[G, n, m]`` may be a view of sub-space major memory (``[G, m, n]``):
    each sub-space's index is then contiguous, which halves the gathers' time on a CPU."""
    problems, sub, k = transposed.shape
    groups, rows = queries.shape[0], queries.shape[1]
    m = problems // groups
    q = queries if queries.dtype == torch.float32 else queries.float()  # (a no-op .float() is still an op)
    q = q.view(groups, rows, m, sub).transpose(1, 2).contiguous().view(problems, rows, sub)
    lut = torch.bmm(q, transposed).view(groups, m, rows, k)
    n = codes.shape[1]
    index = codes.transpose(1, 2).long()  # [G, m, n]
    scores: Tensor | None = None
    for j in range(m):
        part = torch.gather(lut[:, j], 2, index[:, j].view(groups, 1, n).expand(groups, rows, n))
        scores = part if scores is None else scores.add_(part)
    assert scores is not None
    return scores


def pq_scores(queries: Tensor, centroids: Tensor, codes: Tensor) -> Tensor:
    """Approximate inner products ``q·k`` ``[G, R, n]`` from ``queries`` ``[G, R, d]`` and the codes.

    The lookup table is ``[G, R, m, 2**b]``; the gather-sum runs one sub-space at a time, so the only
    token-sized buffers are the ``[G, R, n]`` result and one ``[G, n]`` index. Each sub-space's table is
    gathered from a contiguous copy (``[G, R, 2**b]``, tiny) and the first sub-space's gather is the
    running sum itself (no zero-filled buffer): a third faster on a CPU, the same sums in the same order."""
    groups, m, k, sub = centroids.shape
    rows = queries.shape[1]
    if queries.shape[0] != groups or queries.shape[2] != m * sub:
        raise ValueError(f"queries {tuple(queries.shape)} do not fit centroids {tuple(centroids.shape)}")
    if codes.dim() != 3 or codes.shape[0] != groups or codes.shape[2] != m:
        raise ValueError(f"codes {tuple(codes.shape)} do not fit centroids {tuple(centroids.shape)}")
    q = queries.float().reshape(groups, rows, m, sub)
    lut = torch.einsum("grjs,gjcs->grjc", q, centroids.float())  # [G, R, m, 2**b]
    tables = lut.permute(2, 0, 1, 3).contiguous()  # [m, G, R, 2**b]
    n = codes.shape[1]
    scores = torch.zeros(groups, rows, n, dtype=torch.float32, device=lut.device) if m == 0 else None
    for j in range(m):  # sums in sub-space order, like faiss's ADC
        index = codes[:, :, j].long()[:, None, :].expand(groups, rows, n)
        part = torch.gather(tables[j], 2, index)
        scores = part if scores is None else scores.add_(part)
    assert scores is not None
    return scores


def exact_scores(queries: Tensor, keys: Tensor) -> Tensor:
    """Exact inner products ``q·k`` ``[G, R, n]`` (float32)."""
    return torch.bmm(queries.float(), keys.float().transpose(1, 2))


def _rows_in_order(values: Tensor) -> Tensor:
    """``[G, n]``: the ``R`` rows of ``values`` ``[G, R, n]`` added one after the other."""
    total = values[:, 0] + values[:, 1]
    for r in range(2, values.shape[1]):
        total.add_(values[:, r])
    return total


def _rows_interleaved(values: Tensor) -> Tensor:
    """``[G, n]``: the rows added as torch's CPU ``row_sum`` does: four partial sums of rows ``k, k + 4,
    ...`` (the rows past the last full four go to the first), then ``((p0 + p1) + p2) + p3``."""
    rows = values.shape[1]
    full = rows - rows % 4
    partial = [values[:, k] for k in range(4)]
    owned = [False] * 4  # (a partial sum still a view of values is not added to in place)
    for r in range(4, rows):
        k = r % 4 if r < full else 0
        partial[k] = partial[k].add_(values[:, r]) if owned[k] else partial[k] + values[:, r]
        owned[k] = True
    return (partial[0] + partial[1]).add_(partial[2]).add_(partial[3])


@functools.cache
def cpu_sum_block() -> int:
    """Columns per block of torch's CPU sum over a non-innermost axis (:func:`prefix_group_sum`), probed
    once: 32 where its vectors hold 8 floats. 0 when every column is summed in order (nothing to mimic)
    or the probe finds no such block."""
    n = 255
    values = torch.rand(64, 5, n, generator=torch.Generator().manual_seed(0))
    total, in_order = values.sum(dim=1), _rows_in_order(values)
    if torch.equal(total, in_order):
        return 0
    interleaved = _rows_interleaved(values)
    for block in (8, 16, 32, 64, 128):
        end = n - n % block
        if torch.equal(total[:, :end], in_order[:, :end]) and torch.equal(total[:, end:], interleaved[:, end:]):
            return block
    return 0


def prefix_group_sum(values: Tensor, end: Tensor, start: int = 0, columns: Tensor | None = None) -> Tensor:
    """``[G, n]``: the sums over the group axis of ``values`` ``[G, R, n]`` that
    ``values[..., :count].sum(dim=1)`` gives in its columns below ``count = end - start`` (``end``: ``[1]`` on
    the device, e.g. a static decode step's first slot after the middle, ``start`` its first middle
    slot), with fixed shapes. ``columns``: ``arange(n)`` on the device, if the caller has one.

    Why: on a CPU, torch's sum over a non-innermost axis adds the ``R`` rows one after the other in
    blocks of :func:`cpu_sum_block` columns, but as ``row_sum`` does (:func:`_rows_interleaved`) in the
    last ``n % block`` columns; from five rows on the two orders round differently. Scores summed over
    exactly the ``count`` middle tokens (the selection before the static step) and over a bucket of
    ``n`` columns would then differ in their last bits, and equal scores (tokens with equal PQ codes)
    rank by those bits. Both orders are computed here and each column keeps the one a sum over
    ``count`` columns used. Up to four rows both orders are one: ``values.sum(dim=1)``. Exact for
    ``count`` ≥ 8 and groups of 5 to 15 rows (checked against torch 2.13's CPU sum, any number of
    threads). On a GPU this is ``values.sum(dim=1)`` too (its order was not checked against a sum over
    ``count`` columns)."""
    rows, n = values.shape[1], values.shape[2]
    block = cpu_sum_block() if values.device.type == "cpu" and 4 < rows < 16 else 0
    if block == 0:
        return values.sum(dim=1)
    columns = torch.arange(n, device=values.device) if columns is None else columns
    count = end if start == 0 else end - start
    tail = columns >= torch.bitwise_and(count, -block)
    return torch.where(tail, _rows_interleaved(values), _rows_in_order(values))


def gqa_topk(scores: Tensor, k: int, rule: str = "softmax_sum", scale: float | None = None) -> Tensor:
    """The ``k`` tokens ``[G, min(k, n)]`` (ascending) each KV head fetches, from its query heads'
    scores ``[G, R, n]`` combined by ``rule`` (see ``group_scores``); ties go to the lower index."""
    return topk_ascending(group_scores(scores, rule, scale), k)


def comm_ratio(m: int, b: int, head_dim: int, key_bits: int = 16) -> float:
    """Extra communication of PQ codes relative to the keys: ``m·b / (key_bits·head_dim)`` (the
    paper's accounting: b-bit codes against fp16 keys)."""
    return m * b / (key_bits * head_dim)


__all__ = [
    "GQA_RULES",
    "topk_keyed",
    "PQCodebook",
    "code_dtype",
    "codebook_from",
    "comm_ratio",
    "exact_scores",
    "fit_with",
    "gqa_topk",
    "group_scores",
    "pq_encode",
    "pq_encode_static",
    "pq_encode_table",
    "pq_fit",
    "pq_scores",
    "pq_scores_static",
    "prefix_group_sum",
    "subspace_problems",
    "topk_ascending",
]
