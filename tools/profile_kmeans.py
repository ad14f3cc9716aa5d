"""Where one layer's k-means goes: ClusterKV's and PQCache's prefill clustering, timed and profiled.

Usage (from the repository root; on a CUDA machine for the figures that matter)::

    python tools/profile_kmeans.py --device cuda --length 32768 --out /tmp/kmeans

On an H200 ClusterKV's prefill clustering took ~0.2 s a layer at 32k tokens and PQCache's GPU k-means
(``kmeans_device=model``) ~0.4 s (RESULTS.md §9b), for work worth a few milliseconds of GPU arithmetic.
This tool clusters one layer's keys of the Llama-3.1-8B shape (8 KV heads, head_dim 128; random keys,
which cost what real keys cost per update, though they may take a different number of updates) the way
each method does:

* ``clusterkv``: the ``[8, n, 128]`` keys, cosine, ``round(n / 80)`` clusters, at most 20 updates,
  stopping once no label changes (``ClusterKVParams``' defaults);
* ``pqcache``: ``m = 2`` sub-spaces of 64 dimensions per head (16 problems), ``2**6`` centroids,
  scikit-learn's rules (``SKLEARN``) with ``--pq-iters`` updates at most;

each with the sweeps' accumulation paths and step sizes of ``VARIANTS`` (``kmeans.ATOMIC_SUMS``:
``bincount`` + ``index_put_`` against atomic ``index_add_``; larger steps), side by side in one
process, best of ``--repeats`` after one untimed call;
then one torch.profiler run of each case in the device's default path: the ops with the most self
device and self CPU time, and the host reads (``aten::_local_scalar_dense``, device synchronisations).

Writes ``summary.json`` under ``--out`` and prints it. Not a benchmark of record: it says where the
time goes so that the engine's e2e figures can be read (and improved).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

HEADS, HEAD_DIM = 8, 128

#: the k-means module settings each timed variant runs with (the rest as the module has them). On CUDA:
#: ``serial`` is the module's path before 2026-11-28 (bincount + index_put_ sums, 64 MiB of scores a
#: step, points cached up to 256 MiB), ``atomic`` the same steps with index_add_ sums, ``wide`` atomic
#: sums with 256 MiB steps and points cached up to 1 GiB (the CUDA default since; RESULTS.md §9c).
#: On a CPU only ATOMIC_SUMS changes anything (its steps follow CPU_DISTANCE_BUDGET).
SETTINGS = ("ATOMIC_SUMS", "DISTANCE_BUDGET", "CUDA_WORK_CACHE_BYTES")
VARIANTS: dict[str, dict[str, Any]] = {
    "serial": {"ATOMIC_SUMS": False, "DISTANCE_BUDGET": 1 << 24, "CUDA_WORK_CACHE_BYTES": 1 << 28},
    "atomic": {"ATOMIC_SUMS": True, "DISTANCE_BUDGET": 1 << 24, "CUDA_WORK_CACHE_BYTES": 1 << 28},
    "wide": {"ATOMIC_SUMS": True, "DISTANCE_BUDGET": 1 << 26, "CUDA_WORK_CACHE_BYTES": 1 << 30},
}


def cases(length: int, pq_iters: int) -> dict[str, dict[str, Any]]:
    """The k-means calls of one layer at ``length`` prompt tokens: the problem shape and the options."""
    from kvbench.methods import PARAMS
    from kvbench.methods.primitives.kmeans import SKLEARN

    c, p = PARAMS["clusterkv"](), PARAMS["pqcache"]()
    n = length - c.sink
    return {
        "clusterkv": {
            "m": 1,
            "k": max(1, round(n / 80)),
            "tokens": n,
            "options": {
                "iters": c.kmeans_iters,
                "metric": c.metric,
                "seed": c.seed,
                "init": c.init,
                "stop_when_stable": c.until_stable,
            },
        },
        "pqcache": {
            "m": 2,
            "k": 2**6,
            "tokens": length - p.sink,
            "options": {"iters": pq_iters, "metric": p.metric, "seed": p.seed, "init": p.init, **SKLEARN},
        },
    }


def problems(case: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The case's float32 problems ``[8·m, n, 128 / m]`` from random bf16 keys, as the methods build them."""
    from kvbench.methods.primitives.pq import subspace_problems

    generator = torch.Generator().manual_seed(case["tokens"])
    keys = torch.randn(HEADS, case["tokens"], HEAD_DIM, generator=generator).to(device, torch.bfloat16)
    return subspace_problems(keys, case["m"]).float() if case["m"] > 1 else keys.float()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(x: torch.Tensor, case: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Best wall time of ``repeats`` calls (after one untimed call), the updates they ran, and the time
    per sweep (``updates + 1`` sweeps: the last assignment follows the last update)."""
    from kvbench.methods.primitives.kmeans import kmeans

    kmeans(x, case["k"], **case["options"])
    sync(x.device)
    best, updates = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        result = kmeans(x, case["k"], **case["options"])
        sync(x.device)
        best = min(best, time.perf_counter() - start)
        updates = int(result.iterations)
    return {"s": best, "updates": updates, "ms_per_update": 1e3 * best / max(1, updates + 1)}


def profiled(x: torch.Tensor, case: dict[str, Any], top: int) -> dict[str, Any]:
    """One profiled call: the ``top`` ops by self device time and by self CPU time, and the host reads."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kvbench.methods.primitives.kmeans import kmeans

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=activities) as prof:
        kmeans(x, case["k"], **case["options"])
        sync(x.device)
    events = prof.key_averages()

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)

    def row(e: Any) -> dict[str, Any]:
        return {
            "op": e.key,
            "calls": int(e.count),
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "self_device_ms": device_us(e) / 1e3,
        }

    reads = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
    return {
        "by_device": [row(e) for e in sorted(events, key=device_us, reverse=True)[:top] if device_us(e) > 0],
        "by_cpu": [row(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]],
        "host_reads": {e.key: int(e.count) for e in events if e.key in reads},
        # kernels only: an op's row repeats the time of the kernels it launched
        "device_ms": sum(device_us(e) for e in events if e.device_type == DeviceType.CUDA) / 1e3,
        "cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
    }


