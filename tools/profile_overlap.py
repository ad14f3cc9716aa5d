"""Does PQCache's k-means hide behind the prefill? A torch.profiler trace of one PQCache request, read.

Usage (from the repository root, on a CUDA machine)::

    python tools/profile_overlap.py --model llama31_8b_shape --length 32768 --out /tmp/overlap

PQCache's Algorithm 1 offloads each layer's keys to the host and clusters them on CPU workers while
the GPU computes the following layers; Algorithm 2 copies layer l+1's PQ codes to the GPU on a side
stream while layer l computes. This tool checks both on a real trace instead of trusting the design:

1. times ``full`` and ``pqcache`` side by side (``--rounds`` alternating unprofiled runs, best of
   each): TTFT of full, TT2T of both, and the ratio TT2T(pqcache) / TTFT(full) the issue bounds by 1.1
   (TT2T = prefill + first decode step: the first step waits for the codebooks still being fitted);
2. profiles one more PQCache request (CPU and CUDA activities), writes the Chrome trace
   (``trace.json.gz``) and reads from it, on the profiler's one clock:

   * ``kvbench.prefill`` (the prefill, the token pick's sync included) and ``kvbench.decode_step``
     spans, and the k-means shares' start and end on the worker threads (torch.profiler records
     only the profiling thread's labels, so the shares' own ``perf_counter`` stamps are placed on
     the trace's clock by the prefill's start, stamped on both clocks);
   * the GPU's busy time (union of kernel intervals) inside each k-means span: clustering while the
     GPU computes is the overlap the paper claims;
   * k-means time inside the prefill vs after it (after it, only the first decode step can hide it);
   * host-to-device copies by stream: codes prefetched on a side stream show up on a stream other
     than the kernels' main one, and the part of each copy that ran while kernels ran on another
     stream is reported.

Writes ``summary.json`` and prints it. Not a benchmark: the numbers of record come from
``kvbench bench pqcache_e2e``; this explains them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path
from typing import Any

import torch

#: the e2e bench's PQCache budget (kvbench/bench/retrieval.py)
BUDGET = {"token_ratio": 0.2, "comm_ratio": 1 / 128}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted union of ``[start, end)`` intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    """Length of ``span`` covered by the disjoint intervals ``busy``."""
    return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in busy)


def read_trace(path: Path, shares: list[tuple[float, float]], prefill_started: float) -> dict[str, Any]:
    """The overlap figures of one PQCache request's Chrome trace (times in ms); ``shares``: the
    k-means shares' ``(started, ended)`` and ``prefill_started`` the prefill's start, in
    ``time.perf_counter`` seconds."""
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]

    def named(name: str) -> list[dict[str, Any]]:
        return [e for e in spans if e.get("name") == name and e.get("cat") == "user_annotation"]

    def interval(e: dict[str, Any]) -> tuple[float, float]:
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    prefill = [interval(e) for e in named("kvbench.prefill")]
    steps = sorted(interval(e) for e in named("kvbench.decode_step"))
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    copies = [e for e in spans if e.get("cat") == "gpu_memcpy"]
    if not prefill:
        raise SystemExit(f"{path}: no kvbench.prefill span in the trace")
    p_start, p_end = prefill[0]
    kmeans = sorted((p_start + 1e6 * (a - prefill_started), p_start + 1e6 * (b - prefill_started)) for a, b in shares)
    busy = union([interval(e) for e in kernels])
    main_stream = max(  # (None on a CPU: no kernels)
        {e["args"].get("stream") for e in kernels} or {None},
        key=lambda s: sum(e["dur"] for e in kernels if e["args"].get("stream") == s),
    )
    main_busy = union([interval(e) for e in kernels if e["args"].get("stream") == main_stream])
    total_k = sum(e - s for s, e in kmeans)
    in_prefill = sum(covered(k, [(p_start, p_end)]) for k in kmeans)
    gpu_during_k = sum(covered(k, busy) for k in kmeans)
    last_k_end = max((e for _, e in kmeans), default=p_start)
    by_stream: dict[str, dict[str, float]] = {}
    for e in copies:
        kind = e.get("name", "")
        if "HtoD" not in kind and "Pinned -> Device" not in kind and "H2D" not in kind:
            continue
        stream = str(e["args"].get("stream"))
        row = by_stream.setdefault(stream, {"copies": 0, "ms": 0.0, "MB": 0.0, "ms_under_main_kernels": 0.0})
        row["copies"] += 1
        row["ms"] += e["dur"] / 1e3
        row["MB"] += float(e["args"].get("bytes", 0)) / 1e6
        row["ms_under_main_kernels"] += covered(interval(e), main_busy) / 1e3
    decode_ms = [(e - s) / 1e3 for s, e in steps]
    return {
        "prefill_ms": (p_end - p_start) / 1e3,
        "gpu_busy_in_prefill_ms": covered((p_start, p_end), busy) / 1e3,
        "kmeans_spans": len(kmeans),
        "kmeans_total_ms": total_k / 1e3,
        "kmeans_in_prefill_ms": in_prefill / 1e3,
        "kmeans_after_prefill_ms": (total_k - in_prefill) / 1e3,
        "gpu_busy_during_kmeans_ms": gpu_during_k / 1e3,
        "gpu_busy_fraction_during_kmeans": gpu_during_k / total_k if total_k else None,
        "first_kmeans_start_after_prefill_start_ms": (kmeans[0][0] - p_start) / 1e3 if kmeans else None,
        "last_kmeans_end_after_prefill_end_ms": (last_k_end - p_end) / 1e3,
        "first_decode_step_ms": decode_ms[0] if decode_ms else None,
        "later_decode_steps_mean_ms": sum(decode_ms[1:]) / len(decode_ms[1:]) if len(decode_ms) > 1 else None,
        "main_stream": main_stream,
        "h2d_copies_by_stream": by_stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama31_8b_shape")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("overlap"))
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from kvbench.bench import niah_ids
    from kvbench.budget import BudgetConfig
    from kvbench.compose import compose
    from kvbench.engine.context import GenerationContext
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method
    from kvbench.models.loading import load_model

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    loaded = load_model(compose([f"model={args.model}"])["model"])
    ids = niah_ids(loaded, args.length)

    def run(name: str, n: int = args.new_tokens, prompt: list[int] = ids, method: Any = None) -> dict[str, Any]:
        budget = BudgetConfig(**(BUDGET if name == "pqcache" else {}))
        method = method or create_method({"name": name})
        out = generate(loaded, method, prompt, max_new_tokens=n, min_new_tokens=n, budget=budget)
        return out.telemetry

    run("full", 2, ids[:2048])  # warm-up: kernels, allocator, PQCache's cost model
    run("pqcache", 2, ids[:4096])
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for method in ("full", "pqcache"):
            tele = run(method)
            row = best.setdefault(method, {"ttft_s": float("inf"), "tt2t_s": float("inf")})
            row["ttft_s"] = min(row["ttft_s"], tele["ttft_s"])
            row["tt2t_s"] = min(row["tt2t_s"], tele["tt2t_s"])
            if method == "pqcache":
                row["wait_kmeans_s"] = tele["method"].get("wait_kmeans_s", float("nan"))
                row["kmeans_s"] = tele["method"].get("kmeans_s", float("nan"))
    trace = args.out / "trace.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    stamps: list[float] = []
    original = GenerationContext.prefill

    def stamped(self: Any, *a: Any, **k: Any) -> Any:
        stamps.append(time.perf_counter())
        return original(self, *a, **k)

    method = create_method({"name": "pqcache"})
    GenerationContext.prefill = stamped  # type: ignore[method-assign]
    try:
        with profile(activities=activities) as prof:
            run("pqcache", method=method)
    finally:
        GenerationContext.prefill = original  # type: ignore[method-assign]
    shares = [(s.started, s.ended) for layer in method.layers.values() for f in layer.job.futures for s in [f.result()]]
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        packed.write(raw.read())
    trace.unlink()
    summary = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "prompt": len(ids),
        "new_tokens": args.new_tokens,
        "budget": BUDGET,
        "timed": best,
        "tt2t_pqcache_over_ttft_full": best["pqcache"]["tt2t_s"] / best["full"]["ttft_s"],
        "tt2t_pqcache_over_tt2t_full": best["pqcache"]["tt2t_s"] / best["full"]["tt2t_s"],
        "trace": read_trace(Path(f"{trace}.gz"), shares, stamps[0]),
        "wall_s": time.perf_counter() - started,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
