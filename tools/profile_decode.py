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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
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
    print(
        f"prompt {len(ids)} tokens, {args.new_tokens} new, best of {args.rounds} alternating rounds, "
        f"{torch.get_num_threads()} torch threads"
    )
    print_table(best, methods)
    for method in methods:
        if args.cprofile:
            cprofile_decode(partial(run, method), method, args.cprofile)
        if args.torch_profile:
            torch_profile_decode(partial(run, method), method, args.torch_profile)


def print_table(best: dict[str, dict[str, Any]], methods: list[str]) -> None:
    """Per-step TPOT, its ratio to full's and its parts; then each method's own timers per step."""
    full = best["full"]["tpot_s"]
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


@contextmanager
def decode_steps(enter: Callable[[], None], leave: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Calls ``enter`` / ``leave`` around every decode step of the runs inside: the static step
    (``StaticDecoder.step``) and the dynamic one (``GenerationContext.forward``, which runs the static
    step itself when it is one: counted once). The prefill goes through ``run_prefill``, not these."""
    from kvbench.engine.context import GenerationContext
    from kvbench.engine.decode import StaticDecoder

    depth = [0]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *a: Any, **k: Any) -> Any:
            depth[0] += 1
            if depth[0] == 1:
                enter()
            try:
                return original(self, *a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    leave()

        return wrapped

    originals = (GenerationContext.forward, StaticDecoder.step)
    GenerationContext.forward = wrap(originals[0])  # type: ignore[method-assign]
    StaticDecoder.step = wrap(originals[1])  # type: ignore[method-assign]
    try:
        yield
    finally:
        GenerationContext.forward, StaticDecoder.step = originals  # type: ignore[method-assign]


def cprofile_decode(run: Callable[[], Any], method: str, top: int) -> None:
    """One run under cProfile, its decode steps only; prints the ``top`` functions by own time."""
    profiler = cProfile.Profile()
    started = time.perf_counter()
    with decode_steps(profiler.enable, profiler.disable):
        run()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    print(f"==== cProfile {method} ({time.perf_counter() - started:.1f} s run) ====")
    print(stream.getvalue())


def torch_profile_decode(run: Callable[[], Any], method: str, top: int) -> None:
    """One run under torch.profiler from its first decode step to its end; the ``top`` ops by own CPU
    time (and CUDA time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    started: list[bool] = []

    def first_step() -> None:
        if not started:
            prof.start()
            started.append(True)

    with decode_steps(first_step):
        run()
    if not started:
        print(f"==== torch.profiler {method}: no decode step ran ====")
        return
    prof.stop()
    print(f"==== torch.profiler {method} ====")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
