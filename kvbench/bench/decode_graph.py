"""``decode_graph``: the static decode step eager and replayed as a CUDA graph, against the memory roofline.

On a GPU, per method and prompt length (``--model``, ``--lengths``, ``--methods``, ``--new-tokens``;
default ``full`` on ``llama31_8b_shape`` at 32k, bf16):

* ``eager_tpot_ms`` / ``graph_tpot_ms`` — TPOT of the static step run eagerly (``engine.cuda_graph=false``)
  and replayed from captured graphs (``true``), best of the rounds, the two modes interleaved;
  ``tokens_identical``: the two generate the same tokens;
* ``replay_syncs`` — ``torch.cuda.set_sync_debug_mode("error")`` is on while every decode step after the
  first runs (graph replays and the eager steps that warm a regime up): a step that waits for the device
  fails the row (``sync: <error>``), reads between steps (every ``engine.readback_every`` tokens) excepted;
* ``roofline_ms`` — the bytes a step must read (the weights once, and the K/V the step attends: the whole
  cache for ``full``, the attended tokens for a selection) over the device's copy bandwidth, measured here
  with a 1 GiB device-to-device copy; ``graph / roofline`` is how close the step runs to it;
* ``--param kernels=sdpa,matmul,split`` runs every row with each decode attention kernel
  (``engine.decode_attention``), side by side; ``tpot / full`` is against ``full`` with the same kernel;
* ``--param profile=N``: after each row, one eager generation profiled over its decode steps 3-18
  (torch.profiler), the N ops with the most device time printed (where a selection's time goes);
* with ``--param compile=true``, transformers' ``StaticCache`` decode under
  ``torch.compile(mode="reduce-overhead")`` on the same prompt (``hf_compiled_tpot_ms``), the field's
  reference for a captured decode step.

On a CPU the bench runs its path at a small size (``tiny_llama``, 1k tokens) with graphs marked ``n/a``:
what ``benchmarks/gpu.sh decode_graph`` runs is tested without a GPU.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import time
from contextlib import contextmanager
from typing import Any

import torch

from kvbench.bench import BenchOptions, BenchResult, bench_device, benchmark, niah_ids
from kvbench.errors import ConfigError

WARM_TOKENS = 16


@contextmanager
def _wrapped_step(wrap: Any) -> Any:
    """``StaticDecoder.step`` replaced by ``wrap(original)`` inside the block, restored after it."""
    from kvbench.engine.decode import StaticDecoder

    original = StaticDecoder.step
    StaticDecoder.step = wrap(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        StaticDecoder.step = original  # type: ignore[method-assign]


@contextmanager
def _sync_errors(on: bool) -> Any:
    """Sync debug mode ``error`` around every decode step after a generation's first (CUDA only)."""
    if not on:
        yield
        return

    def wrap(original: Any) -> Any:
        def step(self: Any, feed: int | None = None, timed: bool = True) -> torch.Tensor:
            if self.steps == 0:  # the first step of a generation may allocate (buffers, lazy library state)
                return original(self, feed, timed)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(self, feed, timed)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return step

    with _wrapped_step(wrap):
        yield


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes per second a device-to-device copy of 1 GiB moves (read + write), best of 5; None on a CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def step_bytes(loaded: Any, telemetry: dict[str, Any]) -> int:
    """Bytes a decode step reads at least: every weight once, and the K/V of the tokens each layer attends."""
    model = loaded.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    element = next(model.parameters()).element_size()
    spec = loaded.spec
    attended = sum(a for a in telemetry["attended_per_layer"] if a is not None)
    return weights + int(attended * 2 * spec.n_kv_heads * spec.head_dim * element)


def _hf_compiled(loaded: Any, ids: list[int], new_tokens: int) -> float:
    """TPOT of transformers' StaticCache decode under torch.compile(mode="reduce-overhead")."""
    model = loaded.model
    device = torch.device(loaded.spec.device)
    prompt = torch.tensor([ids], device=device)
    forward = model.forward
    model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    try:

        def timed(n: int) -> float:
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static")
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        timed(WARM_TOKENS)  # compilation and capture
        timed(WARM_TOKENS)
        return (timed(new_tokens) - timed(2)) / (new_tokens - 2)
    finally:
        model.forward = forward


