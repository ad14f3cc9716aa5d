"""Batched k-means over many independent problems at once (PQ sub-spaces, KV heads, layers).

PQCache clusters every (layer, KV head, sub-space) separately and ClusterKV every KV head; solving
them one by one wastes the batch dimension. Here ``x`` is ``[P, n, d]`` — ``P`` independent problems
of ``n`` points — and every step is one batched tensor op, the same code on CPU and CUDA.

* ``metric="l2"``: Lloyd's algorithm (PQCache's default, Euclidean on raw key sub-vectors).
* ``metric="cosine"``: assignment by the largest cosine similarity, centroids the plain mean of the
  assigned raw keys (not renormalised) — ClusterKV's rule.
* ``metric="ip"``: maximum-inner-product k-means by the usual augmentation (PQCache's ``METRIC="ip"``):
  every point gets an extra coordinate ``sqrt(φ - ‖x‖²)`` with ``φ`` the problem's largest squared
  norm, L2 k-means runs in ``d + 1`` dimensions, and the returned centroids drop the extra coordinate.

Initialisation (``init``): ``random`` picks ``k`` distinct random points (seeded; ``shared_init`` uses
the same point indices for every problem, as both papers' efficiency code does; with fewer points
than clusters, points are reused); ``kmeans++`` draws each next centroid with probability
proportional to the distance to the nearest one already drawn (the default of RAFT, which
ClusterKV's accuracy code uses); ``given`` starts from ``init_centroids``. An empty cluster keeps its previous centroid. Distances are
computed in float32 in chunks of points, so memory stays bounded for long contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METRICS = ("l2", "cosine", "ip")


@dataclass
class KMeansResult:
    centroids: torch.Tensor  # [P, k, d]
    labels: torch.Tensor  # [P, n] int64
    iterations: int  # Lloyd iterations run
    inertia: torch.Tensor  # [P]: sum of squared distances (l2/ip) or of (1 - cosine) (cosine)


def _chunk_size(problems: int, k: int, requested: int | None) -> int:
    if requested:
        return requested
    budget = 64 * 2**20  # float32 elements of one distance block (256 MiB)
    return max(256, budget // max(1, problems * k))


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def assign(x: torch.Tensor, centroids: torch.Tensor, metric: str = "l2", chunk: int | None = None) -> torch.Tensor:
    """Nearest centroid of every point: ``x`` ``[P, n, d]``, ``centroids`` ``[P, k, d]`` → ``[P, n]``."""
    return _assign(x.float(), centroids.float(), metric, chunk)[0]


def _assign(x: torch.Tensor, centroids: torch.Tensor, metric: str, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[P, n]`` and each point's distance to its centroid ``[P, n]`` (float32 inputs)."""
    if metric not in METRICS:
        raise ValueError(f"unknown k-means metric {metric!r}; use one of {METRICS}")
    problems, n, _ = x.shape
    step = _chunk_size(problems, centroids.shape[1], chunk)
    labels = torch.empty(problems, n, dtype=torch.long, device=x.device)
    best = torch.empty(problems, n, dtype=torch.float32, device=x.device)
    if metric == "cosine":
        c = _normalize(centroids)
        for start in range(0, n, step):
            sim = torch.bmm(_normalize(x[:, start : start + step]), c.transpose(1, 2))
            value, index = sim.max(dim=-1)
            labels[:, start : start + step], best[:, start : start + step] = index, 1 - value
        return labels, best
    c_sq = (centroids * centroids).sum(-1)  # [P, k]
    for start in range(0, n, step):
        block = x[:, start : start + step]
        dist = (block * block).sum(-1, keepdim=True) - 2 * torch.bmm(block, centroids.transpose(1, 2)) + c_sq[:, None]
        value, index = dist.min(dim=-1)
        labels[:, start : start + step], best[:, start : start + step] = index, value.clamp_min(0)
    return labels, best


def _initial(x: torch.Tensor, k: int, seed: int, shared: bool) -> torch.Tensor:
    problems, n, d = x.shape
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def pick() -> torch.Tensor:
        if n >= k:
            return torch.randperm(n, generator=generator)[:k]
        return torch.randint(0, n, (k,), generator=generator)

    if shared:
        index = pick().to(x.device).expand(problems, -1)
    else:
        index = torch.stack([pick() for _ in range(problems)]).to(x.device)
    return torch.gather(x, 1, index[..., None].expand(-1, -1, d)).clone()


