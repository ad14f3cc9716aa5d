"""Paired statistics for two methods run on the same samples.

When two runs score the same samples (same task config, same ids), the honest comparison is paired:
the per-sample differences carry the effect, and the sample-to-sample spread that both runs share
cancels. :func:`paired` gives the mean difference, a bootstrap 95 % interval of it (resampling the
samples, i.e. the pairs), and a two-sided p-value:

* **McNemar's exact test** when every score is 0 or 100 (NIAH substring hits, passkey, accuracy): only
  the discordant pairs carry information, and under the null hypothesis each is equally likely to go
  either way, so the p-value is the two-sided binomial tail of the smaller discordant count;
* a **paired permutation test** otherwise (F1, Rouge, partial credit): under the null hypothesis the
  sign of each difference is exchangeable, so the p-value is the share of random sign flips whose
  mean difference is at least as far from zero as the observed one (exact enumeration up to 2^12
  pairs, else 20,000 seeded flips, counted with the +1 correction so it is never 0).

Both are computed with numpy alone and are deterministic (fixed seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

BINARY = (0.0, 100.0)


@dataclass(frozen=True)
class Paired:
    n: int  # pairs
    mean_a: float
    mean_b: float
    diff: float  # mean of a - b
    ci_low: float | None
    ci_high: float | None
    p: float | None
    test: str  # "mcnemar" | "permutation" | "none"
    a_only: int | None = None  # McNemar: pairs where only a scored (100 vs 0)
    b_only: int | None = None


def bootstrap_mean(x: ArrayLike, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95 % percentile bootstrap interval of mean(x), resampling the values; None below two values."""
    d = np.asarray(x, dtype=float)
    if d.size < 2:
        return None
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def bootstrap_diff(a: ArrayLike, b: ArrayLike, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95 % percentile bootstrap interval of mean(a - b), resampling pairs; None below two pairs."""
    return bootstrap_mean(np.asarray(a, dtype=float) - np.asarray(b, dtype=float), resamples, seed)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (binomial(n, 1/2) tail, capped at 1)."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def permutation_p(a: ArrayLike, b: ArrayLike, resamples: int = 20000, seed: int = 0) -> float:
    """Two-sided paired permutation (sign-flip) p-value of mean(a - b) = 0."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.size == 0 or not np.any(d):
        return 1.0
    observed = abs(d.mean())
    tolerance = 1e-12 * max(1.0, observed)
    if d.size <= 12:  # every sign pattern
        signs = np.array(np.meshgrid(*[[1.0, -1.0]] * d.size)).reshape(d.size, -1).T
        means = np.abs((signs * d).mean(axis=1))
        return float(np.mean(means >= observed - tolerance))
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(resamples, d.size))
    extreme = int(np.sum(np.abs((signs * d).mean(axis=1)) >= observed - tolerance))
    return (extreme + 1) / (resamples + 1)


def paired(a: ArrayLike, b: ArrayLike) -> Paired:
    """Compare paired scores ``a`` and ``b`` (same samples, same order); see the module doc."""
    a_arr, b_arr = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a_arr.shape != b_arr.shape:
        raise ValueError("paired scores must have the same length")
    n = int(a_arr.size)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, None, None, None, "none")
    ci = bootstrap_diff(a_arr, b_arr)
    common: dict[str, Any] = dict(
        n=n,
        mean_a=float(a_arr.mean()),
        mean_b=float(b_arr.mean()),
        diff=float((a_arr - b_arr).mean()),
        ci_low=ci[0] if ci else None,
        ci_high=ci[1] if ci else None,
    )
    if np.isin(a_arr, BINARY).all() and np.isin(b_arr, BINARY).all():
        a_only = int(np.sum((a_arr == 100) & (b_arr == 0)))
        b_only = int(np.sum((a_arr == 0) & (b_arr == 100)))
        return Paired(**common, p=mcnemar_exact(a_only, b_only), test="mcnemar", a_only=a_only, b_only=b_only)
    return Paired(**common, p=permutation_p(a_arr, b_arr), test="permutation")
