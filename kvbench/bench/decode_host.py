"""``decode_host``: what a decode step asks of the host, per method, measured on a CPU.

On a GPU a decode step of a small batch is bound by the host when the host issues ops one by one and
waits for the device inside the step (RESULTS §9). Those costs are properties of the op stream, so they
are measured here without a GPU, on the 32-layer ``tiny_llama`` (a 2k prompt, device-resident KV, one
CPU thread), one row per method:

* ``aten_ops`` — aten ops that launch work in one steady decode step (views left out), recorded with
  :mod:`kvbench.engine.ops`; ``ops_vs_full`` per selecting layer;
* ``syncs`` — sync-prone ops (``_local_scalar_dense``, ``nonzero``, ``unique``, ...) and host reads
  (``.tolist()``, ``.cpu()``, ``.item()``) in that step, and ``host_data`` (tensors built from Python
  data: a host→device copy each on a GPU); goals 0;
* ``static`` — whether two consecutive steps of one regime issue the same ops with the same shapes
  and arguments (what a CUDA graph captures; the first difference otherwise);
* ``tpot_ms`` — the mean step time after the first, best of the rounds (methods interleaved per round),
  and ``tpot / full``: on a CPU with 32 small layers the step time is mostly the host's.

The reference row ``hf_eager`` is transformers' own eager decode step on the same model and prompt
(``model(...)`` with a ``DynamicCache``, the next token read back), counted and timed the same way.
Goals: ``full`` ops ≤ 1.1 × hf_eager's; a selecting method ≤ full + 25 per selecting layer; every
method's TPOT ≤ 1.15 × full's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvbench.bench import BenchOptions, BenchResult, benchmark, niah_ids

METHODS = ("full", "oracle", "quest", "sparq", "infllm", "clusterkv", "pqcache")
GOAL_OPS_VS_HF = 1.1
GOAL_OPS_PER_LAYER = 25
GOAL_TPOT = 1.15
RECORDED_STEPS = (4, 5)  # the steady steps whose op streams are recorded (the first steps warm up)


def _step_hook() -> tuple[Any, str]:
    """The function that runs one decode step (its owner and name), in this version of the engine."""
    try:
        from kvbench.engine.decode import StaticDecoder

        return StaticDecoder, "step"
    except ImportError:  # an engine without the static step (before/after comparisons)
        from kvbench.engine.context import GenerationContext

        return GenerationContext, "forward"


class StepRecorder:
    """Records the op streams of decode steps ``RECORDED_STEPS`` of the next generation."""

    def __init__(self) -> None:
        self.owner, self.name = _step_hook()
        self.original = getattr(self.owner, self.name)
        self.steps: dict[int, Any] = {}
        self.count = 0

    def __enter__(self) -> StepRecorder:
        from kvbench.engine.ops import record_ops

        recorder, original = self, self.original

        def wrapped(this, *args, **kwargs):
            index = recorder.count
            recorder.count += 1
            if index not in RECORDED_STEPS:
                return original(this, *args, **kwargs)
            with record_ops() as ops:
                out = original(this, *args, **kwargs)
            recorder.steps[index] = ops
            return out

        setattr(self.owner, self.name, wrapped)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self.original)


def _budget(name: str) -> dict[str, Any]:
    return {} if name == "full" else {"tokens": 256, "comm_ratio": 1 / 64}


def _params(name: str) -> dict[str, Any]:
    return {"name": name} if name == "full" else {"name": name, "offload": False}


def _hf_step(loaded: Any, ids: list[int], new_tokens: int) -> tuple[float, Any]:
    """transformers' eager decode: TPOT (mean of the steps after the first) and one steady step's ops."""
    from kvbench.engine.ops import record_ops

    model = loaded.model
    device = torch.device(loaded.spec.device)
    times: list[float] = []
    ops = None
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())

        def step(token: int) -> int:
            fed = torch.tensor([[token]], device=device)
            out = model(input_ids=fed, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax())

        for index in range(new_tokens - 1):
            start = time.perf_counter()
            if index == RECORDED_STEPS[0]:
                with record_ops() as ops:
                    token = step(token)
            else:
                token = step(token)
            times.append(time.perf_counter() - start)
    return statistics.fmean(times[1:]), ops


def _row(name: str, tpot: float, ops: Any, nxt: Any, full: dict[str, Any] | None, selecting: int) -> dict[str, Any]:
    syncs = dict(ops.syncs)
    row: dict[str, Any] = {
        "method": name,
        "tpot_ms": 1e3 * tpot,
        "aten_ops": ops.aten_ops,
        "syncs": sum(syncs.values()),
        "sync_ops": ", ".join(f"{k} {v}" for k, v in sorted(syncs.items())) or "-",
        "host_data": ops.host_data,
        "static": "yes"
        if nxt is not None and ops.first_difference(nxt) is None
        else (ops.first_difference(nxt) if nxt is not None else "-"),
    }
    if full is not None:
        row["tpot / full"] = tpot / full["tpot"]
        row["ops_vs_full"] = (ops.aten_ops - full["ops"]) / selecting if selecting else None
    return row


def _measure(options: BenchOptions, loaded: Any, ids: list[int], methods: list[str], new_tokens: int) -> dict[str, Any]:
    """Per method: the best TPOT of the rounds, the recorded op streams (first round) and its dense layers."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import generate
    from kvbench.methods import create_method

    try:
        from kvbench.engine.settings import engine_settings
    except ImportError:  # an engine without the static step (the bench also measures it: before/after)
        engine_settings = None  # type: ignore[assignment]
    extra: dict[str, Any] = {}
    if engine_settings is not None:
        extra["engine"] = engine_settings(getattr(options, "engine", {}))

    def run(name: str, n: int) -> dict[str, Any]:
        method = create_method({**_params(name), **(options.params if name != "full" else {})})
        budget = BudgetConfig(**_budget(name))
        return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, budget=budget, **extra).telemetry

    for name in methods:  # untimed warm-up (first-call costs, k-means cost models)
        run(name, 3)
    tpots: dict[str, list[float]] = {name: [] for name in methods}
    recorded: dict[str, Any] = {}
    dense: dict[str, int] = {}
    for r in range(options.e2e_rounds()):
        for name in methods:
            if r == 0:
                with StepRecorder() as rec:
                    tele = run(name, new_tokens)
                recorded[name] = rec.steps
                first, available = tele["attended_first_step"], tele["available_first_step"]
                dense[name] = sum(1 for a, v in zip(first, available) if a == v)
            else:
                tele = run(name, new_tokens)
            tpots[name].append(tele["tpot_s"])
    return {"tpots": tpots, "recorded": recorded, "dense": dense, "engine": extra.get("engine")}


