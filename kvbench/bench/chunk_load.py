"""Chunk KV loading: each storage tier's throughput, and pipelined vs serial loading in a CacheBlend prefill.

* ``chunk_load`` — what each tier of the chunk store delivers on this machine for chunks shaped like
  the model's (:func:`kvbench.kv.chunks.measure_tiers`): RAM (a copy into fresh memory; on a GPU,
  host → device), the disk with cold reads, and the disk throttled to slower devices
  (``store.read_mbps``, an emulation: real reads padded with sleep). Per tier: MB/s, one layer's load
  time for a 512-token chunk, and the recompute ratio at which recomputing that layer takes as long
  as loading it (the loading controller's ``r_load``, from a measured dense prefill of the same model).
* ``reuse_pipeline`` — CacheBlend (r = 0.15) on one chunked prompt with its chunk caches on disk,
  ``store.pipeline`` on and off, alternated in the same process so that load on the machine hits
  both alike; the ratio of TTFTs, the load time, how much of it was hidden behind compute, and the
  controller's predicted per-layer load vs recompute time next to the measured ones.
* ``recompute_cost`` — the controller's linear cost model against measured CacheBlend prefills, and
  the per-token dense prefill cost against the prompt length.
* ``prefill_batch`` — CacheBlend Fig. 15(c): prefill time against the batch size, beside the decode
  time of the same batch (``--save`` draws the figure).

Prompts are random token ids (timing does not depend on the text): a 32-token prefix, six 512-token
chunks, a 32-token query (``--quick``: tiny_llama, three 64-token chunks). ``--model`` picks the model.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from kvbench.bench import BenchOptions, BenchResult, benchmark

#: the throttled-disk speeds (MB/s) measured besides RAM and the unthrottled disk
THROTTLES = (1000.0, 200.0, 50.0)


def _load_average() -> str:
    """The 1/5/15-minute load averages: timings on a shared machine are read against them."""
    import os

    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _load(options: BenchOptions) -> Any:
    from kvbench.compose import compose
    from kvbench.models.loading import load_model

    name = options.model or ("tiny_llama" if options.quick else "smollm2_135m")
    return load_model(compose([f"model={name}"])["model"])


def _segments(loaded: Any, quick: bool) -> tuple[Any, ...]:
    from kvbench.requests import Segment

    sizes = (8, 64, 64, 64, 8) if quick else (32, 512, 512, 512, 512, 512, 512, 32)
    vocab = min(int(loaded.model.config.vocab_size), 32000)
    ids = torch.randint(100, vocab, (sum(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    roles = ["prefix"] + ["chunk"] * (len(sizes) - 2) + ["query"]
    out, at = [], 0
    for size, role in zip(sizes, roles):
        out.append(Segment(tuple(ids[at : at + size]), role))
        at += size
    return tuple(out)


def _prefill_s(loaded: Any, ids: list[int], repeats: int) -> float:
    from kvbench.engine.generate import prefill_kv

    prefill_kv(loaded, ids[:64])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        prefill_kv(loaded, ids)
        best = min(best, time.perf_counter() - started)
    return best


@benchmark("chunk_load")
def chunk_load(options: BenchOptions) -> BenchResult:
    from kvbench.kv.chunks import StoreConfig, measure_tiers
    from kvbench.requests import join_segments

    loaded = _load(options)
    spec = loaded.spec
    dtype = next(loaded.model.parameters()).dtype
    tokens = 64 if options.quick else 512
    ids = join_segments(_segments(loaded, options.quick))
    prefill = _prefill_s(loaded, ids, 1 if options.quick else 2)
    token_layer_s = prefill / (len(ids) * spec.n_layers)
    rows = []
    settings: list[tuple[str, float | None]] = [("ram", None), ("disk", None)] + [("disk", mbps) for mbps in THROTTLES]
    for tier, mbps in settings:
        measured = measure_tiers(
            StoreConfig(read_mbps=mbps),
            kv_heads=spec.n_kv_heads,
            tokens=tokens,
            head_dim=spec.head_dim,
            layers=min(4, spec.n_layers),
            dtype=dtype,
            device=spec.device,
            repeats=max(1, options.repeats if not options.quick else 1),
        )[tier]
        recompute_layer_s = tokens * token_layer_s  # the whole chunk recomputed in one layer
        rows.append(
            {
                "model": spec.name,
                "tier": tier if mbps is None else f"disk@{mbps:g}MB/s",
                "MB/s": measured["mbps"],
                "layer_ms": 1e3 * measured["layer_s"],
                "layer_bytes": int(measured["layer_bytes"]),
                "recompute_layer_ms": 1e3 * recompute_layer_s,
                "r_load": measured["layer_s"] / recompute_layer_s,
            }
        )
    notes = [
        f"one layer of a {tokens}-token chunk ({spec.n_kv_heads} KV heads x {spec.head_dim}, {dtype}); best of "
        f"{max(1, options.repeats)} passes over {min(4, spec.n_layers)} layers",
        "ram: copy into fresh memory on the device (CPU: memcpy); disk: cold read (page cache dropped), "
        "disk@N: the same read padded with sleep to N MB/s (an emulation of a slower device)",
        f"recompute_layer_ms: the chunk's tokens through one layer at the measured dense-prefill cost "
        f"({1e6 * token_layer_s:.2f} us per token per layer, {len(ids)}-token prompt); r_load = load / recompute",
        f"device {spec.device}; load average {_load_average()}",
    ]
    return BenchResult("chunk_load", "chunk KV load throughput per storage tier", rows, notes)


def _pipeline_row(
    loaded: Any, segments: Any, ids: list[int], runs: dict[bool, list[dict[str, Any]]], mbps: float | None
) -> dict[str, Any]:
    """:func:`reuse_pipeline`'s row for one disk speed: medians of the pipelined and serial rounds, and
    the loading controller's choice from the measured load rate."""
    from kvbench.methods.cacheblend import Costs, LoadingController

    on = {
        k: statistics.median(r[k] for r in runs[True])
        for k in ("ttft_s", "load_s", "load_wait_s", "load_hidden_s", "recompute_s")
    }
    off = {k: statistics.median(r[k] for r in runs[False]) for k in ("ttft_s", "load_s", "recompute_s")}
    per_load = statistics.median(statistics.median(x for x in r["load_per_layer_s"] if x > 0) for r in runs[True])
    per_recompute = statistics.median(statistics.median(r["recompute_per_layer_s"][2:]) for r in runs[True])
    spec = loaded.spec
    element = next(loaded.model.parameters()).element_size()
    n_cached = sum(len(s) for s in segments if s.role != "query")
    per_token = 2 * spec.n_kv_heads * spec.head_dim * element
    costs = Costs(
        prefill_s=_prefill_s(loaded, ids, 1),
        tokens=len(ids),
        n_layers=spec.n_layers,
        bytes_per_token_layer=per_token,
        tier_mbps={"disk": per_token * n_cached / per_load / 1e6},
    )
    choice = LoadingController(costs, 0.15).choose(len(ids), n_cached, "disk")
    return {
        "model": spec.name,
        "tier": "disk" if mbps is None else f"disk@{mbps:g}MB/s",
        "prompt": len(ids),
        "ttft_pipelined_s": on["ttft_s"],
        "ttft_serial_s": off["ttft_s"],
        "pipelined/serial": on["ttft_s"] / off["ttft_s"],
        "load_s": on["load_s"],
        "load_hidden_s": on["load_hidden_s"],
        "load_wait_s": on["load_wait_s"],
        "serial_load_s": off["load_s"],
        "recompute_s": on["recompute_s"],
        "load_layer_ms": 1e3 * per_load,
        "recompute_layer_ms": 1e3 * per_recompute,
        "predicted_recompute_layer_ms": 1e3 * choice["recompute_layer_s"]["r_star"],
        "controller_ratio": choice["ratio"],
    }


