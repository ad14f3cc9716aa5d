"""``kvbench bench``: performance micro-benchmarks, reported as ratios measured side by side.

Each module of this package registers benchmark functions with :func:`benchmark`. A benchmark runs
both sides of a comparison in the same process, on the same inputs, and returns rows whose ratio
columns are the figures to quote (absolute times depend on the machine; ratios travel better).
Performance targets live here, never in timed unit tests.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class BenchResult:
    name: str
    title: str
    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BenchOptions:
    quick: bool = False  # smaller sizes, for smoke tests
    device: str = "auto"
    repeats: int = 5
    model: str | None = None  # end-to-end benchmarks: a model config name (e.g. llama31_8b_shape on a GPU)
    lengths: tuple[int, ...] | None = None  # end-to-end benchmarks: prompt lengths in tokens
    new_tokens: int | None = None  # end-to-end benchmarks: tokens generated per run
    rounds: int | None = None  # end-to-end benchmarks: timed rounds (default 2; 1 with quick)
    params: dict[str, Any] = field(default_factory=dict)  # end-to-end benchmarks: the method's parameters
    save: str | None = None  # --save FILE.json: a benchmark that draws a figure writes it beside FILE
    methods: tuple[str, ...] | None = None  # --methods: the methods a per-method benchmark runs (default: its own)
    engine: dict[str, Any] = field(default_factory=dict)  # --engine KEY=VALUE: engine settings (engine.*)

    def figure_path(self, name: str) -> Path:
        """Where a bench saved with ``--save FILE.json`` puts its figure ``name``: ``FILE.<name>.png``
        beside it (only called when ``save`` is set)."""
        assert self.save is not None, "figure_path needs --save"
        path = Path(self.save)
        return path.with_name(f"{path.stem}.{name}.png")

    def e2e_rounds(self) -> int:
        """Timed rounds of an end-to-end benchmark: the user's where given, else 2 (1 in quick mode)."""
        return self.rounds or (1 if self.quick else 2)

    def e2e(self, model: str, lengths: tuple[int, ...], new_tokens: int = 32) -> tuple[str, tuple[int, ...], int]:
        """The end-to-end settings: the user's where given, else the benchmark's defaults."""
        return self.model or model, self.lengths or lengths, self.new_tokens or new_tokens


Bench = Callable[[BenchOptions], BenchResult]
BENCHMARKS: dict[str, Bench] = {}
_discovered = False


def benchmark(name: str) -> Callable[[Bench], Bench]:
    def wrap(fn: Bench) -> Bench:
        BENCHMARKS[name] = fn
        return fn

    return wrap


def discover() -> dict[str, Bench]:
    global _discovered
    if not _discovered:
        for module in pkgutil.iter_modules(__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{__name__}.{module.name}")
        _discovered = True
    return BENCHMARKS


def bench_device(options: BenchOptions) -> torch.device:
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(options.device)


def time_call(fn: Callable[[], Any], *, repeats: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs (synchronising CUDA)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def niah_ids(loaded: Any, length: int) -> list[int]:
    """The token ids of the NIAH prompt of ``length`` tokens with its needle at depth 0.5 (the prompt the
    end-to-end benches and tools/profile_decode.py time)."""
    from kvbench.tasks import create_task

    task = create_task({"name": "niah", "lengths": [length], "depths": [0.5]})
    ids = next(iter(task.samples(loaded))).input_ids
    assert ids is not None  # (niah samples are token ids)
    return list(ids)


def render(result: BenchResult) -> str:
    import pandas as pd

    from kvbench.report import to_markdown

    lines = [f"## {result.name}: {result.title}", "", to_markdown(pd.DataFrame(result.rows))]
    lines += [""] + [f"- {note}" for note in result.notes] if result.notes else []
    return "\n".join(lines)