@benchmark("decode_host")
def decode_host(options: BenchOptions) -> BenchResult:
    from kvbench.compose import compose
    from kvbench.models.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model_name = options.model or "tiny_llama"
        overrides = [f"model={model_name}"] + (
            ["model.config.num_hidden_layers=32"] if model_name == "tiny_llama" else []
        )
        loaded = load_model(compose(overrides)["model"])
        length = (options.lengths or ((512,) if options.quick else (2048,)))[0]
        new_tokens = options.new_tokens or (12 if options.quick else 32)
        methods = list(getattr(options, "methods", None) or METHODS)
        if "full" not in methods:
            methods.insert(0, "full")
        ids = niah_ids(loaded, length)
        measured = _measure(options, loaded, ids, methods, new_tokens)
        hf_tpot, hf_ops = _hf_step(loaded, ids, new_tokens)
    finally:
        torch.set_num_threads(threads)
    layers = loaded.spec.n_layers
    rows = [_row("hf_eager", hf_tpot, hf_ops, None, None, 0)]
    full = None
    for name in methods:
        steps = measured["recorded"][name]
        ops, nxt = steps[RECORDED_STEPS[0]], steps.get(RECORDED_STEPS[1])
        tpot = min(measured["tpots"][name])
        if name == "full":
            full = {"tpot": tpot, "ops": ops.aten_ops}
            rows.append({**_row(name, tpot, ops, nxt, None, 0), "ops / hf_eager": ops.aten_ops / hf_ops.aten_ops})
        else:
            rows.append(_row(name, tpot, ops, nxt, full, layers - measured["dense"][name]))
    notes = [
        f"model {model_name} ({layers} layers), prompt {len(ids)} tokens, {new_tokens} new tokens, one CPU thread, "
        f"best TPOT of {options.e2e_rounds()} round(s), methods interleaved; budget 256 tokens, comm 1/64, "
        "offload false",
        f"op streams of decode steps {RECORDED_STEPS} (kvbench.engine.ops); static: step {RECORDED_STEPS[0]} and "
        f"{RECORDED_STEPS[1]} issue the same ops, shapes and arguments",
        f"engine: {measured['engine'] or 'without the static step'}",
        f"goals: full ops <= {GOAL_OPS_VS_HF} x hf_eager; ops_vs_full <= {GOAL_OPS_PER_LAYER} per selecting layer; "
        f"syncs 0; tpot / full <= {GOAL_TPOT}",
    ]
    return BenchResult("decode_host", "decode step host cost per method (CPU)", rows, notes)