@benchmark("reuse_pipeline")
def reuse_pipeline(options: BenchOptions) -> BenchResult:
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.kv.chunks import ChunkStore, StoreConfig
    from kvbench.methods import create_method
    from kvbench.methods.reuse import ReuseMethod
    from kvbench.requests import join_segments

    loaded = _load(options)
    segments = _segments(loaded, options.quick)
    ids = join_segments(segments)
    rounds = 1 if options.quick else max(2, options.repeats)
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="kvbench-pipeline-") as folder:
        for mbps in (None, 200.0) if not options.quick else (None,):
            store = ChunkStore(StoreConfig(tier="disk", dir=folder, read_mbps=mbps))
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}

            def once(pipeline: bool) -> dict[str, Any]:
                store.config = replace(store.config, pipeline=pipeline)
                method = create_method({"name": "cacheblend", "recompute_ratio": 0.15})
                assert isinstance(method, ReuseMethod)
                method.attach_store(store)
                out = generate(loaded, method, ids, max_new_tokens=1, segments=segments, budget=BudgetConfig())
                return {"ttft_s": out.telemetry["ttft_s"], **out.telemetry["prefill"]}

            once(True)  # precomputes the chunk caches (outside TTFT) and warms up
            for index in range(rounds):
                order = (True, False) if index % 2 == 0 else (False, True)
                for pipeline in order:
                    runs[pipeline].append(once(pipeline))
            rows.append(_pipeline_row(loaded, segments, ids, runs, mbps))
    notes.append(
        f"cacheblend r=0.15, chunk caches on disk (cold reads), medians of {rounds} alternated rounds per "
        "setting; TTFT excludes chunk precomputation"
    )
    notes.append(
        "load_hidden_s = load time minus the main thread's wait for loads; recompute_layer_ms: median "
        "layer time after the check layer; predicted_recompute_layer_ms: r* x (dense prefill / layers), "
        "the controller's model; controller_ratio: max(r_load, 0.15) with the measured load rate"
    )
    notes.append(
        f"device {loaded.spec.device}; torch threads {torch.get_num_threads()}; on a CPU the loader "
        f"thread shares the cores with compute; load average {_load_average()} (at the end)"
    )
    return BenchResult("reuse_pipeline", "CacheBlend TTFT with pipelined vs serial chunk loading", rows, notes)


