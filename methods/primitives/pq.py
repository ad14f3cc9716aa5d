"""Product quantization of keys and asymmetric PQ search (PQCache §2.4, §2.7).

Per group ``g`` (a KV head, possibly of one layer) the keys ``[n, d]`` split into ``m`` sub-spaces of
``d/m`` dimensions, each clustered into ``2**b`` centroids; a token is stored as ``m`` codes. A query
scores every token without reading its key: the lookup table ``LUT[r, j, c] = <q_r[j], C[j, c]>`` is
computed once, then ``score[r, t] = Σ_j LUT[r, j, code[t, j]]`` (asymmetric distance computation for
inner products). Everything is batched over groups and query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.primitives.kmeans import assign, kmeans


@dataclass
class PQCodebook:
    centroids: torch.Tensor  # [G, m, 2**b, d/m] float
    codes: torch.Tensor  # [G, n, m] (uint8 for b <= 8)

    @property
    def m(self) -> int:
        return self.centroids.shape[1]


def code_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits <= 8 else torch.int16 if bits <= 15 else torch.int32


def _subspaces(keys: torch.Tensor, m: int) -> torch.Tensor:
    """``[G, n, d]`` → ``[G * m, n, d / m]`` (problem ``g * m + j`` is group ``g``, sub-space ``j``)."""
    groups, n, d = keys.shape
    if d % m:
        raise ValueError(f"head_dim {d} is not divisible into {m} sub-spaces")
    return keys.reshape(groups, n, m, d // m).permute(0, 2, 1, 3).reshape(groups * m, n, d // m)


def pq_fit(
    keys: torch.Tensor, m: int, b: int, *, iters: int, metric: str = "l2", seed: int = 0, init: str = "random"
) -> PQCodebook:
    """Train ``m`` codebooks of ``2**b`` centroids per group and encode ``keys`` ``[G, n, d]``.

    ``init="random"`` with shared indices is the PQCache authors' initialisation (random points, the
    same for every group)."""
    groups, n, d = keys.shape
    result = kmeans(_subspaces(keys.float(), m), 2**b, iters=iters, metric=metric, seed=seed, init=init, shared_init=True)
    centroids = result.centroids.reshape(groups, m, 2**b, d // m)
    codes = result.labels.reshape(groups, m, n).permute(0, 2, 1).to(code_dtype(b)).contiguous()
    return PQCodebook(centroids=centroids, codes=codes)


def pq_encode(keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid codes ``[G, n, m]`` of ``keys`` ``[G, n, d]`` (tokens leaving the local window)."""
    groups, m, k, sub = centroids.shape
    n = keys.shape[1]
    labels = assign(_subspaces(keys.float(), m), centroids.reshape(groups * m, k, sub), "l2")
    bits = max(1, (k - 1).bit_length())
    return labels.reshape(groups, m, n).permute(0, 2, 1).to(code_dtype(bits)).contiguous()


def pq_scores(queries: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Approximate ``q·k`` ``[G, R, n]`` for ``queries`` ``[G, R, d]`` (R query heads per group)."""
    groups, m, k, sub = centroids.shape
    rows = queries.shape[1]
    q = queries.float().reshape(groups, rows, m, sub)
    lut = torch.einsum("grjs,gjcs->grjc", q, centroids.float())  # [G, R, m, 2**b]
    index = codes.long().permute(0, 2, 1)  # [G, m, n]
    gathered = torch.gather(lut, 3, index[:, None].expand(-1, rows, -1, -1))  # [G, R, m, n]
    return gathered.sum(dim=2)


def exact_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Exact ``q·k`` ``[G, R, n]``."""
    return torch.einsum("grd,gnd->grn", queries.float(), keys.float())


def comm_ratio(m: int, b: int, head_dim: int, key_bits: int = 16) -> float:
    """Extra communication of PQ codes relative to the keys' bytes (``m·b / (16·d_h)`` at fp16)."""
    return m * b / (key_bits * head_dim)
