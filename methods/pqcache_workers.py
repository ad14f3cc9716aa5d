"""PQCache's K-means workers: one pool per method instance, clustering a layer while later layers compute.

The paper's Algorithm 1 (seed-pqcache.md §2.3) offloads every layer's keys to the host and clusters
them there, in ``h_kv·m`` CPU processes (one per KV head and sub-space), while the GPU computes the
following layers; the first decode step waits for layer ``l``'s codebook at layer ``l``. kvbench does
the same with threads: :meth:`KMeansWorkers.submit` splits a layer's ``G·m`` sub-space problems into
``workers`` contiguous shares, each share one batched :func:`~kvbench.methods.primitives.kmeans.kmeans`
call on a pool thread, and returns a :class:`LayerJob` at once; :meth:`LayerJob.result` waits for the
shares and assembles the layer's :class:`~kvbench.methods.primitives.pq.PQCodebook`. Jobs queue in
submission order, so every worker handles its share of layer 0, then of layer 1, as the authors'
workers do. torch releases the GIL inside its kernels, so the shares run in parallel with each other
and with the model's own work.

Why threads, not processes: the keys are already in this process's (pinned) host memory, and a
thread reads them without a copy or a shared-memory protocol. The cost: every share's ops use torch's
intra-op thread pool of the whole process (``torch.get_num_threads()``, set with ``OMP_NUM_THREADS``),
where the authors pin each process to its own cores (3-4 per process) and leave the main process a
core of its own. ``workers=1`` (the default) hands a layer's problems to one ``kmeans`` call, which
on CPU itself splits them into ``torch.get_num_threads()`` single-threaded shares (see "Threads" in
:mod:`kvbench.methods.primitives.kmeans`); more workers run several such calls at once (workers ×
threads threads in all), which only pays off with cores to spare.

Where the keys live (``device``):

* ``"cpu"`` — the paper's scheme: the job reads host keys. On a CUDA model the caller passes a CUDA
  event recorded after the keys' device→host copy; a share waits for it on its own thread, never on
  the model's stream.
* a CUDA device — the batched GPU variant (``method.kmeans_device=model``): shares run on this pool's
  own CUDA stream, which first waits for the event recorded after the layer's prefill, so clustering
  overlaps the later layers instead of queueing behind them on the default stream (it still shares
  the GPU's SMs with them). A share synchronises its stream before it reports, so the codebook is
  complete when :meth:`LayerJob.result` returns.

The pool lives as long as the method instance needs it: ``PQCache`` opens one per request (in
``start``) and :meth:`KMeansWorkers.shutdown` closes it in ``release``; two instances never
share threads (a class-level pool used to keep the first instance's ``workers`` for every later one).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.methods.primitives.kmeans import KMeansResult, kmeans
from kvbench.methods.primitives.pq import PQCodebook, codebook_from, subspace_problems


@dataclass
class _Share:
    """One worker's part of a layer: the k-means result of problems ``[first, last)`` and when it ran."""

    result: KMeansResult
    started: float
    ended: float


def _merge(results: list[KMeansResult]) -> KMeansResult:
    """The results of consecutive problem ranges as one result over all problems."""
    if len(results) == 1:
        return results[0]

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(r, name) for r in results], dim=0)

    def cat_optional(name: str) -> torch.Tensor | None:
        return None if getattr(results[0], name) is None else cat(name)

    return KMeansResult(
        centroids=cat("centroids"),
        labels=cat("labels"),
        iterations=max(r.iterations for r in results),
        inertia=cat("inertia"),
        counts=cat("counts"),
        phi=cat_optional("phi"),
        extra=cat_optional("extra"),
        updates=cat_optional("updates"),
    )


class LayerJob:
    """A layer's clustering in flight: :meth:`result` waits for its shares and assembles the codebook."""

    def __init__(self, futures: list[Future], groups: int, m: int, b: int, metric: str) -> None:
        self.futures = futures
        self.groups, self.m, self.b, self.metric = groups, m, b, metric

    def result(self) -> tuple[PQCodebook, float]:
        """``(codebook, seconds)``: seconds from the first share's start to the last share's end (the
        layer's clustering time; waiting for the keys' copy is not counted)."""
        shares: list[_Share] = [future.result() for future in self.futures]
        merged = _merge([share.result for share in shares])
        seconds = max(s.ended for s in shares) - min(s.started for s in shares)
        return codebook_from(merged, self.groups, self.m, self.b, self.metric), seconds


class KMeansWorkers:
    """``workers`` k-means threads of one method instance (see the module docstring)."""

    def __init__(self, workers: int, device: torch.device | str = "cpu") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = int(workers)
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=self.workers, thread_name_prefix="kvbench-kmeans"
        )

    @property
    def closed(self) -> bool:
        return self._pool is None

    def submit(
        self,
        keys: torch.Tensor,
        m: int,
        b: int,
        *,
        iters: int,
        metric: str,
        seed: int,
        init: str,
        options: dict[str, Any],
        ready: Any = None,
        inline: bool = False,
    ) -> LayerJob:
        """Cluster ``keys`` ``[G, n, d]`` (on :attr:`device`) into ``m`` sub-spaces of ``2**b`` centroids.

        ``ready``: a CUDA event recorded after ``keys`` were written (their device→host copy, or the
        layer's prefill); ``options``: the k-means stopping and empty-cluster options
        (``kmeans.SKLEARN`` or none); ``inline``: cluster now, on the calling thread (``overlap=false``).
        Shares use shared random initial points, so the split does not change the result."""
        if self._pool is None:
            raise RuntimeError("the k-means workers were shut down")
        groups = keys.shape[0]
        problems = groups * m
        bounds = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(problems).tensor_split(min(self.workers, problems))]
        settings = dict(iters=iters, metric=metric, seed=seed, init=init, **options)

        def share(first: int, last: int) -> _Share:
            with torch.inference_mode():  # inference mode is per thread
                if self.stream is None:
                    if ready is not None:
                        ready.synchronize()  # the keys' copy to the host has landed
                    started = time.perf_counter()
                    x = subspace_problems(keys, m, first, last).float()
                    result = kmeans(x, 2**b, shared_init=True, **settings)
                    return _Share(result, started, time.perf_counter())
                with torch.cuda.stream(self.stream):
                    if ready is not None:
                        self.stream.wait_event(ready)
                    started = time.perf_counter()
                    x = subspace_problems(keys, m, first, last).float()
                    result = kmeans(x, 2**b, shared_init=True, **settings)
                    self.stream.synchronize()
                    return _Share(result, started, time.perf_counter())

        if inline:
            futures = [_done(share(first, last)) for first, last in bounds]
        else:
            futures = [self._pool.submit(share, first, last) for first, last in bounds]
        return LayerJob(futures, groups, m, b, metric)

    def shutdown(self) -> None:
        """Drop the queued shares, wait for the running ones, stop the threads (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _done(result: Any) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