@benchmark("recompute_cost")
def recompute_cost(options: BenchOptions) -> BenchResult:
    """What recomputing costs on this machine: the loading controller's cost model checked, and the
    per-token prefill cost against the prompt length (the question behind CacheBlend Fig. 15c).

    Rows ``dense``: a dense prefill of the first n tokens of the prompt, per token and layer — flat in n
    means the cores are already saturated by one request, so prefilling B requests together could not
    take less than B times as long. Rows ``cacheblend``: TTFT at each ratio r (chunks in RAM) against the
    controller's linear model, ``Prefill(n) · (c + (L - c) · r') / L`` with c full layers before and at
    the check layer and r' the share of rows recomputed after it (r of the context plus the query)."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.kv.chunks import ChunkStore, StoreConfig
    from kvbench.methods import create_method
    from kvbench.methods.reuse import ReuseMethod
    from kvbench.requests import join_segments

    loaded = _load(options)
    spec = loaded.spec
    segments = _segments(loaded, options.quick)
    ids = join_segments(segments)
    n, query = len(ids), len(segments[-1])
    rounds = 1 if options.quick else max(2, options.repeats)
    rows = []
    lengths = sorted({max(16, n // 4), max(32, n // 2), n})
    for length in lengths:
        best = _prefill_s(loaded, ids[:length], rounds)
        rows.append(
            {
                "model": spec.name,
                "run": "dense",
                "tokens": length,
                "r": 1.0,
                "ttft_s": best,
                "us_per_token_layer": 1e6 * best / (length * spec.n_layers),
            }
        )
    prefill = rows[-1]["ttft_s"]
    store = ChunkStore(StoreConfig(tier="ram"))
    ratios = (0.15, 0.5) if options.quick else (0.05, 0.15, 0.3, 0.5)
    times: dict[float, list[float]] = {r: [] for r in ratios}
    for index in range(rounds + 1):  # the first round precomputes the chunks and warms up
        for r in ratios if index % 2 == 0 else tuple(reversed(ratios)):
            method = create_method({"name": "cacheblend", "recompute_ratio": r})
            assert isinstance(method, ReuseMethod)
            method.attach_store(store)
            out = generate(loaded, method, ids, max_new_tokens=1, segments=segments, budget=BudgetConfig())
            if index:
                times[r].append(out.telemetry["ttft_s"])
    check = 2  # layers 0 and 1 run in full (check_layer 1)
    for r in ratios:
        share = (int((n - query) * r) + query) / n
        model_s = prefill * (check + (spec.n_layers - check) * share) / spec.n_layers
        measured = statistics.median(times[r])
        rows.append(
            {
                "model": spec.name,
                "run": "cacheblend",
                "tokens": n,
                "r": r,
                "ttft_s": measured,
                "us_per_token_layer": None,
                "model_s": model_s,
                "measured/model": measured / model_s,
                "ttft/full": measured / prefill,
            }
        )
    notes = [
        f"dense: best of {rounds}; cacheblend: median of {rounds} alternated rounds, chunks in RAM, "
        f"{spec.n_layers} layers; model_s: the controller's linear cost model from the dense prefill of "
        f"{n} tokens",
        f"device {spec.device}; load average {_load_average()}",
    ]
    return BenchResult(
        "recompute_cost", "recompute cost: the controller's model vs measured, per-token prefill cost", rows, notes
    )


#: the batch sizes of ``prefill_batch`` (``--quick``: the first two)
BATCHES = (1, 2, 4)
#: the decode steps a batch's prefill is weighed against in ``prefill_batch`` (CacheBlend's answers: a few words)
DECODE_STEPS = 32


def batched_dense(loaded: Any, ids: list[int], batch: int, steps: int) -> tuple[float, float, torch.Tensor]:
    """Seconds of one batched dense prefill of ``batch`` copies of ``ids`` (the stock transformers
    forward, the model's own attention, ``logits_to_keep=1``) and of ``steps`` greedy decode steps of
    the batch after it, and the tokens generated (``[batch, steps + 1]``: what ``full`` generates)."""
    model = loaded.model
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    prompt = torch.tensor([ids] * batch, dtype=torch.long, device=device)
    with torch.inference_mode():
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        if cuda:
            torch.cuda.synchronize()
        prefill = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens = [token]
        started = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        if cuda:
            torch.cuda.synchronize()
        decode = time.perf_counter() - started
    return prefill, decode, torch.cat(tokens, dim=1).cpu()


@benchmark("prefill_batch")
def prefill_batch(options: BenchOptions) -> BenchResult:
    """CacheBlend Fig. 15(c): prefill time against the batch size B, with the decode it is weighed against.

    For B requests of one chunked prompt: ``full_prefill_s`` — one batched dense prefill of the B
    prompts (the stock transformers forward, batch B); ``decode_s`` — the batch's ``DECODE_STEPS``
    greedy decode steps after it; ``cacheblend_prefill_s`` — CacheBlend's prefill (r = 0.15, chunks in
    RAM) of the B requests. kvbench's engine serves one request at a time, so CacheBlend's B prefills
    run back to back: B × its median batch-1 TTFT, measured in the same process (on a CPU, whose cores
    one request already saturates, a batched dense prefill is no faster per request either — the
    ``full_prefill_s / B`` column shows it). The paper's point: prefill grows with the batch faster
    than decode does (decode reads the weights once per step for the whole batch), so prefill takes a
    growing share of a batch's time and CacheBlend's saving grows with it."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.kv.chunks import ChunkStore, StoreConfig
    from kvbench.methods import create_method
    from kvbench.methods.reuse import ReuseMethod
    from kvbench.requests import join_segments

    loaded = _load(options)
    spec = loaded.spec
    segments = _segments(loaded, options.quick)
    ids = join_segments(segments)
    rounds = 1 if options.quick else max(2, min(options.repeats, 3))
    batches = BATCHES[:2] if options.quick else BATCHES
    steps = 4 if options.quick else DECODE_STEPS
    batched_dense(loaded, ids[:64], 1, 2)  # warm-up
    dense: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    blend: list[float] = []
    serial: list[float] = []  # full recompute through the engine, one request (kvbench's `full`)
    store = ChunkStore(StoreConfig(tier="ram"))
    for index in range(rounds + 1):  # round 0 precomputes CacheBlend's chunks (and is not timed)
        method = create_method({"name": "cacheblend", "recompute_ratio": 0.15})
        assert isinstance(method, ReuseMethod)
        method.attach_store(store)
        out = generate(loaded, method, ids, max_new_tokens=1, segments=segments, budget=BudgetConfig())
        if index:
            blend.append(out.telemetry["ttft_s"])
            full = generate(loaded, create_method({"name": "full"}), ids, max_new_tokens=1, budget=BudgetConfig())
            serial.append(full.telemetry["ttft_s"])
            for b in batches if index % 2 else tuple(reversed(batches)):
                dense[b].append(batched_dense(loaded, ids, b, steps)[:2])
    one, one_full = statistics.median(blend), statistics.median(serial)
    rows = []
    for b in batches:
        prefill = statistics.median(p for p, _ in dense[b])
        decode = statistics.median(d for _, d in dense[b])
        rows.append(
            {
                "model": spec.name,
                "tokens": len(ids),
                "batch": b,
                "full_prefill_s": prefill,
                "full_prefill_s / B": prefill / b,
                "decode_s": decode,
                "prefill share": prefill / (prefill + decode),
                "full_one_by_one_s": b * one_full,
                "cacheblend_prefill_s": b * one,
                "cacheblend / full one by one": one / one_full,
                "cacheblend / full batched": b * one / prefill,
            }
        )
    notes = [
        f"medians of {rounds} rounds (batch sizes alternated); decode_s: {steps} greedy decode steps of the "
        f"batch after its prefill; prefill share: full_prefill_s / (full_prefill_s + decode_s)",
        "cacheblend_prefill_s: B x the median batch-1 TTFT of CacheBlend at r=0.15 (chunks in RAM, their "
        "precomputation not timed) — kvbench's engine serves one request at a time; full_one_by_one_s: the same "
        "for `full` through the engine (the like-for-like baseline); full_prefill_s: the stock forward, batched",
        f"device {spec.device}; torch threads {torch.get_num_threads()}; load average {_load_average()}",
    ]
    if options.save:
        notes.append(f"figure: {batch_figure(rows, options.figure_path('prefill_batch'), steps)}")
    return BenchResult(
        "prefill_batch", "prefill vs decode time against the batch size (CacheBlend Fig. 15c)", rows, notes
    )