def _method_row(
    run: Any,
    name: str,
    ids: list[int],
    modes: dict[str, bool],
    rounds: int,
    new_tokens: int,
    cuda: bool,
    loaded: Any,
    bandwidth: float | None,
) -> dict[str, Any]:
    """One method's eager and graph TPOT at one prompt, the two modes interleaved, against the roofline."""
    outs: dict[str, list[Any]] = {mode: [] for mode in modes}
    errors: dict[str, str] = {}
    for mode, graphs in modes.items():
        try:
            run(name, ids, WARM_TOKENS, graphs)  # warm-up: kernels, allocator, cost models
        except RuntimeError as error:
            errors[mode] = str(error).splitlines()[0][:160]
    for _ in range(rounds):
        for mode, graphs in modes.items():
            if mode not in errors:
                outs[mode].append(run(name, ids, new_tokens, graphs))
    row: dict[str, Any] = {}
    for mode in modes:
        tpots = [o.telemetry["tpot_s"] for o in outs[mode]]
        row[f"{mode}_tpot_ms"] = 1e3 * min(tpots) if tpots else errors.get(mode)
    if not cuda:
        row["graph_tpot_ms"] = "n/a (no CUDA)"
    elif outs["eager"] and outs["graph"]:
        row["graph / eager"] = row["graph_tpot_ms"] / row["eager_tpot_ms"]
        eager, graph = outs["eager"][0].tokens, outs["graph"][0].tokens
        row["tokens_identical"] = eager == graph
        # how many leading tokens agree (bf16 kernels chosen under capture may round differently; a
        # random-weight model's near-flat logits then flip a later argmax)
        row["identical_prefix"] = next((i for i, (a, b) in enumerate(zip(eager, graph)) if a != b), len(eager))
        # two runs of one mode (rounds >= 2) tell a kernel that rounds differently from run to run from a
        # difference between the modes
        for mode in ("eager", "graph"):
            if len(outs[mode]) >= 2:
                row[f"{mode}_repeats"] = outs[mode][0].tokens == outs[mode][1].tokens
    row["replay_syncs"] = "error: " + errors["graph"] if "graph" in errors else ("0" if cuda else "n/a")
    best = min((o for mode in modes for o in outs[mode]), key=lambda o: o.telemetry["tpot_s"], default=None)
    if bandwidth and best is not None:
        roofline = step_bytes(loaded, best.telemetry) / bandwidth
        row["roofline_ms"] = 1e3 * roofline
        row["best / roofline"] = best.telemetry["tpot_s"] / roofline
    return row


def _profiled(run: Any, name: str, ids: list[int], kernel: str, top: int, cuda: bool) -> str:
    """Where an eager static step's time goes: torch.profiler over decode steps 3-18 of one generation
    (the prefill and the first steps left out), the ``top`` ops by their own device time (CPU time on a
    CPU). Eager, so that every kernel shows apart (a replayed graph runs the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    started: list[bool] = []

    def wrap(original: Any) -> Any:
        def step(self: Any, feed: int | None = None, timed: bool = True) -> torch.Tensor:
            if self.steps == 2 and not started:
                if cuda:
                    torch.cuda.synchronize()
                prof.start()
                started.append(True)
            return original(self, feed, timed)

        return step

    try:
        with _wrapped_step(wrap):
            run(name, ids, 18, False, kernel=kernel)
    finally:
        if started:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=top))


def method_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """``--methods`` entry ``name`` or ``name:key=value[:key=value]`` (one method's own parameters, e.g.
    ``quest:scoring=gemv`` beside ``quest`` in one run) -> the method's name and its parameters."""
    import yaml

    name, *pairs = entry.split(":")
    own: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"decode_graph: method entry {entry!r} is not name:key=value", "e.g. quest:scoring=gemv")
        own[key] = yaml.safe_load(value)
    return name, own


