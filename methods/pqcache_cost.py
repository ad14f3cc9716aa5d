"""PQCache's adaptive K-means iteration count (paper §3.3, Eq. 1–3), fitted on this machine.

K-means of one layer should take no longer than computing one layer, or clustering shows up in the
time to the second token. Per model, device and k-means backend kvbench measures

* ``t_layer(s) = c2·s² + c1·s + c0`` — one transformer layer's prefill time at ``s`` tokens (a full
  prefill divided by the layer count, at a few lengths, least squares), and
* ``t_kmeans(s, T) = base3(s) + per_iter(s)·(T − 3)`` — the PQ construction of one layer (all KV heads
  and sub-spaces) at 3 and 9 iterations, each linear in ``s`` (the authors' code's form),

and caps the iterations at ``T_max = (t_layer(s) − base3(s)) / per_iter(s) + 3``, clipped to ``[3, 300]``
(the authors' clip).

The k-means side is timed on the k-means the cap governs, never on another backend: the method hands
in ``time_kmeans(s, T)``, which clusters random keys of one layer's shape with its own workers
(:mod:`kvbench.methods.pqcache_workers`) where its runs cluster — host keys on CPU workers under the
paper's scheme (``kmeans_device=cpu``), so on a GPU machine ``t_layer`` is GPU compute and ``t_kmeans``
CPU clustering, the balance the paper strikes; the model's device with ``kmeans_device=model``. Both
timings run exactly ``T`` updates (stopping rules off): the cap bounds the updates, and early stopping
only ends some problems sooner. The authors time one (head, sub-space) problem per worker process, as
each of their ``h_kv·m`` processes clusters one; kvbench times a whole layer on its pool, which is the
same quantity when every problem has a worker of its own.

Fits are cached in ``$KVBENCH_HOME/cost_models/``, one file per model, device, dtype, PQ shape and
k-means backend (device, workers, torch threads, metric), and record that backend; the ``T`` used is
recorded with every sample. On a CPU-only machine K-means and the model share the same cores, so the
balance is only indicative.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.assets import kvbench_home

CLIP = (3, 300)
LAYER_LENGTHS = (256, 512, 1024, 2048)
KMEANS_LENGTHS = (512, 1024, 2048, 4096)


def _cache_path(ctx: Any, m: int, b: int, backend: dict[str, Any]) -> Path:
    device = ctx.spec.device.replace(":", "")
    kmeans_device = str(backend["device"]).replace(":", "")
    kmeans = f"kmeans-{kmeans_device}-w{backend['workers']}-t{backend['threads']}-{backend['metric']}"
    return kvbench_home() / "cost_models" / f"{ctx.spec.name}-{device}-{ctx.spec.dtype}-m{m}b{b}-{kmeans}.json"


def _time(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def fit_cost_model(
    model: Any, spec: Any, time_kmeans: Callable[[int, int], float], backend: dict[str, Any]
) -> dict[str, Any]:
    """Measure and fit the two cost curves (a minute or so on a CPU). ``time_kmeans(s, T)``: seconds of
    one layer's PQ construction at ``s`` tokens and exactly ``T`` iterations on the governed backend."""
    device = torch.device(spec.device)
    vocab = model.config.vocab_size
    layer_points = []
    with torch.inference_mode():
        for s in LAYER_LENGTHS:
            ids = torch.randint(0, vocab, (1, s), device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=1)  # warm-up
            seconds = _time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)
            layer_points.append((s, seconds / spec.n_layers))
    time_kmeans(KMEANS_LENGTHS[0], 3)  # warm-up: the workers' threads start, kernels load
    kmeans_points = []
    for s in KMEANS_LENGTHS:
        t3 = time_kmeans(s, 3)
        t9 = time_kmeans(s, 9)
        kmeans_points.append((s, t3, (t9 - t3) / 6))
    xs = np.array([p[0] for p in layer_points], dtype=float)
    layer = np.polyfit(xs, [p[1] for p in layer_points], 2)
    ks = np.array([p[0] for p in kmeans_points], dtype=float)
    base3 = np.polyfit(ks, [p[1] for p in kmeans_points], 1)
    per_iter = np.polyfit(ks, [max(p[2], 1e-9) for p in kmeans_points], 1)
    return {
        "layer_coefficients": layer.tolist(),  # c2, c1, c0
        "base3_coefficients": base3.tolist(),
        "per_iter_coefficients": per_iter.tolist(),
        "layer_points": layer_points,
        "kmeans_points": kmeans_points,
        "device": spec.device,
        "model": spec.name,
        "kmeans": dict(backend),  # where the timed k-means ran: device, workers, threads, metric
    }


def load_or_fit(
    ctx: Any, m: int, b: int, backend: dict[str, Any], time_kmeans: Callable[[int, int], float]
) -> dict[str, Any]:
    """The cached fit for this model, PQ shape and k-means ``backend``, else a new one (cached)."""
    path = _cache_path(ctx, m, b, backend)
    if path.exists():
        return json.loads(path.read_text())
    fitted = {**fit_cost_model(ctx.model, ctx.spec, time_kmeans, backend), "m": m, "b": b}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fitted, indent=2))
    return fitted


def iterations_for(fitted: dict[str, Any], tokens: int) -> int:
    """``T_max`` for ``tokens`` clustered tokens, clipped."""
    layer = float(np.polyval(fitted["layer_coefficients"], tokens))
    base3 = float(np.polyval(fitted["base3_coefficients"], tokens))
    per_iter = max(float(np.polyval(fitted["per_iter_coefficients"], tokens)), 1e-9)
    return int(min(max((layer - base3) / per_iter + 3, CLIP[0]), CLIP[1]))