def batch_figure(rows: list[dict[str, Any]], path: Any, steps: int) -> Any:
    """CacheBlend Fig. 15(c) from ``prefill_batch``'s rows: time against the batch size."""
    from kvbench.plots import Panel, Series, series_panels

    x = [float(r["batch"]) for r in rows]
    panel = Panel(
        f"{rows[0]['model']}, {rows[0]['tokens']}-token prompts",
        "batch size (requests)",
        "time (s)",
        [
            Series(
                "full recompute: batched prefill", x, [r["full_prefill_s"] for r in rows], color="#222222", marker="s"
            ),
            Series(
                "full recompute: one request at a time",
                x,
                [r["full_one_by_one_s"] for r in rows],
                color="#222222",
                marker="s",
                linestyle=":",
            ),
            Series(
                "CacheBlend r=0.15: prefill, one at a time",
                x,
                [r["cacheblend_prefill_s"] for r in rows],
                color="#1f77b4",
            ),
            Series(
                f"decode, {steps} tokens (batched)", x, [r["decode_s"] for r in rows], color="#888888", linestyle="--"
            ),
        ],
        xinteger=True,
        ylim=(0, None),
    )
    caption = (
        "Full recompute batched: one forward of the B prompts (transformers, batch B); one at a time: B prefills "
        "through kvbench's engine, which serves one request at a time — as CacheBlend's B prefills run here. "
        "Decode: the batch's greedy steps after the batched prefill. Medians of alternated rounds."
    )
    return series_panels(
        [panel], path, title="Prefill time vs batch size (CacheBlend Fig. 15c)", caption=caption, columns=1
    )
