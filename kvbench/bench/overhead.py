"""What kvbench itself costs: the engine against plain transformers, the run loop, cost against length.

``overhead`` answers "are kvbench's timings the model's timings?" in two parts:

* **engine vs transformers** — kvbench's ``full`` method (:func:`kvbench.engine.generate.generate`:
  layer-by-layer driver, kvbench attention, KV store, telemetry) against a plain transformers greedy
  loop (prefill, then one ``model(...)`` call per token with transformers' own ``DynamicCache``) on
  the *same* model object, prompt and process. Rounds are interleaved (kvbench, transformers,
  kvbench, ...) and the ratios are medians of the per-round ratios, so a load change on a shared
  machine hits both sides of a round alike. Both sides time the same span: the prefill plus the
  first token's argmax (kvbench's ``ttft_s``), and each decode step's forward plus argmax; TPOT is
  the mean of the decode steps after the first on both. ``tokens_identical``: the two loops (and
  ``model.generate``, run once, untimed) produce the same greedy tokens.
* **run loop** — a few NIAH samples through :func:`kvbench.runner.run`, what ``kvbench run`` calls,
  into a scratch output folder. A sample's wall time is the time between the run loop's consecutive
  per-sample progress calls (the first from the progress object's creation, just before the loop):
  building the sample (haystack, tokenisation), the engine, scoring, writing the record and the log.
  Its overhead is that wall time minus the engine's own ``prefill_s + decode_s``; the rows split it
  into the part inside :func:`kvbench.runner.run_sample` (context and store set-up, telemetry
  summary, scoring) and the part outside it (sample building, record and log writing). The runner is
  unchanged: the bench wraps the progress object and ``run_sample`` to read the clock.

``cost_vs_length`` measures, per method at a fixed budget, TPOT and the per-step split the engine
records (``select_s`` / ``fetch_s`` / ``compute_s`` over the decode steps) at several context
lengths, and fits the log-log growth exponent of TPOT and of the selection time (1 = linear in the
context). The methods share one dense prefill per length (:mod:`kvbench.engine.prefill_cache`), which
changes no decode timing and saves most of the run time.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from kvbench.bench import BenchOptions, BenchResult, benchmark, niah_ids

GOAL_RATIO = 1.03  # kvbench / transformers, prefill and per decode token
GOAL_LOOP = 0.02  # the run loop's share of a sample's wall time


def _row(metric: str, value: Any, goal: str, met: bool | None) -> dict[str, Any]:
    return {"metric": metric, "value": value, "goal": goal, "met": met}


def hf_greedy(loaded: Any, ids: Sequence[int], new_tokens: int) -> tuple[list[int], float, list[float]]:
    """Plain transformers greedy decoding of ``new_tokens`` tokens: the tokens, the prefill's seconds
    (forward and first argmax) and every decode step's seconds (forward and argmax).

    The model's stop ids are masked for every token, as kvbench's ``min_new_tokens`` does when it
    equals ``max_new_tokens``; only the last position's logits are computed (``logits_to_keep=1``),
    as kvbench does."""
    from kvbench.telemetry import Clock

    model = loaded.model
    device = torch.device(loaded.spec.device)
    clock = Clock(device)
    stops = torch.tensor(sorted(set(loaded.spec.stop_ids)), dtype=torch.long, device=device)

    def pick(logits: torch.Tensor) -> int:
        if stops.numel():
            logits = logits.clone()
            logits[:, stops] = float("-inf")
        return int(torch.argmax(logits, dim=-1))

    prompt = torch.tensor([list(ids)], dtype=torch.long, device=device)
    steps: list[float] = []
    with torch.inference_mode():
        start = clock.now()
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        token = pick(out.logits[:, -1, :])
        prefill_s = clock.now() - start
        cache = out.past_key_values
        tokens = [token]
        while len(tokens) < new_tokens:
            start = clock.now()
            out = model(
                input_ids=torch.tensor([[token]], device=device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            token = pick(out.logits[:, -1, :])
            steps.append(clock.now() - start)
            cache = out.past_key_values
            tokens.append(token)
    return tokens, prefill_s, steps


def _engine_vs_hf(options: BenchOptions, loaded: Any, ids: list[int], new_tokens: int) -> tuple[list[Any], list[str]]:
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method, method_node

    def ours(prompt: Sequence[int]) -> tuple[list[int], float, float, float]:
        start = time.perf_counter()
        out = generate(
            loaded,
            create_method(method_node("full")),
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        wall = time.perf_counter() - start
        return out.tokens, out.telemetry["ttft_s"], out.telemetry["tpot_s"], wall

    def theirs(prompt: Sequence[int]) -> tuple[list[int], float, float, float]:
        start = time.perf_counter()
        tokens, prefill_s, steps = hf_greedy(loaded, prompt, new_tokens)
        wall = time.perf_counter() - start
        return tokens, prefill_s, statistics.fmean(steps[1:]), wall

    ours(ids[:128])  # warm-up on a short prefix: first-call costs, not the prompt's
    theirs(ids[:128])
    rounds = max(1, options.repeats)
    prefill, tpot, wall = [], [], []
    k_tokens: list[int] = []
    h_tokens: list[int] = []
    for _ in range(rounds):  # interleaved: kvbench, transformers, kvbench, ...
        k_tokens, k_ttft, k_tpot, k_wall = ours(ids)
        h_tokens, h_prefill, h_tpot, h_wall = theirs(ids)
        prefill.append((k_ttft, h_prefill))
        tpot.append((k_tpot, h_tpot))
        wall.append((k_wall, h_wall))
    with torch.inference_mode():
        generated = loaded.model.generate(
            torch.tensor([ids], device=torch.device(loaded.spec.device)),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    reference = generated[0, len(ids) :].tolist()

    def ratio(pairs: list[tuple[float, float]]) -> float:
        return round(statistics.median(a / b for a, b in pairs), 4)

    prefill_ratio, tpot_ratio = ratio(prefill), ratio(tpot)
    rows = [
        _row(
            "prefill ratio (kvbench TTFT / HF prefill)", prefill_ratio, f"<= {GOAL_RATIO}", prefill_ratio <= GOAL_RATIO
        ),
        _row("decode ratio (kvbench TPOT / HF TPOT)", tpot_ratio, f"<= {GOAL_RATIO}", tpot_ratio <= GOAL_RATIO),
        _row("generate() wall ratio (set-up and telemetry included)", ratio(wall), "-", None),
        _row("kvbench TTFT s (median)", round(statistics.median(k for k, _ in prefill), 4), "-", None),
        _row("HF prefill s (median)", round(statistics.median(h for _, h in prefill), 4), "-", None),
        _row("kvbench TPOT ms (median)", round(1e3 * statistics.median(k for k, _ in tpot), 3), "-", None),
        _row("HF TPOT ms (median)", round(1e3 * statistics.median(h for _, h in tpot), 3), "-", None),
        _row("tokens_identical (HF greedy loop)", k_tokens == h_tokens, "True", k_tokens == h_tokens),
        _row("tokens_identical (model.generate)", k_tokens == reference, "True", k_tokens == reference),
    ]
    notes = [
        f"engine vs HF: model {loaded.spec.name} ({loaded.spec.device}, {loaded.spec.dtype}), NIAH prompt of "
        f"{len(ids)} tokens, {new_tokens} new tokens (stop ids masked), {rounds} interleaved rounds after a "
        "warm-up on a 128-token prefix; ratios: median of the per-round ratios",
        "HF side: model(prompt, logits_to_keep=1), then model(token, past_key_values=DynamicCache) per token, "
        "same model object; TTFT/prefill include the first argmax, TPOT is the mean of the steps after the first",
        f"per-round ratios: prefill {[round(a / b, 3) for a, b in prefill]}, TPOT {[round(a / b, 3) for a, b in tpot]}",
    ]
    return rows, notes


def _run_loop(options: BenchOptions, model: str, length: int, depths: Sequence[float]) -> tuple[list[Any], list[str]]:
    """NIAH samples through :func:`kvbench.runner.run`: the loop's share of each sample's wall time."""
    import kvbench.progress
    import kvbench.runner
    from kvbench.compose import compose

    marks: list[float] = []  # perf_counter at the progress object's creation, then at each sample
    engine: list[tuple[float, float]] = []  # per sample: run_sample's seconds, prefill_s + decode_s

    class Recording(kvbench.progress.Progress):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            marks.append(self.started)

        def sample(self, sample_id: str, score: float | None, seconds: float) -> None:
            super().sample(sample_id, score, seconds)
            marks.append(time.perf_counter())

    real_run_sample = kvbench.runner.run_sample

    def timed_run_sample(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = real_run_sample(*args, **kwargs)
        seconds = time.perf_counter() - start
        tele = result.telemetry
        engine.append((seconds, float(tele["prefill_s"]) + float(tele["decode_s"])))
        return result

    with tempfile.TemporaryDirectory() as scratch:
        resolved = compose(
            [
                f"model={model}",
                "method=full",
                "task=niah",
                f"task.lengths=[{length}]",
                f"task.depths=[{','.join(str(d) for d in depths)}]",
                f"output_dir={scratch}",
                "progress=false",
                *(["task.max_new_tokens=8"] if options.quick else []),
            ]
        )
        with (
            mock.patch.object(kvbench.progress, "Progress", Recording),
            mock.patch.object(kvbench.runner, "run_sample", timed_run_sample),
        ):
            started = time.perf_counter()
            kvbench.runner.run(resolved)
            total = time.perf_counter() - started
    walls = [b - a for a, b in zip(marks, marks[1:])]
    assert len(walls) == len(engine) == len(depths), (len(walls), len(engine))
    overhead = [(w - model_s) / w for w, (_, model_s) in zip(walls, engine)]
    outside = [(w - inside) / w for w, (inside, _) in zip(walls, engine)]
    inside = [(inside - model_s) / w for w, (inside, model_s) in zip(walls, engine)]
    median = round(statistics.median(overhead), 4)
    rows = [
        _row("run-loop overhead / sample wall (median)", median, f"< {GOAL_LOOP}", median < GOAL_LOOP),
        _row(
            "  of which outside run_sample (sample building, record, log)",
            round(statistics.median(outside), 4),
            "-",
            None,
        ),
        _row("  of which inside run_sample, outside prefill+decode", round(statistics.median(inside), 4), "-", None),
        _row("run-loop overhead / sample wall (max)", round(max(overhead), 4), "-", None),
        _row("sample wall s (median)", round(statistics.median(walls), 3), "-", None),
        _row("run s outside the samples (model load, metrics, artifacts)", round(total - sum(walls), 3), "-", None),
    ]
    new_tokens = "8 new tokens" if options.quick else "the task's max_new_tokens"
    notes = [
        f"run loop: kvbench.runner.run, model {model}, method full, niah at {length} tokens, depths "
        f"{list(depths)} ({len(depths)} samples, {new_tokens}), fresh output folder; per-sample "
        f"overheads {[round(x, 4) for x in overhead]} (the first sample also creates the run directory)",
    ]
    return rows, notes


@benchmark("overhead")
def overhead(options: BenchOptions) -> BenchResult:
    """kvbench ``full`` vs plain transformers (prefill, TPOT, tokens) and the run loop's own cost."""
    from kvbench.compose import compose
    from kvbench.models.loading import load_model

    model, lengths, new_tokens = options.e2e(
        "tiny_llama" if options.quick else "smollm2_135m",
        (512,) if options.quick else (2048,),
        8 if options.quick else 32,
    )
    loaded = load_model(compose([f"model={model}"])["model"])
    ids = niah_ids(loaded, lengths[0])
    rows, notes = _engine_vs_hf(options, loaded, ids, new_tokens)
    depths = (0.25, 0.75) if options.quick else (0.25, 0.5, 0.75)
    loop_rows, loop_notes = _run_loop(options, model, lengths[0], depths)
    notes += loop_notes
    notes.append(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at the end")
    return BenchResult(
        "overhead", "kvbench's own cost: full vs plain transformers, and the run loop", rows + loop_rows, notes
    )


#: cost_vs_length's methods and the parameters they run with (the rest: their defaults). PQCache runs
#: its k-means inside the prefill (``overlap: false``) so that the first decode step does not wait for
#: the workers and the methods share one prefill; SparQ fetches r = 8 of SmolLM2's 64 key components
#: (d/8, the paper's ratio; its default derives r from ``budget.comm_ratio``).
COST_METHODS: dict[str, dict[str, Any]] = {
    "full": {},
    "oracle": {},
    "quest": {},
    "sparq": {"r": 8},
    "infllm": {},
    "pqcache": {"overlap": False},
    "clusterkv": {},
    "streamingllm": {},
    "snapkv": {},
    "h2o": {},
}
QUICK_METHODS = ("full", "quest", "streamingllm")
PHASES = ("select", "fetch", "compute")  # the decode split the engine records (kvbench.telemetry)


def growth_exponent(lengths: Sequence[int], values: Sequence[float | None]) -> float | None:
    """Slope of log(value) against log(length), least squares (1 = linear growth); None when a value
    is missing or not positive (e.g. a method that never selects) or fewer than two lengths."""
    if len(lengths) < 2 or any(v is None or not v > 0 for v in values):
        return None
    import numpy as np

    slope = np.polyfit(np.log(np.asarray(lengths, dtype=float)), np.log(np.asarray(values, dtype=float)), 1)[0]
    return round(float(slope), 3)


def _per_step(tele: dict[str, Any], key: str) -> float | None:
    steps = tele.get("decode_steps") or 0
    return float(tele[key]) / steps if steps else None


def _cost_rows(
    measured: dict[str, list[dict[str, list[float]]]], family: dict[str, str], prompts: list[int]
) -> list[dict[str, Any]]:
    """:func:`cost_vs_length`'s rows: per method and prompt length the medians over the rounds (ms per
    step) and the growth exponents over the lengths."""
    rows = []
    for name in measured:
        per_length = [{key: statistics.median(values) for key, values in run.items()} for run in measured[name]]
        tpot = [m["tpot"] for m in per_length]
        select = [m["select"] for m in per_length]
        selects = family[name] == "retrieval"  # others' select() is bookkeeping (dense: none; eviction: at prefill)
        for length, figures in zip(prompts, per_length):
            rows.append(
                {
                    "method": name,
                    "family": family[name],
                    "context": length,
                    "tpot_ms": round(1e3 * figures["tpot"], 3),
                    **{f"{key}_ms": round(1e3 * figures[key], 3) for key in PHASES},
                    "tpot exponent": growth_exponent(prompts, tpot),
                    "select exponent": growth_exponent(prompts, select) if selects else None,
                }
            )
    return rows


@benchmark("cost_vs_length")
def cost_vs_length(options: BenchOptions) -> BenchResult:
    """TPOT and the per-step select/fetch/compute split vs context length, per method, fixed budget."""
    from kvbench.budget import BudgetConfig
    from kvbench.compose import compose
    from kvbench.engine import prefill_cache
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method, method_node
    from kvbench.models.loading import load_model

    model, lengths, new_tokens = options.e2e(
        "tiny_llama" if options.quick else "smollm2_135m",
        (512, 1024) if options.quick else (2048, 4096, 8000),
        4 if options.quick else 16,
    )
    methods = QUICK_METHODS if options.quick else tuple(COST_METHODS)
    budget_tokens = 64 if options.quick else 512
    budget = BudgetConfig(tokens=budget_tokens)
    loaded = load_model(compose([f"model={model}"])["model"])
    rounds = 1 if options.quick else max(1, min(options.repeats, 3))
    # per method, per length: the figures of each round (seconds per decode step)
    measured: dict[str, list[dict[str, list[float]]]] = {name: [] for name in methods}
    family: dict[str, str] = {}
    prompts: list[int] = []
    sharing = prefill_cache.PrefillSharing(prefill_cache.PrefillCache(ram_bytes=2 * 1024**3, disk_bytes=0))
    for length in lengths:
        ids = niah_ids(loaded, length)
        prompts.append(len(ids))
        runs: dict[str, dict[str, list[float]]] = {name: {} for name in methods}
        for _ in range(rounds):  # interleaved: a load change hits every method of a round alike
            for name in methods:
                method = create_method({**method_node(name), **COST_METHODS[name]})
                out = generate(
                    loaded,
                    method,
                    ids,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    budget=budget if method.needs_budget else BudgetConfig(),
                    sharing=sharing,
                )
                family[name] = method.family
                tele = out.telemetry
                figures = {"tpot": tele["tpot_p50_s"], **{k: _per_step(tele, f"{k}_s") for k in PHASES}}
                for key, value in figures.items():
                    runs[name].setdefault(key, []).append(float(value or 0.0))
        for name in methods:
            measured[name].append(runs[name])
    rows = _cost_rows(measured, family, prompts)
    notes = [
        f"model {loaded.spec.name} ({loaded.spec.device}, {loaded.spec.dtype}); NIAH prompts (depth 0.5); "
        f"{new_tokens} decode steps (stop ids masked); budget.tokens={budget_tokens} for every compressing method "
        "(sinks and each method's window rules as its defaults)",
        "tpot_ms: median decode step after the first (tpot_p50_s: robust to a busy machine's spikes); "
        "select/fetch/compute_ms: the engine's select_s, fetch_s, compute_s over all decode steps, per step; "
        f"each the median over {rounds} interleaved round(s) (every method once per round)",
        "exponent: least-squares slope of log(time) vs log(context) over the lengths (1 = linear); the select "
        "exponent only for retrieval methods (a dense or eviction method's select() picks nothing per step)",
        "methods: " + ", ".join(f"{n} {COST_METHODS[n]}" if COST_METHODS[n] else n for n in methods),
        "one dense prefill per length shared by the methods (kvbench.engine.prefill_cache); decode is measured "
        "as always",
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} at the end",
    ]
    if options.save:
        figure = cost_figure(rows, options.figure_path("cost_vs_length"))
        notes.append(f"figure: {figure}")
    return BenchResult("cost_vs_length", "decode cost vs context length, fixed budget", rows, notes)


def cost_figure(rows: list[dict[str, Any]], path: Path) -> Path:
    """Log-log TPOT (every method) and per-step selection time (retrieval methods) vs context, one
    line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    from kvbench.plots import _save

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120, layout="constrained")
    methods = list(dict.fromkeys(row["method"] for row in rows))
    for index, name in enumerate(methods):
        style = {"marker": "o", "label": name, "color": f"C{index % 10}"}  # one colour per method in both panels
        mine = [row for row in rows if row["method"] == name]
        axes[0].plot([row["context"] for row in mine], [row["tpot_ms"] for row in mine], **style)
        select = [(row["context"], row["select_ms"]) for row in mine if row["select_ms"] > 0]
        if select and mine[0]["family"] == "retrieval":
            axes[1].plot(*zip(*select), **style)
    contexts = sorted({row["context"] for row in rows})
    for ax, label in zip(axes, ("TPOT (ms)", "selection per step (ms), retrieval methods")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(n) for n in contexts])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    return _save(fig, path)
