"""The initialisations of :mod:`kvbench.methods.primitives.kmeans` (``"random"`` and ``"kmeans++"``; its
module notes): point indices drawn from a seeded CPU generator, so CPU and CUDA pick the same points
and nothing is read back to the host."""

from __future__ import annotations

import torch
from torch import Tensor

from kvbench.methods.primitives.kmeans_sweep import _normalize, _rows, _sq_norm


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


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    return torch.gather(x, 1, index[..., None].expand(-1, -1, x.shape[-1])).float()
