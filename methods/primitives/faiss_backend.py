"""Optional faiss-cpu backend with the signatures of ``kmeans.kmeans`` and ``pq.pq_fit``.

Useful as an independent oracle and for speed comparisons; never imported by default (faiss is an
optional dependency: ``pip install faiss-cpu``). Problems run one at a time through ``faiss.Kmeans``
on CPU; results come back as tensors on the input's device.

How it differs from the torch implementation:
  * the initial centroids are the torch implementation's (``init`` "random", "kmeans++", "given"),
    handed to faiss, so the two start from the same points; ``init="faiss"`` lets faiss sample its own;
  * faiss splits the largest cluster into an empty one instead of keeping the empty centroid;
  * faiss has no early stop: ``stop_when_stable=True`` and ``tol`` > 0 are refused, and so is an
    ``empty`` rule (faiss has its own, the split above);
  * ``cosine`` runs faiss's spherical k-means on L2-normalised points (centroids renormalised every
    iteration); the returned centroids are then the plain means of the raw points of each final
    cluster (ClusterKV's centroid), so they are not the torch iterates;
  * ``ip`` clusters the augmented points (see ``kmeans``) with L2, as the PQCache authors do;
  * every point is used for training (no faiss subsampling), and the returned labels, inertia and
    counts come from one final assignment with the torch rules, so they match the centroids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvbench.methods.primitives import kmeans as _torch_kmeans
from kvbench.methods.primitives.kmeans import INITS, METRICS, KMeansResult
from kvbench.methods.primitives.kmeans_sweep import _augment_centroids
from kvbench.methods.primitives.pq import PQCodebook, fit_with


def _faiss() -> Any:
    try:
        import faiss
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the faiss k-means backend needs faiss: pip install faiss-cpu") from error
    return faiss


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
    empty: str | None = None,
    chunk: int | None = None,
    valid: Tensor | None = None,
) -> KMeansResult:
    """``kmeans.kmeans`` computed by ``faiss.Kmeans``, one problem at a time (see the module notes)."""
    faiss = _faiss()
    _check_options(metric, init, stop_when_stable, tol, empty)
    problems, n, d = x.shape

    if metric == "ip":
        points, phi = _torch_kmeans.ip_augment(x, valid)
    else:
        points, phi = x.float(), None
    if metric == "cosine":
        train_points = torch.nn.functional.normalize(points, dim=-1)
    else:
        train_points = points

    if init == "given":
        if init_centroids is None or init_centroids.shape != (problems, k, d):
            raise ValueError(f"init='given' needs init_centroids of shape {(problems, k, d)}")
        given = init_centroids.float()
        start: Tensor | None = given if phi is None else _augment_centroids(given.to(phi.device), phi)
    elif init == "faiss":
        start = None
    else:
        rows = _torch_kmeans.initial_rows(
            x, k, init=init, metric=metric, seed=seed, shared_init=shared_init, valid=valid, chunk=chunk
        )
        start = torch.gather(train_points, 1, rows[..., None].expand(-1, -1, train_points.shape[-1]))

    found = _train(faiss, train_points, valid, start, k, iters=iters, seed=seed, metric=metric)
    centroids = torch.from_numpy(np.stack(found)).to(x.device)

    if metric == "cosine":
        centroids = _cluster_means(x, centroids, k, valid, chunk)
    return _torch_kmeans.finish(x, centroids, metric=metric, iterations=iters, valid=valid, chunk=chunk)


def _check_options(metric: str, init: str, stop_when_stable: bool, tol: float, empty: str | None) -> None:
    """Refuse an unknown metric or init and the torch-only options faiss cannot honour (see the module notes)."""
    if metric not in METRICS:
        raise ValueError(f"unknown k-means metric {metric!r}; use one of {METRICS}")
    if init not in INITS + ("faiss",):
        raise ValueError(f"unknown k-means init {init!r}; use one of {INITS + ('faiss',)}")
    if stop_when_stable or tol:
        raise NotImplementedError("faiss k-means runs a fixed number of iterations; use stop_when_stable=False, tol=0")
    if empty is not None:
        raise NotImplementedError(
            f"faiss splits the largest cluster into an empty one; empty={empty!r} is the "
            "torch k-means' rule (kmeans.kmeans)"
        )


def _train(
    faiss: Any,
    train_points: Tensor,
    valid: Tensor | None,
    start: Tensor | None,
    k: int,
    *,
    iters: int,
    seed: int,
    metric: str,
) -> list[np.ndarray]:
    """Each problem's centroids from ``faiss.Kmeans`` on its valid points (host arrays; ``start`` itself at 0 iters)."""
    problems = train_points.shape[0]
    host_points = train_points.detach().cpu().numpy()
    host_valid = None if valid is None else valid.detach().cpu().numpy()
    found = []
    for p in range(problems):
        data = np.ascontiguousarray(host_points[p] if host_valid is None else host_points[p][host_valid[p]])
        if iters == 0:
            if start is None:
                raise ValueError("iters=0 needs an init other than 'faiss'")
            found.append(start[p].cpu().numpy())
            continue
        if data.shape[0] < k:
            raise ValueError(f"faiss k-means needs at least k={k} points per problem, problem {p} has {data.shape[0]}")
        km = faiss.Kmeans(
            data.shape[1],
            k,
            niter=iters,
            seed=seed,
            verbose=False,
            spherical=metric == "cosine",
            min_points_per_centroid=1,
            max_points_per_centroid=max(1, -(-data.shape[0] // k)),
        )
        km.train(data, init_centroids=None if start is None else np.ascontiguousarray(start[p].cpu().numpy()))
        found.append(km.centroids)
    return found


def _cluster_means(x: Tensor, centroids: Tensor, k: int, valid: Tensor | None, chunk: int | None) -> Tensor:
    """Cosine's returned centroids: each cluster's plain mean of the raw points (faiss's centroid if empty)."""
    problems, _, d = x.shape
    # ClusterKV's centroid: the plain mean of the raw points of each cluster, the clusters being
    # the points' nearest faiss centroids (an empty cluster keeps faiss's unit centroid).
    labels = _torch_kmeans.assign(x, centroids, "cosine", chunk)
    keep = torch.ones_like(labels, dtype=torch.bool) if valid is None else valid
    index = labels.masked_fill(~keep, k)
    sums = torch.zeros(problems, k + 1, d, dtype=torch.float32, device=x.device)
    sums.scatter_add_(1, index[..., None].expand(-1, -1, d), x.float())
    counts = torch.zeros(problems, k + 1, dtype=torch.float32, device=x.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    means = sums[:, :k] / counts[:, :k].clamp_min(1)[..., None]
    return torch.where(counts[:, :k, None] > 0, means, centroids)


def pq_fit(keys: Tensor, m: int, b: int, *, iters: int, **options: Any) -> PQCodebook:
    """``pq.pq_fit`` with every sub-space clustered by faiss: its keywords (``metric``, ``seed``, ``init``,
    ``shared_init``, ``chunk``, ``valid``, ...) go to :func:`kmeans`, whose defaults are ``pq.pq_fit``'s
    but for ``empty`` (faiss has its own rule, see the module notes)."""
    return fit_with(kmeans, keys, m, b, iters=iters, **options)
