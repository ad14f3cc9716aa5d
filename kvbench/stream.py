"""A request stream on one server: TTFT under load against achieved throughput (CacheBlend Fig. 14).

CacheBlend's throughput experiment sends a stream of RAG queries at increasing request rates to one
serving engine whose chunk store starts empty, and plots the delay (TTFT, queueing included) against
the throughput achieved, skipping the first queries (their store was cold). kvbench runs it in two
parts, and this module is the second:

1. **Measured.** ``kvbench run task=rag_stream method=<m>`` (:mod:`kvbench.tasks.rag_stream`) runs every
   request of the stream *for real*, one at a time, in arrival order, on the normal engine with one
   chunk store for the whole run (empty at the start, LRU under ``store.ram_gb``). Each request's
   record holds its measured **service time** — chunk caches it had to compute first
   (``prepared.precompute_s``: a miss costs a prefill of the chunk), the prefill (``ttft_s``, loads
   included) and the decode (``decode_s``) — and its time to first token from the moment it is served
   (``precompute_s + ttft_s``). Writing new caches to the store happens after the answer and is not
   counted, as CacheBlend's store writes them from a background thread.
2. **Simulated.** :func:`replay` puts those requests on a timeline: arrivals from a seeded Poisson
   process at rate λ (exponential gaps, mean 1/λ), one server, a FIFO queue, batch size 1. A request
   starts when it has arrived and the previous one has finished; its TTFT is its wait plus its own
   time to first token; it leaves the server after its whole service time.

Why this split is exact for this server rather than an approximation: with one server, FIFO and one
request at a time, the order in which requests are served is the arrival order whatever λ is, so
what the chunk store holds when each request is served — and hence its service time — does not
depend on λ. One measured pass in arrival order therefore gives the service times of every arrival
rate; only the queueing depends on λ, and that is arithmetic. What it leaves out: a serving engine
that batches requests (vLLM's continuous batching, which CacheBlend ran on) overlaps them; this one
does not, so throughput saturates at 1 / mean service time. Machine noise in the measured service
times is carried into every rate alike.

**Statistics** (:func:`stream_stats`): the first ``warmup`` requests of the stream are excluded (the
paper skips its first 1K of 6K queries; their store was cold); over the rest, TTFT p50 / p90 (queueing
included) and the achieved throughput: the requests served divided by the time from when the first of
them could be served (it had arrived and the warm-up requests were done) to the last completion — λ
under a light load, 1 / mean service time under overload. Every method is replayed on the same arrival times (common
random numbers), so the methods differ only by their service times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike


def arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of ``n`` requests of a Poisson process at ``rate`` requests/s, the first at 0.

    The gaps are exponential with mean ``1 / rate``, drawn from ``seed``: the same seed gives the same
    unit-rate gaps scaled by ``1 / rate``, so every rate (and every method) sees one common stream."""
    if rate <= 0:
        raise ValueError("the arrival rate must be positive")
    gaps = np.random.default_rng(seed).exponential(1.0, size=max(0, n - 1)) / rate
    return np.concatenate([[0.0], np.cumsum(gaps)]) if n else np.zeros(0)


@dataclass
class Replay:
    """Per request: when it arrived, started and finished service, and its TTFT (s)."""

    arrival: np.ndarray
    start: np.ndarray
    finish: np.ndarray
    ttft: np.ndarray

    @property
    def wait(self) -> np.ndarray:
        return self.start - self.arrival


def replay(arrival: ArrayLike, service: ArrayLike, first_token: ArrayLike) -> Replay:
    """One server, FIFO, one request at a time: request i starts at ``max(arrival_i, finish_{i-1})``,
    its first token comes ``first_token_i`` after it starts, and it finishes ``service_i`` after it starts."""
    arrival = np.asarray(arrival, dtype=float)
    service = np.asarray(service, dtype=float)
    first_token = np.asarray(first_token, dtype=float)
    if not (len(arrival) == len(service) == len(first_token)):
        raise ValueError("arrival, service and first_token must have one entry per request")
    if np.any(first_token > service + 1e-12):
        raise ValueError("a request's first token cannot come after its service ends")
    start = np.empty_like(arrival)
    finish = np.empty_like(arrival)
    free = -np.inf
    for i, (at, busy) in enumerate(zip(arrival, service)):
        start[i] = max(at, free)
        finish[i] = free = start[i] + busy
    return Replay(arrival, start, finish, start - arrival + first_token)


def service_times(records: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(service time, time to first token from the start of service) of each record, in record order."""
    service, first = [], []
    for record in records:
        tele = record.get("telemetry") or {}
        pre = float((tele.get("prepared") or {}).get("precompute_s") or 0.0)
        ttft = float(tele["ttft_s"])
        first.append(pre + ttft)
        service.append(pre + ttft + float(tele.get("decode_s") or 0.0))
    return np.asarray(service), np.asarray(first)


def stream_stats(
    records: Sequence[dict[str, Any]], rates: Sequence[float], *, warmup: int, seed: int = 0
) -> list[dict[str, Any]]:
    """TTFT p50/p90 and achieved throughput per arrival rate (requests/s) of one method's stream run
    (its records in arrival order), the first ``warmup`` requests excluded from the statistics."""
    service, first = service_times(records)
    n = len(service)
    if warmup >= n:
        raise ValueError(f"warm-up of {warmup} requests leaves none of the {n} to measure")
    rows = []
    for rate in rates:
        r = replay(arrivals(n, rate, seed), service, first)
        kept = slice(warmup, n)
        # the window of the measured requests: from when the first of them could be served (it has
        # arrived and the warm-up is done) to the last completion
        opened = max(float(r.arrival[warmup]), float(r.finish[warmup - 1]) if warmup else -np.inf)
        span = float(r.finish[-1]) - opened
        served = n - warmup
        rows.append(
            {
                "rate": float(rate),
                "throughput": served / span if span > 0 else float("inf"),
                "ttft_p50_s": float(np.percentile(r.ttft[kept], 50)),
                "ttft_p90_s": float(np.percentile(r.ttft[kept], 90)),
                "wait_p50_s": float(np.percentile(r.wait[kept], 50)),
                "service_mean_s": float(service[kept].mean()),
                "utilisation": float(service[kept].sum() / span) if span > 0 else 1.0,
                "requests": served,
            }
        )
    return rows


def rate_grid(mean_services: Sequence[float], points: int = 8) -> list[float]:
    """Arrival rates shared by every method of a comparison: geometric from a light load of the slowest
    (0.25 of its capacity 1 / mean service) to an overload of the fastest (1.25 of its capacity)."""
    low = 0.25 / max(mean_services)
    high = 1.25 / min(mean_services)
    return [float(x) for x in np.geomspace(low, max(high, 1.01 * low), points)]
