"""PQCache's adaptive K-means iteration count (paper §3.3, Eq. 1–3), fitted on this machine.

K-means of one layer should take no longer than computing one layer, or clustering shows up in the
time to the second token. Per model and device kvbench measures

* ``t_layer(s) = c2·s² + c1·s + c0`` — one transformer layer's prefill time at ``s`` tokens (a full
  prefill divided by the layer count, at a few lengths, least squares), and
* ``t_kmeans(s, T) = base3(s) + per_iter(s)·(T − 3)`` — the PQ construction of one layer (all KV heads
  and sub-spaces) at 3 and 9 iterations, each linear in ``s`` (the authors' code's form),

and caps the iterations at ``T_max = (t_layer(s) − base3(s)) / per_iter(s) + 3``, clipped to ``[3, 300]``
(the authors' clip). Fits are cached in ``$KVBENCH_HOME/cost_models/`` and the ``T`` used is recorded
with every sample. On a CPU-only machine K-means and the model share the same cores, so the balance
is only indicative; the same code decides on a GPU, where the model runs on the device.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.assets import kvbench_home
from kvbench.methods.primitives.pq import pq_fit

CLIP = (3, 300)
LAYER_LENGTHS = (256, 512, 1024, 2048)
KMEANS_LENGTHS = (512, 1024, 2048, 4096)


def _cache_path(ctx: Any, m: int, b: int) -> Path:
    device = ctx.spec.device.replace(":", "")
    return kvbench_home() / "cost_models" / f"{ctx.spec.name}-{device}-{ctx.spec.dtype}-m{m}b{b}.json"


def _time(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def fit_cost_model(model: Any, spec: Any, m: int, b: int) -> dict[str, Any]:
    """Measure and fit the two cost curves (a minute or so on a CPU)."""
    device = torch.device(spec.device)
    vocab = model.config.vocab_size
    layer_points = []
    with torch.inference_mode():
        for s in LAYER_LENGTHS:
            ids = torch.randint(0, vocab, (1, s), device=device)
            model(input_ids=ids, use_cache=False, logits_to_keep=1)  # warm-up
            seconds = _time(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device)
            layer_points.append((s, seconds / spec.n_layers))
        kmeans_points = []
        for s in KMEANS_LENGTHS:
            keys = torch.randn(spec.n_kv_heads, s, spec.head_dim, device=device)
            t3 = _time(lambda: pq_fit(keys, m, b, iters=3), device)
            t9 = _time(lambda: pq_fit(keys, m, b, iters=9), device)
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
        "m": m,
        "b": b,
    }


def load_or_fit(ctx: Any, m: int, b: int) -> dict[str, Any]:
    path = _cache_path(ctx, m, b)
    if path.exists():
        return json.loads(path.read_text())
    fitted = fit_cost_model(ctx.model, ctx.spec, m, b)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fitted, indent=2))
    return fitted


def iterations_for(fitted: dict[str, Any], tokens: int) -> int:
    """``T_max`` for ``tokens`` clustered tokens, clipped."""
    layer = float(np.polyval(fitted["layer_coefficients"], tokens))
    base3 = float(np.polyval(fitted["base3_coefficients"], tokens))
    per_iter = max(float(np.polyval(fitted["per_iter_coefficients"], tokens)), 1e-9)
    return int(min(max((layer - base3) / per_iter + 3, CLIP[0]), CLIP[1]))

