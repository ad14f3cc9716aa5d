"""Cache-Craft's reusability arithmetic (SIGMOD 2025, arXiv 2502.15734, Eqs. 3-14), on numpy arrays.

Everything here is a pure function of a chunk variant's recorded statistics (:class:`VariantStats`)
and the new prompt's prefix, so it is unit-tested on hand-computed attention matrices; the policy
(:mod:`kvbench.methods.cachecraft`) records the statistics and applies the results.

* ``inter(C_i, C_j)`` — total attention from C_i's tokens to an earlier chunk C_j (Eq. 3), per layer;
* ``intra(C_i)`` — total causal attention among C_i's own tokens (Eq. 4), per layer;
* per-token inter scores — each token's attention to all earlier chunks, per layer;
* :func:`beta` — the share of C_i's inter attention that went to chunks also in the new prefix (Eq. 6);
* :func:`kendall_gamma` — the normalised Kendall-tau distance between the common chunks' orders (Eq. 7);
* ``beta' = beta (1 - gamma)`` (Eq. 8);
* :func:`cci` — ``1 / (1 + exp(-a/b))`` with ``a``, ``b`` the layer means of
  ``sum_j inter(C_i, C_j) / (|C_i| |C_j|)`` and ``intra(C_i) / |C_i|^2`` (Eqs. 9-11);
* :func:`cfo` — ``clamp(alpha · CCI · (1 - beta'), 0, 1)`` (Eq. 12 as one reimplementation writes it);
* :func:`select_tokens` — the ``ceil(CFO · |C_i|)`` tokens with the highest inter score (Eq. 14).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VariantStats:
    """What a chunk variant records from the prefill that created it.

    ``context``: the identities of the chunks that preceded it (S_old), in prompt order; ``sizes``
    their token counts; ``inter`` ``[layers, len(context)]``; ``intra`` ``[layers]``; ``tokens``
    ``[layers, length]`` (each token's attention to all of S_old).
    """

    context: tuple[str, ...]
    sizes: tuple[int, ...]
    length: int
    inter: np.ndarray
    intra: np.ndarray
    tokens: np.ndarray

    @classmethod
    def from_mass(cls, mass: np.ndarray, index: int, context: Sequence[str], sizes: Sequence[int]) -> VariantStats:
        """The statistics of chunk ``index`` from its rows' attention mass per chunk, ``mass``
        ``[layers, |C_i|, chunks]`` (column ``j``: the prompt's ``j``-th chunk; ``index`` columns precede
        it, so ``context`` and ``sizes`` describe columns ``0 .. index - 1``)."""
        mass = np.asarray(mass, dtype=np.float64)
        before = mass[:, :, :index]
        return cls(
            context=tuple(context),
            sizes=tuple(int(s) for s in sizes),
            length=int(mass.shape[1]),
            inter=before.sum(axis=1),
            intra=mass[:, :, index].sum(axis=1),
            tokens=before.sum(axis=2),
        )


def beta(stats: VariantStats, new_context: Sequence[str], *, empty: float) -> float:
    """Prefix overlap (Eq. 6): the share of the variant's inter attention (summed over layers) that went
    to chunks that are also in ``new_context``. A variant with no earlier chunk (empty S_old, 0/0) gets
    1.0 when the new prefix has no chunk either (the same context) and ``empty`` otherwise."""
    totals = stats.inter.sum(axis=0) if stats.inter.size else np.zeros(0)
    whole = float(totals.sum())
    if not stats.context or whole <= 0.0:
        return 1.0 if not new_context else float(empty)
    present = set(new_context)
    kept = sum(float(t) for label, t in zip(stats.context, totals) if label in present)
    return kept / whole


def kendall_gamma(old: Sequence[str], new: Sequence[str]) -> float:
    """Order penalty (Eq. 7): discordant pairs among the chunks common to both orders, over C(m, 2);
    0.0 with fewer than two common chunks."""
    where = {label: i for i, label in enumerate(new)}
    common = [where[label] for label in old if label in where]  # new ranks, in old order
    m = len(common)
    if m < 2:
        return 0.0
    discordant = sum(1 for a in range(m) for b in range(a + 1, m) if common[a] > common[b])
    return discordant / (m * (m - 1) / 2)


def cci(stats: VariantStats) -> float:
    """Cache Context Impact (Eqs. 9-11): ``1 / (1 + exp(-a/b))``, in [0.5, 1]; 0.5 when the chunk
    attended no earlier chunk (``a = 0``), 1.0 when ``b = 0 < a``."""
    length = max(1, stats.length)
    if stats.context:
        sizes = np.maximum(np.asarray(stats.sizes, dtype=np.float64), 1.0)
        a = float((stats.inter / (length * sizes[None, :])).sum(axis=1).mean())
    else:
        a = 0.0
    b = float((stats.intra / length**2).mean()) if stats.intra.size else 0.0
    if b <= 0.0:
        return 1.0 if a > 0.0 else 0.5
    return 1.0 / (1.0 + math.exp(-a / b))


def cfo(alpha: float, impact: float, beta_prime: float) -> float:
    """Cache Fix Overhead (Eq. 12): the share of the chunk to recompute, ``alpha · CCI · (1 - beta')``
    clamped to [0, 1]."""
    return min(1.0, max(0.0, float(alpha) * impact * (1.0 - beta_prime)))


def token_scores(stats: VariantStats) -> np.ndarray:
    """Each token's inter-attention score: its attention to all earlier chunks, mean over layers."""
    if stats.tokens.size == 0:
        return np.zeros(stats.length)
    return stats.tokens.mean(axis=0)


def recompute_count(fraction: float, length: int) -> int:
    """``ceil(CFO · |C|)`` (Eq. 14), at most ``|C|``; a hair of float noise above an integer is not a token."""
    return min(length, max(0, math.ceil(fraction * length - 1e-9)))


def select_tokens(scores: np.ndarray, count: int) -> np.ndarray:
    """Indices (sorted) of the ``count`` highest ``scores``; ties go to the earlier token."""
    count = min(int(count), len(scores))
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    return np.sort(order[:count]).astype(np.int64)
