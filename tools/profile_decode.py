"""Where a retrieval method's decode step goes: TPOT vs ``full`` and the select / fetch / compute split.

Usage (from the repository root)::

    .venv/bin/python tools/profile_decode.py --length 8000 --methods oracle,pqcache,clusterkv
    .venv/bin/python tools/profile_decode.py --length 8000 --methods pqcache --cprofile 25
    .venv/bin/python tools/profile_decode.py --length 8000 --methods pqcache --torch-profile 25

Every method runs on the same NIAH prompt (SmolLM2, depth 0.5) with the e2e benches' budgets; runs of
``full`` and the methods alternate ``--rounds`` times so that a shared machine's load drifts over both
alike, and the best TPOT of each is reported with its ratio to ``full``'s. ``--cprofile N`` /
``--torch-profile N`` profile the decode steps (prefill excluded) of one more run per method and print
the top N entries. Not a benchmark (``kvbench bench`` is): a tool to find hot spots.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import Any

import torch

#: the e2e benches' budgets (kvbench/bench/retrieval.py), and the same for the other selectors
BUDGETS: dict[str, dict[str, Any]] = {
    "full": {},
    "oracle": {"token_ratio": 0.2},
    "pqcache": {"token_ratio": 0.2, "comm_ratio": 1 / 128},
    "clusterkv": {"tokens": 1024},
    "quest": {"tokens": 1024},
    "sparq": {"token_ratio": 0.2, "comm_ratio": 1 / 128},
    "infllm": {"token_ratio": 0.2, "comm_ratio": 1 / 128},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--methods", default="oracle,pqcache,clusterkv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--cprofile", type=int, default=0, help="profile decode with cProfile; print top N")
    parser.add_argument("--torch-profile", type=int, default=0, help="profile decode with torch.profiler; top N")
    args = parser.parse_args()
    if args.threads:  # one thread: steadier ratios on a loaded machine (no spinning thread pool)
        torch.set_num_threads(args.threads)

    from kvbench.bench import niah_ids
    from kvbench.budget import BudgetConfig
    from kvbench.compose import compose
    from kvbench.engine import generate as gen
    from kvbench.methods import create_method
    from kvbench.models.loading import load_model

    loaded = load_model(compose([f"model={args.model}"])["model"])
    ids = niah_ids(loaded, args.length)
    methods = ["full"] + [m for m in args.methods.split(",") if m and m != "full"]

    def run(method: str) -> dict[str, Any]:
        out = gen.generate(
            loaded,
            create_method({"name": method}),
            ids,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            budget=BudgetConfig(**BUDGETS[method]),
        )
        return out.telemetry

    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for method in methods:
            tele = run(method)
            if method not in best or tele["tpot_s"] < best[method]["tpot_s"]:
                best[method] = tele
    full = best["full"]["tpot_s"]
    print(
        f"prompt {len(ids)} tokens, {args.new_tokens} new, best of {args.rounds} alternating rounds, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(f"{'method':10} {'tpot_ms':>8} {'ratio':>6} {'select_ms':>9} {'fetch_ms':>8} {'compute_ms':>10}  (per step)")
    for method in methods:
        t = best[method]
        steps = t["decode_steps"]
        print(
            f"{method:10} {1e3 * t['tpot_s']:8.2f} {t['tpot_s'] / full:6.3f} {1e3 * t['select_s'] / steps:9.2f} "
            f"{1e3 * t['fetch_s'] / steps:8.2f} {1e3 * t['compute_s'] / steps:10.2f}"
        )
    for method in methods:  # a method's own timers (pqcache: pq_search_s, encode_s, ...), per step
        timers = {k: v for k, v in (best[method].get("method") or {}).items() if k.endswith("_s") and v}
        if timers:
            steps = best[method]["decode_steps"]
            print(f"  {method}: " + ", ".join(f"{k[:-2]} {1e3 * v / steps:.2f} ms/step" for k, v in timers.items()))

    if not (args.cprofile or args.torch_profile):
        return
    # profile only the decode loop: wrap GenerationContext.forward (the prefill goes through run_prefill)
    from kvbench.engine.context import GenerationContext

    original = GenerationContext.forward
    for method in methods:
        if args.cprofile:
            profiler = cProfile.Profile()

            def forward(self, *a, _p=profiler, **k):
                _p.enable()
                try:
                    return original(self, *a, **k)
                finally:
                    _p.disable()

            GenerationContext.forward = forward  # type: ignore[method-assign]
            started = time.perf_counter()
            run(method)
            GenerationContext.forward = original  # type: ignore[method-assign]
            stream = io.StringIO()
            stats = pstats.Stats(profiler, stream=stream).sort_stats("tottime")
            stats.print_stats(args.cprofile)
            print(f"==== cProfile {method} ({time.perf_counter() - started:.1f} s run) ====")
            print(stream.getvalue())
        if args.torch_profile:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            started_at: list[bool] = []

            def forward(self, *a, _p=prof, _s=started_at, **k):
                if not _s:  # the first decode step: profile from here to the end of the run
                    _p.start()
                    _s.append(True)
                return original(self, *a, **k)

            GenerationContext.forward = forward  # type: ignore[method-assign]
            run(method)
            GenerationContext.forward = original  # type: ignore[method-assign]
            prof.stop()
            print(f"==== torch.profiler {method} ====")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.torch_profile))
            if cuda:
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.torch_profile))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