@benchmark("decode_graph")
def decode_graph(options: BenchOptions) -> BenchResult:
    from kvbench.budget import BudgetConfig
    from kvbench.compose import compose
    from kvbench.engine.generate import generate
    from kvbench.engine.settings import engine_settings
    from kvbench.methods import create_method
    from kvbench.models.loading import load_model

    device = bench_device(options)
    cuda = device.type == "cuda"
    model_name = options.model or ("llama31_8b_shape" if cuda else "tiny_llama")
    lengths = options.lengths or ((32768,) if cuda else (1024,))
    new_tokens = options.new_tokens or (256 if cuda else 12)
    rounds = options.e2e_rounds()
    methods = list(options.methods or ("full",))
    entries = {entry: method_entry(entry) for entry in methods}  # (a bad entry is one line, before the model loads)
    loaded = load_model(compose([f"model={model_name}", f"model.device={device.type}"])["model"])
    bandwidth = copy_bandwidth(device)
    params = {k: v for k, v in options.params.items() if k not in ("compile", "kernels", "profile")}
    kernels = str(options.params.get("kernels", options.engine.get("decode_attention", "sdpa"))).split(",")
    modes = {"eager": False, "graph": True} if cuda else {"eager": False}

    def run(name: str, ids: list[int], n: int, graphs: bool, kernel: str) -> Any:
        engine = engine_settings({**options.engine, "cuda_graph": graphs, "decode_attention": kernel})
        budget = BudgetConfig() if name == "full" else BudgetConfig(tokens=1024, comm_ratio=1 / 128)
        base, own = entries[name]
        method = create_method({"name": base} if base == "full" else {"offload": False, **params, **own, "name": base})
        try:
            with _sync_errors(cuda and graphs):
                return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, budget=budget, engine=engine)
        finally:
            if cuda:  # a request's context and its decoder refer to each other: free its buffers before the next
                gc.collect()
                torch.cuda.empty_cache()

    rows = []
    for length in lengths:
        ids = niah_ids(loaded, length)
        for kernel, name in [(kernel, name) for kernel in kernels for name in methods]:
            row: dict[str, Any] = {"model": model_name, "prompt": len(ids), "method": name, "kernel": kernel}
            try:
                measure = functools.partial(run, kernel=kernel)
                row.update(_method_row(measure, name, ids, modes, rounds, new_tokens, cuda, loaded, bandwidth))
            except RuntimeError as error:  # out of memory, a failed capture: the other rows still run
                row["error"] = str(error).splitlines()[0][:200]
            print("decode_graph row:", json.dumps(row, default=str), file=sys.stderr, flush=True)
            if name == "full" and kernel == kernels[0] and cuda and options.params.get("compile"):
                try:
                    row["hf_compiled_tpot_ms"] = 1e3 * _hf_compiled(loaded, ids, new_tokens)
                except Exception as error:  # the reference failing is a field of the row, not the end of the bench
                    row["hf_compiled_tpot_ms"] = f"error: {str(error).splitlines()[0][:160]}"
                print("decode_graph compiled:", row["hf_compiled_tpot_ms"], file=sys.stderr, flush=True)
            rows.append(row)  # (each row printed as it finishes: a step stopped at its limit keeps what it measured)
            if options.params.get("profile"):
                table = _profiled(run, name, ids, kernel, int(options.params["profile"]), cuda)
                print(
                    f"decode_graph profile: {name} ({kernel}), {len(ids)} tokens\n{table}", file=sys.stderr, flush=True
                )
            if cuda:
                torch.cuda.empty_cache()
    full_rows = {(r["prompt"], r["kernel"]): r for r in rows if r["method"] == "full"}
    for row in rows:
        base = full_rows.get((row["prompt"], row["kernel"]))
        key = "graph_tpot_ms" if cuda else "eager_tpot_ms"
        if base is not None and row is not base and isinstance(row.get(key), float):
            row["tpot / full"] = row[key] / base[key]
    notes = [
        f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'CPU'}), {loaded.spec.dtype}; "
        f"{new_tokens} new tokens, best of {rounds} round(s) per mode after a {WARM_TOKENS}-token warm-up",
        "methods other than full: budget.tokens=1024, comm_ratio=1/128, offload false (device-resident KV)",
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (1 GiB device copy)" if bandwidth else "no GPU: graph rows n/a",
        f"engine: {options.engine or 'defaults'}; method parameters: {params or 'defaults'}",
    ]
    return BenchResult("decode_graph", "static decode: eager vs CUDA graph replay, and the roofline", rows, notes)
