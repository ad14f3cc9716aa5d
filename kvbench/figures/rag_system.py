"""The rag task's figures of CacheBlend's system experiments (``kvbench report --figure F.png --where
task=rag --figure-kind K``), beside the quality figures of :mod:`kvbench.figures.rag`.

=============  ==========  ===========================================================================
kind           CacheBlend  what it shows (one panel per model × dataset unless said otherwise)
=============  ==========  ===========================================================================
``retrieval``  Fig. 2      F1 (95 % CI) against the number of retrieved chunks (``task.top_k``), one
                           line per method (full KV recompute vs full KV reuse)
``scaling``    Fig. 15     "compute time at equal quality": for every (chunk length, number of chunks)
                           setting, the baseline's TTFT and the TTFT of the subject's smallest ratio
                           whose F1 is at most 1.5 points (0.015) below the baseline's; (a) against the number
                           of chunks, (b) against the chunk length. Panel (c), prefill time against the
                           batch size, is a benchmark, not runs: ``kvbench bench prefill_batch``
                           (``kvbench reproduce cacheblend/fig15c``)
``pipelines``  Fig. 13     F1 (95 % CI) against TTFT for the RAG pipelines (``task.pipeline``:
                           MapReduce, MapRerank) and the one-prompt methods (subject, baseline); a
                           pipeline's hollow marker is its TTFT with the map steps in parallel (an
                           idealised bound, :mod:`kvbench.tasks.rag_pipelines`)
``storage``    Fig. 17     one panel per storage setting (RAM, disk, disk throttled to N MB/s —
                           ``store.tier`` / ``store.read_mbps``): F1 against TTFT per method; methods
                           without a chunk store appear in every panel
=============  ==========  ===========================================================================

Runs are read with :func:`kvbench.figures.rag.run_infos`; the settings a figure places on an axis or a
panel (``top_k``, ``chunk_tokens``, ``pipeline``, the store) do not split series. The baseline (full KV
recompute), the subject (CacheBlend) and the reuse method (full KV reuse) are the legend's
(:class:`~kvbench.figures.legend.Legend`); no method is named here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.errors import ConfigError
from kvbench.figures.legend import Legend
from kvbench.figures.rag import (
    Palette,
    RunInfo,
    _metric,
    _metric_caption,
    _panel,
    _samples,
    _score_of,
    _scored,
    _text,
    _titled,
    _where,
    groups,
)
from kvbench.plots import Panel, Series

SYSTEM_FIGURE_KINDS = ("retrieval", "scaling", "pipelines", "storage")
#: F1 points (0–100) the subject may lose against the baseline and still count as equal quality (Fig. 15: 0.015)
EQUAL_QUALITY = 1.5
PIPELINE_NAMES = {"mapreduce": ("MapReduce", "#2ca02c", "s"), "maprerank": ("MapRerank", "#ff7f0e", "P")}
TTFT_NOTE = "TTFT: request to first token, mean over samples (chunk precomputation excluded, loads included)."


def _series_key(info: RunInfo, placed: set[str]) -> str:
    """The run's variant without the settings this figure places (recomputed within the run's group)."""
    return (
        info.method
        + "|"
        + ",".join(f"{k}={_text(v)}" for k, v in sorted(info.settings.items()) if k in info.differ and k not in placed)
    )


def _mark_differences(infos: list[RunInfo]) -> None:
    for group in groups(infos).values():
        for method in {i.method for i in group}:
            same = [i for i in group if i.method == method]
            keys = sorted({k for i in same for k in i.settings})
            differ = {k for k in keys if len({repr(i.settings.get(k)) for i in same}) > 1}
            for info in same:
                info.differ = differ


def _label(info: RunInfo, placed: set[str]) -> str:
    extra = ", ".join(
        f"{k.split('.', 1)[1]}={_text(info.settings.get(k))}" for k in sorted(info.differ) if k not in placed
    )
    name = info.name
    if info.ratio is not None and "method.recompute_ratio" not in placed:
        name += f" r={info.ratio:g}"
    return f"{name} ({extra})" if extra else name


def _setting(info: RunInfo, key: str) -> Any:
    return info.settings.get(key)


def _ttft_point(label: str, info: RunInfo, score: tuple[float, float, float], color: str, marker: str) -> Series | None:
    """One run as a point: its mean score with the 95 % CI at its mean TTFT (None without a TTFT: every
    run records one, and one without has no place on this axis)."""
    ttft = info.ttft
    if ttft is None:
        return None
    return Series(label, [ttft], [score[0]], kind="points", low=[score[1]], high=[score[2]], color=color, marker=marker)


# ---------------------------------------------------------------------- Fig. 2
def retrieval(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    infos = [i for i in _scored(infos) if _setting(i, "task.top_k") is not None]
    if not infos:
        raise ConfigError(
            "the retrieval figure needs rag runs with task.top_k set",
            f"e.g. kvbench run -m method={legend.baseline},{legend.reuse} task=rag task.chunk_tokens=128 "
            "task.top_k=2,4,8,16",
        )
    _mark_differences(infos)
    placed = {"task.top_k"}
    grouped = groups(infos)
    panels = []
    for (model, dataset), runs in grouped.items():
        panel = _panel(grouped, model, dataset, "retrieved chunks (task.top_k)")
        palette = Palette(legend)
        by_series: dict[str, list[RunInfo]] = {}
        for info in runs:
            by_series.setdefault(_series_key(info, placed) + f"|{info.ratio}", []).append(info)
        for key in sorted(by_series, key=lambda k: (legend.rank(k.split("|")[0]), k)):
            series = sorted(by_series[key], key=lambda i: int(_setting(i, "task.top_k")))
            color, marker, _ = palette.style(series[0].method)
            scores = [_score_of(i) for i in series]
            panel.series.append(
                Series(
                    _label(series[0], placed),
                    [int(_setting(i, "task.top_k")) for i in series],
                    [s[0] for s in scores],
                    low=[s[1] for s in scores],
                    high=[s[2] for s in scores],
                    color=color,
                    marker=marker,
                )
            )
        panels.append(panel)
    lengths = sorted({_setting(i, "task.chunk_tokens") for i in infos}, key=lambda v: (v is None, v or 0))
    caption = (
        f"Chunks of {', '.join(_text(v) for v in lengths)} tokens, the top k by L2 distance of the question's and "
        f"the chunks' all-MiniLM-L6-v2 embeddings (task.retriever), kept in their original order. "
        f"{_metric_caption(grouped)} {_samples(infos)}."
    )
    return panels, _titled("Quality vs. number of retrieved chunks", grouped), caption, 2


# ---------------------------------------------------------------------- Fig. 15
def equal_quality_points(infos: list[RunInfo], legend: Legend) -> list[dict[str, Any]]:
    """Per (model, dataset, chunk length, number of chunks): the baseline's F1 and TTFT, and the subject's
    smallest ratio whose mean F1 is within :data:`EQUAL_QUALITY` of the baseline's, with its F1 and TTFT
    (``None`` when no ratio qualifies); the keys are named after the two methods (``full_f1``,
    ``cacheblend_ttft_s``)."""
    baseline, subject = legend.baseline, legend.subject
    cells: dict[tuple[Any, ...], list[RunInfo]] = {}
    for info in _scored(infos):
        key = (info.model, info.dataset, _setting(info, "task.chunk_tokens"), _setting(info, "task.top_k"))
        cells.setdefault(key, []).append(info)
    out = []
    for (model, dataset, length, chunks), runs in sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0]))):
        full = [i for i in runs if i.method == baseline]
        blends = sorted((i for i in runs if i.method == subject and i.ratio is not None), key=lambda i: i.ratio or 0.0)
        if not full or not blends:
            continue
        reference = full[0]
        f1 = float(np.mean(reference.scores))
        chosen = next((i for i in blends if float(np.mean(i.scores)) >= f1 - EQUAL_QUALITY), None)
        prompt = np.mean([r["telemetry"].get("prompt_tokens") or 0 for r in reference.records])
        out.append(
            {
                "model": model,
                "dataset": dataset,
                "chunk_tokens": length,
                "top_k": chunks,
                "prompt_tokens": float(prompt),
                f"{baseline}_f1": f1,
                f"{baseline}_ttft_s": reference.ttft,
                "ratios_tried": [i.ratio for i in blends],
                "ratio": None if chosen is None else chosen.ratio,
                f"{subject}_f1": None if chosen is None else float(np.mean(chosen.scores)),
                f"{subject}_ttft_s": None if chosen is None else chosen.ttft,
            }
        )
    return out


def scaling(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    baseline, subject = legend.baseline, legend.subject
    points = equal_quality_points(infos, legend)
    if not points:
        raise ConfigError(
            f"the scaling figure needs {baseline} and {subject} runs at the same task.chunk_tokens and task.top_k",
            f"e.g. kvbench run -m method={baseline} task=rag task.top_k=2,4,6,8 ... and the same with "
            f"method={subject} method.recompute_ratio=0.05,0.15,0.3",
        )
    panels = []
    for axis, fixed, title in (
        ("top_k", "chunk_tokens", "(a) number of chunks"),
        ("chunk_tokens", "top_k", "(b) chunk length"),
    ):
        counts: dict[Any, set[Any]] = {}
        for p in points:
            counts.setdefault((p["model"], p["dataset"], p[fixed]), set()).add(p[axis])
        if not counts:
            continue
        (model, dataset, value), xs = max(counts.items(), key=lambda kv: (len(kv[1]), str(kv[0])))
        if len(xs) < 2:
            continue
        row = sorted(
            (p for p in points if (p["model"], p["dataset"], p[fixed]) == (model, dataset, value)),
            key=lambda p: p[axis],
        )
        label = "chunks" if axis == "top_k" else "chunk length (tokens)"
        panel = Panel(
            f"{title}, {fixed.replace('_', ' ')} = {_text(value)} — {_where(model, dataset)}",
            label,
            "compute time: mean TTFT (s)",
            ylim=(0, None),
        )
        full, blend_style = legend.style(baseline), legend.style(subject)
        panel.series.append(
            Series(
                full.label,
                [p[axis] for p in row],
                [p[f"{baseline}_ttft_s"] for p in row],
                color=full.color,
                marker=full.marker,
            )
        )
        blend = [p for p in row if p["ratio"] is not None]
        panel.series.append(
            Series(
                f"{blend_style.label} (smallest r at equal quality)",
                [p[axis] for p in blend],
                [p[f"{subject}_ttft_s"] for p in blend],
                notes=[f"r={p['ratio']:g}" for p in blend],
                color=blend_style.color,
                marker=blend_style.marker,
            )
        )
        missing = [p for p in row if p["ratio"] is None]
        if missing:
            panel.note = f"no ratio reached {baseline}'s F1 - 1.5 at " + ", ".join(_text(p[axis]) for p in missing)
        panels.append(panel)
    if not panels:
        raise ConfigError(
            "the scaling figure needs at least two numbers of chunks or two chunk lengths",
            "sweep task.top_k or task.chunk_tokens",
        )
    caption = (
        f"For each setting: full recompute's TTFT, and {legend.label(subject)}'s at the smallest recompute ratio r "
        f"(of those run) whose mean F1 is at most {EQUAL_QUALITY:g} points below {baseline}'s (the paper's 0.015 "
        f"loss); chunk "
        f"caches in RAM. {TTFT_NOTE} With few samples an F1 difference of this size is within noise: read the "
        f"ratios as indicative. Fig. 15(c), prefill time against the batch size: `kvbench bench prefill_batch`. "
        f"{_samples(infos)}."
    )
    return panels, "Compute time at equal quality (CacheBlend Fig. 15)", caption, 2


# ---------------------------------------------------------------------- Fig. 13
def _parallel_ttft(info: RunInfo) -> float | None:
    values = [((r.get("telemetry") or {}).get("pipeline") or {}).get("ttft_parallel_s") for r in info.records]
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def pipelines(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    infos = _scored(infos)
    if not any((_setting(i, "task.pipeline") or "stuff") != "stuff" for i in infos):
        raise ConfigError(
            "the pipelines figure needs runs with task.pipeline=mapreduce or maprerank",
            f"e.g. kvbench run -m method={legend.baseline} task=rag task.pipeline=mapreduce,maprerank ...",
        )
    _mark_differences(infos)
    placed = {"task.pipeline", "task.map_tokens", "task.rerank_score"}
    grouped = groups(infos)
    panels = []
    for (model, dataset), runs in grouped.items():
        panel = _panel(grouped, model, dataset, "mean TTFT (s)", xlim=(0, None))
        palette = Palette(legend)
        for info in sorted(runs, key=lambda i: (_setting(i, "task.pipeline") or "stuff", i.method, i.ratio or 0)):
            score = _score_of(info)
            pipeline = _setting(info, "task.pipeline") or "stuff"
            if pipeline == "stuff":
                color, marker, _ = palette.style(info.method)
                label = _label(info, placed)
            else:
                name, color, marker = PIPELINE_NAMES.get(pipeline, (pipeline, "#8c564b", "X"))
                if pipeline == "maprerank" and _setting(info, "task.rerank_score") == "cued":
                    name, color = f"{name}, score cued", "#d62728"
                label = name + ("" if info.method == legend.baseline else f" ({info.name})")
            point = _ttft_point(label, info, score, color, marker)
            if point is not None:
                panel.series.append(point)
            parallel = _parallel_ttft(info) if pipeline != "stuff" else None
            if parallel is not None:
                panel.series.append(
                    Series(
                        f"{label}, maps in parallel (ideal)",
                        [parallel],
                        [score[0]],
                        kind="points",
                        color=color,
                        marker="o",
                        linestyle="none",
                    )
                )
        panels.append(panel)
    caption = (
        f"MapReduce: each chunk summarised alone, the summaries answered in one prompt; MapRerank: each chunk "
        f"answered alone with a 0–100 score, the best answer kept (LangChain's chains, kvbench's prompts). TTFT "
        f"of a pipeline: request to the first token of its final answer, the map steps run one at a time "
        f"(measured); 'maps in parallel': the longest map step instead of their sum (an idealised bound). "
        f"{_metric_caption(grouped)} {_samples(infos)}."
    )
    return panels, _titled(f"RAG pipelines vs. {legend.label(legend.subject)}", grouped), caption, 2


# ---------------------------------------------------------------------- Fig. 17
def _storage(info: RunInfo) -> str | None:
    tier = _setting(info, "store.tier")
    if tier is None:
        return None
    mbps = _setting(info, "store.read_mbps")
    return (
        "RAM" if tier == "ram" else ("disk (cold reads)" if mbps is None else f"disk throttled to {_text(mbps)} MB/s")
    )


def storage(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    infos = _scored(infos)
    settings = sorted(
        {s for i in infos if (s := _storage(i)) is not None},
        key=lambda s: (s != "RAM", s.startswith("disk throttled"), -float(s.split()[3]) if "throttled" in s else 0),
    )
    if not settings:
        raise ConfigError(
            "the storage figure needs reuse-method runs (their store.tier places them)",
            f"e.g. kvbench run -m method={','.join(_reusing(legend))} store.tier=ram,disk ...",
        )
    _mark_differences(infos)
    placed = {
        "store.tier",
        "store.read_mbps",
        "store.pipeline",
        "store.cold_reads",
        "store.dir",
        "store.ram_gb",
        "store.disk_gb",
    }
    panels = []
    for setting in settings:
        runs = [i for i in infos if _storage(i) in (setting, None)]
        panel = Panel(setting, "mean TTFT (s)", f"{_metric(runs[0].dataset)} (0–100)", xlim=(0, None))
        palette = Palette(legend)
        for info in sorted(runs, key=lambda i: (legend.rank(i.method), i.ratio or 0)):
            score = _score_of(info)
            color, marker, _ = palette.style(info.method)
            point = _ttft_point(_label(info, placed), info, score, color, marker)
            if point is not None:
                panel.series.append(point)
        panels.append(panel)
    grouped = groups(infos)
    caption = (
        f"Chunk KV caches served from RAM, from this machine's disk with the page cache dropped before every "
        f"read, or from the same disk throttled to N MB/s (store.read_mbps: reads padded with sleep, an "
        f"emulation of a slower device); loads pipelined with recompute (store.pipeline). Full recompute "
        f"reads no cache and appears in every panel. {_metric_caption(grouped)} {TTFT_NOTE} {_samples(infos)}."
    )
    return panels, _titled("Quality vs. TTFT by storage device", grouped), caption, len(panels)


def _reusing(legend: Legend) -> list[str]:
    """The legend's methods that read chunk caches (all but the baseline), the subject and reuse first."""
    return [m for m in dict.fromkeys([legend.subject, legend.reuse, *legend.methods]) if m != legend.baseline]


BUILDERS = {"retrieval": retrieval, "scaling": scaling, "pipelines": pipelines, "storage": storage}