def _distance(x: torch.Tensor, centroid: torch.Tensor, metric: str) -> torch.Tensor:
    """Distance ``[P, n]`` of every point to one centroid per problem ``[P, d]``."""
    if metric == "cosine":
        return 1 - (_normalize(x) * _normalize(centroid)[:, None]).sum(-1)
    return ((x - centroid[:, None]) ** 2).sum(-1)


def _kmeans_plus_plus(x: torch.Tensor, k: int, seed: int, metric: str) -> torch.Tensor:
    problems, n, d = x.shape
    generator = torch.Generator(device="cpu").manual_seed(seed)
    first = torch.randint(0, n, (problems,), generator=generator).to(x.device)
    chosen = [x[torch.arange(problems, device=x.device), first]]
    nearest = _distance(x, chosen[0], metric).clamp_min(0)
    for _ in range(1, k):
        weights = nearest.double().cpu()
        empty = weights.sum(dim=1) <= 0
        weights[empty] = 1.0  # every point already is a centroid: draw uniformly
        pick = torch.multinomial(weights, 1, generator=generator)[:, 0].to(x.device)
        centroid = x[torch.arange(problems, device=x.device), pick]
        chosen.append(centroid)
        nearest = torch.minimum(nearest, _distance(x, centroid, metric).clamp_min(0))
    return torch.stack(chosen, dim=1).clone()


def _update(x: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Mean of the assigned points; an empty cluster keeps its centroid."""
    problems, k, d = centroids.shape
    sums = torch.zeros(problems, k, d, dtype=torch.float32, device=x.device)
    sums.scatter_add_(1, labels[..., None].expand(-1, -1, d), x)
    counts = torch.zeros(problems, k, dtype=torch.float32, device=x.device)
    counts.scatter_add_(1, labels, torch.ones_like(labels, dtype=torch.float32))
    filled = counts > 0
    means = sums / counts.clamp_min(1)[..., None]
    return torch.where(filled[..., None], means, centroids)


def kmeans(
    x: torch.Tensor,
    k: int,
    *,
    iters: int,
    metric: str = "l2",
    seed: int = 0,
    init: str = "random",
    init_centroids: torch.Tensor | None = None,
    shared_init: bool = True,
    stop_when_stable: bool = False,
    chunk: int | None = None,
) -> KMeansResult:
    """Cluster each of the ``P`` problems of ``x`` (``[P, n, d]``) into ``k`` clusters."""
    if metric not in METRICS:
        raise ValueError(f"unknown k-means metric {metric!r}; use one of {METRICS}")
    if x.dim() != 3 or x.shape[1] == 0:
        raise ValueError(f"kmeans expects [P, n, d] with n > 0, got {tuple(x.shape)}")
    data = x.float()
    width = data.shape[-1]
    if metric == "ip":
        norms = (data * data).sum(-1)
        phi = norms.amax(dim=1, keepdim=True)
        data = torch.cat([data, (phi - norms).clamp_min(0).sqrt()[..., None]], dim=-1)
    inner = "l2" if metric == "ip" else metric
    if init == "given":
        if init_centroids is None:
            raise ValueError("init='given' needs init_centroids")
        centroids = init_centroids.float().clone()
        if metric == "ip":
            centroids = torch.cat([centroids, torch.zeros_like(centroids[..., :1])], dim=-1)
    elif init == "kmeans++":
        centroids = _kmeans_plus_plus(data, k, seed, inner)
    elif init == "random":
        centroids = _initial(data, k, seed, shared_init)
    else:
        raise ValueError(f"unknown k-means init {init!r}; use random, kmeans++ or given")
    labels = None
    done = 0
    for done in range(1, max(iters, 0) + 1):
        new_labels, _ = _assign(data, centroids, inner, chunk)
        stable = labels is not None and torch.equal(new_labels, labels)
        labels = new_labels
        if stop_when_stable and stable:
            break
        centroids = _update(data, labels, centroids)
    labels, distance = _assign(data, centroids, inner, chunk)
    return KMeansResult(
        centroids=centroids[..., :width].contiguous(),
        labels=labels,
        iterations=done,
        inertia=distance.sum(dim=1),
    )