def run(device: torch.device, length: int, repeats: int, pq_iters: int, top: int, profile_it: bool) -> dict[str, Any]:
    from kvbench.methods.primitives import kmeans as kmeans_module

    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "length": length,
        "cases": {},
    }
    saved = {name: getattr(kmeans_module, name) for name in SETTINGS}
    try:
        for name, case in cases(length, pq_iters).items():
            x = problems(case, device)
            entry: dict[str, Any] = {"problems": list(x.shape), "k": case["k"], "options": case["options"]}
            for label, settings in VARIANTS.items():
                for key, value in settings.items():
                    setattr(kmeans_module, key, value)
                entry[label] = timed(x, case, repeats)
            for key, value in saved.items():
                setattr(kmeans_module, key, value)
            entry["atomic_over_serial"] = entry["atomic"]["s"] / entry["serial"]["s"]
            if profile_it:
                entry["profile"] = profiled(x, case, top)
            summary["cases"][name] = entry
            del x
    finally:
        for key, value in saved.items():
            setattr(kmeans_module, key, value)
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pq-iters", type=int, default=10, help="PQCache's update cap (its NIAH protocol: 10)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("kmeans-profile"))
    args = parser.parse_args(argv)
    with torch.inference_mode():
        device = torch.device(args.device)
        summary = run(device, args.length, args.repeats, args.pq_iters, args.top, not args.no_profile)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(report(summary))
    return summary


def report(summary: dict[str, Any]) -> str:
    """The summary as a few lines per case (the JSON holds everything)."""
    lines = [f"{summary['device']}, torch {summary['torch']}, {summary['length']} tokens"]
    for name, e in summary["cases"].items():
        lines.append(f"{name}: problems {e['problems']} k={e['k']}, atomic/serial {e['atomic_over_serial']:.3f}")
        for label in VARIANTS:
            t = e[label]
            lines.append(f"  {label:7} {t['s']:.3f} s, {t['updates']} updates, {t['ms_per_update']:.2f} ms a sweep")
        prof = e.get("profile")
        if prof:
            totals = f"device {prof['device_ms']:.1f} ms, cpu {prof['cpu_ms']:.1f} ms"
            lines.append(f"  profiled: {totals}; host reads {prof['host_reads']}")
            for key in ("by_device", "by_cpu"):
                for r in prof[key][:8]:
                    times = f"cpu {r['self_cpu_ms']:8.2f} ms  dev {r['self_device_ms']:8.2f} ms"
                    lines.append(f"  {key:9} {r['op'][:48]:48} x{r['calls']:<6} {times}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
