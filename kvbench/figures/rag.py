"""The rag task's comparison figures, in the shape of CacheBlend's (``kvbench report --figure F.png
--where task=rag [--figure-kind K]``, or a ``figure`` item of an experiment's render list).

=================  ==========  =======================================================================
kind               CacheBlend  what it shows (one panel, or a pair, per model × dataset of the runs)
=================  ==========  =======================================================================
``quality_ttft``   Fig. 12     one point per run: x = mean TTFT, y = mean F1 (Rouge-L for multi_news)
                               with its 95 % bootstrap CI; runs with a recompute ratio joined in ratio
                               order and labelled ``r=…``. The default: every set of scored rag runs has it.
``ratio``          Fig. 16     quality and TTFT against ``method.recompute_ratio`` for the runs that have
                               one; every other method a horizontal reference line (the baseline's CI
                               shaded)
``deviation``      Figs. 7–8   from runs with ``profile.deviation=true``: the reused tokens' KV
                               deviation on the middle layer, tokens ranked from the largest (mean
                               quantile curve over samples, the top 15 % shaded and their share of the
                               total printed), and the Spearman correlation of the per-token
                               deviations between layers i and i+1 (mean over samples, min–max shaded)
``selection``      Fig. 6      from runs with a recompute ratio and ``profile.deviation=true``: the query
                               rows' attention deviation from a full prefill (mean over layers, heads
                               and samples, ±1 standard error) against the recompute ratio, one line
                               per ``method.selection`` (HKVD vs random), the reuse method (the r = 0
                               end) as a reference line; other methods are left out
=================  ==========  =======================================================================

Runs are told apart by their resolved config (:class:`kvbench.report.FigureRun`): the method, its
recompute ratio (``method.recompute_ratio``, for the methods that have one), and any other setting that
differs between runs of the same method in a panel (``selection=random``, ``tier=disk``, ...), which
then splits them into separate series. Runs that differ only in ``--where``-able columns the figure
does not show are best narrowed with ``--where``.

No method is named here: a :class:`~kvbench.figures.legend.Legend` (the paper's, from its data file)
gives each method its label and style and names the baseline, the subject and the reuse method.

Each builder returns the panels as data (:class:`kvbench.plots.Panel`), so tests check the series
without reading pixels; :func:`draw` hands them to :func:`kvbench.plots.series_panels`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.errors import ConfigError
from kvbench.figures.legend import Legend
from kvbench.plots import Panel, Series, series_panels

FIGURE_KINDS = ("quality_ttft", "ratio", "deviation", "selection")
#: a figure builder: the runs and the legend in; its panels, title, caption and number of columns out
Builder = Callable[[list["RunInfo"], Legend], tuple[list[Panel], str, str, int]]

VARIANT_COLORS = ("#ff7f0e", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
DATASET_NAMES = {
    "musique": "MuSiQue",
    "wikimqa": "2WikiMQA",
    "multi_news": "Multi-News",
    "example": "CacheBlend examples",
}
#: config keys that place a run (its series, panel or x value) rather than tell it apart from its neighbours
PLACED = {"method.name", "method.recompute_ratio", "task.name", "task.dataset", "task.data_dir"}
RATIO_AXIS = "recompute ratio r (share of context tokens)"
TTFT_DEFINITION = (
    "TTFT: request to first token, mean over samples; chunk KV precomputation is excluded, loads from "
    "the chunk store's tier are included."
)


@dataclass
class RunInfo:
    """One run as the figures see it."""

    method: str
    ratio: float | None  # method.recompute_ratio, for a method that has one
    model: str
    dataset: str
    settings: dict[str, Any]  # flattened method/store/task/budget/profile keys
    records: list[dict[str, Any]]
    name: str = ""  # the method's label in the legend
    variant: str = ""  # the settings that separate it from other runs of its method in its panel
    differ: set[str] = field(default_factory=set, compare=False, repr=False)  # settings its method's runs vary

    @property
    def scores(self) -> list[float]:
        return [float(r["score"]) for r in self.records if r.get("score") is not None]

    @property
    def ttft(self) -> float | None:
        values = [
            r["telemetry"]["ttft_s"] for r in self.records if (r.get("telemetry") or {}).get("ttft_s") is not None
        ]
        return float(np.mean(values)) if values else None

    @property
    def deviations(self) -> list[dict[str, Any]]:
        """Each sample's ``telemetry.prefill.deviation`` (runs with ``profile.deviation=true``)."""
        return [d for r in self.records if (d := ((r.get("telemetry") or {}).get("prefill") or {}).get("deviation"))]

    @property
    def label(self) -> str:
        """The series label: the method's name and what sets this run's series apart."""
        return f"{self.name} ({self.variant})" if self.variant else self.name

    @property
    def note(self) -> str:
        return f"r={self.ratio:g}" if self.ratio is not None else ""


def draw(build: Builder, runs: Sequence[Any], path: Path, legend: Legend) -> Path:
    """Draw the figure ``build`` (one of :data:`BUILDERS`, or of the system figures') makes of ``runs``
    (:class:`kvbench.report.FigureRun`) to ``path``."""
    panels, title, caption, columns = build(run_infos(runs, legend), legend)
    return series_panels(panels, path, title=title, caption=caption, columns=columns)


# ---------------------------------------------------------------------- runs → groups and series
def run_infos(runs: Sequence[Any], legend: Legend) -> list[RunInfo]:
    """The runs with their settings and labels, and each run's ``variant`` within its (model, dataset) group."""
    infos = []
    for run in runs:
        config = getattr(run, "config", None) or {}
        title, records = run
        if "method" not in config:
            raise ConfigError(
                f"run {title!r} has no config.yaml to tell its method from",
                "re-run it with kvbench run (the rag figures place runs by their config)",
            )
        settings: dict[str, Any] = {}
        for group in ("method", "store", "task", "budget", "profile"):
            for key, value in (config.get(group) or {}).items():
                settings[f"{group}.{key}"] = tuple(value) if isinstance(value, list) else value
        method = config["method"]["name"]
        ratio = config["method"].get("recompute_ratio")
        dataset = config.get("task", {}).get("dataset") or next(
            (r.get("protocol", {}).get("dataset") for r in records if r.get("protocol")), "?"
        )
        infos.append(
            RunInfo(
                method,
                None if ratio is None else float(ratio),
                str(config.get("model", {}).get("name", "?")),
                str(dataset),
                settings,
                list(records),
                legend.label(method),
            )
        )
    for members in groups(infos).values():
        for method in {i.method for i in members}:
            same = [i for i in members if i.method == method]
            keys = sorted({k for i in same for k in i.settings} - PLACED)
            differ = [k for k in keys if len({repr(i.settings.get(k)) for i in same}) > 1]
            for info in same:
                info.variant = ", ".join(f"{k.split('.', 1)[1]}={_text(info.settings.get(k))}" for k in differ)
    return infos


def groups(infos: list[RunInfo]) -> dict[tuple[str, str], list[RunInfo]]:
    """Runs by (model, dataset), in a stable order."""
    out: dict[tuple[str, str], list[RunInfo]] = {}
    for info in sorted(infos, key=lambda i: (i.model, i.dataset)):
        out.setdefault((info.model, info.dataset), []).append(info)
    return out


def series_of(infos: list[RunInfo], legend: Legend) -> list[list[RunInfo]]:
    """Runs grouped into series (same method and variant), in the legend's order, each by ratio."""
    keyed: dict[tuple[str, str], list[RunInfo]] = {}
    for info in infos:
        keyed.setdefault((info.method, info.variant), []).append(info)
    ordered = sorted(keyed.items(), key=lambda kv: (legend.rank(kv[0][0]), kv[0]))
    return [sorted(runs, key=lambda i: (i.ratio is None, i.ratio or 0.0)) for _, runs in ordered]


class Palette:
    """The series styles of one panel: a method's own colour, marker and reference line style (the
    legend's) for its first series; further variants of it, and methods without a colour of their own,
    take the next of :data:`VARIANT_COLORS`."""

    def __init__(self, legend: Legend) -> None:
        self.legend = legend
        self.seen: set[str] = set()
        self.spare = 0

    def style(self, method: str) -> tuple[str, str, str]:
        style = self.legend.style(method)
        color, marker, line = style.color, style.marker, style.line
        if not color or method in self.seen:
            color = VARIANT_COLORS[self.spare % len(VARIANT_COLORS)]
            self.spare += 1
        self.seen.add(method)
        return color, marker, line


def _text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, tuple):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _where(model: str, dataset: str) -> str:
    return f"{model} · {DATASET_NAMES.get(dataset, dataset)}"


def _panel(
    grouped: dict[tuple[str, str], list[RunInfo]],
    model: str,
    dataset: str,
    xlabel: str,
    ylabel: str | None = None,
    **options: Any,
) -> Panel:
    """The panel of one (model, dataset) group, titled by it when there are several; ``ylabel``
    defaults to the dataset's metric."""
    title = _where(model, dataset) if len(grouped) > 1 else ""
    return Panel(title, xlabel, ylabel or f"{_metric(dataset)} (0–100)", **options)


def _titled(kind_title: str, grouped: dict[tuple[str, str], list[RunInfo]]) -> str:
    if len(grouped) == 1:
        ((model, dataset),) = grouped
        return f"{kind_title} — {model} on {DATASET_NAMES.get(dataset, dataset)}"
    return kind_title


def _metric(dataset: str) -> str:
    from kvbench.tasks.rag import DATASETS

    data = DATASETS.get(dataset)
    return "Rouge-L F" if data is not None and data.metric == "rouge_l" else "F1"


def _metric_caption(grouped: dict[tuple[str, str], list[RunInfo]]) -> str:
    metrics = {_metric(dataset) for _, dataset in grouped}
    parts = []
    if "F1" in metrics:
        parts.append(
            "F1: CacheBlend's token F1 over the model tokenizer's ids (first answer line, SQuAD normalisation, "
            "best gold answer), 0–100"
        )
    if "Rouge-L F" in metrics:
        parts.append("Rouge-L F: stemmed, best reference, 0–100")
    return "; ".join(parts) + "; mean over samples, bars: 95% bootstrap CI of the mean."


def _samples(infos: list[RunInfo]) -> str:
    counts = sorted({len(i.records) for i in infos})
    return f"n = {counts[0]} samples per run" if len(counts) == 1 else f"n = {counts[0]}–{counts[-1]} samples per run"


def _score(info: RunInfo) -> tuple[float, float, float] | None:
    """Mean score and its 95 % bootstrap CI (the bounds the runner writes to metrics.json)."""
    from kvbench.metrics import bootstrap_ci

    scores = info.scores
    if not scores:
        return None
    mean = float(np.mean(scores))
    ci = bootstrap_ci(scores) or [mean, mean]
    return mean, float(ci[0]), float(ci[1])


def _score_of(info: RunInfo) -> tuple[float, float, float]:
    """:func:`_score` of a run that has scores (one that :func:`_scored` kept)."""
    score = _score(info)
    if score is None:
        raise ValueError(f"run {info.label} has no scores")
    return score


def _scored(infos: list[RunInfo]) -> list[RunInfo]:
    scored = [i for i in infos if i.scores]
    if not scored:
        raise ConfigError(
            "none of the matching runs has a score (the example inputs have no gold answers)",
            "use a scored dataset (task.dataset=musique|wikimqa|multi_news) or --figure-kind deviation",
        )
    return scored


# ---------------------------------------------------------------------- Fig. 12: quality vs TTFT
def quality_ttft(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    grouped = groups(_scored(infos))
    panels = []
    for (model, dataset), runs in grouped.items():
        panel = _panel(grouped, model, dataset, "mean TTFT (s)", xlim=(0, None), ylim=(0, None))
        palette = Palette(legend)
        for series in series_of(runs, legend):
            color, marker, _ = palette.style(series[0].method)
            timed = [(i, t, s) for i in series if (s := _score(i)) is not None and (t := i.ttft) is not None]
            panel.series.append(
                Series(
                    series[0].label,
                    [t for _, t, _ in timed],
                    [s[0] for _, _, s in timed],
                    kind="line" if len(timed) > 1 and series[0].ratio is not None else "points",
                    low=[s[1] for _, _, s in timed],
                    high=[s[2] for _, _, s in timed],
                    notes=[i.note for i, _, _ in timed],
                    color=color,
                    marker=marker,
                )
            )
        panels.append(panel)
    caption = (
        f"{_metric_caption(grouped)} {TTFT_DEFINITION} {legend.label(legend.subject)} points are labelled with "
        f"their recompute ratio r. {_samples(infos)}."
    )
    return panels, _titled("Quality vs. time to first token", grouped), caption, 3


# ---------------------------------------------------------------------- Fig. 16: quality and TTFT vs ratio
def ratio(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    grouped = {key: runs for key, runs in groups(infos).items() if any(i.ratio is not None for i in runs)}
    if not grouped:
        raise ConfigError(
            f"the ratio figure needs {legend.subject} runs (at several method.recompute_ratio values)",
            f"e.g. kvbench run -m method={legend.subject} method.recompute_ratio=0.05,0.15,0.3,0.5 task=rag ...",
        )
    panels = []
    for (model, dataset), runs in grouped.items():
        where = f"{_where(model, dataset)}: " if len(grouped) > 1 else ""
        quality = Panel(
            f"{where}Quality", RATIO_AXIS, f"{_metric(dataset)} (0–100)", xpercent=True, xlim=(0, None), ylim=(0, None)
        )
        ttft = Panel(
            f"{where}Time to first token", RATIO_AXIS, "mean TTFT (s)", xpercent=True, xlim=(0, None), ylim=(0, None)
        )
        palette = Palette(legend)
        for series in series_of(runs, legend):
            color, marker, line = palette.style(series[0].method)
            scored = [(i, s) for i in series if (s := _score(i)) is not None]
            timed = [i for i in series if i.ttft is not None]
            label = series[0].label
            if series[0].ratio is not None:  # (then every run of the series has one)
                at = [(r, s) for i, s in scored if (r := i.ratio) is not None]
                quality.series.append(
                    Series(
                        label,
                        [r for r, _ in at],
                        [s[0] for _, s in at],
                        low=[s[1] for _, s in at],
                        high=[s[2] for _, s in at],
                        color=color,
                        marker=marker,
                    )
                )
                when = [(r, t) for i in timed if (r := i.ratio) is not None and (t := i.ttft) is not None]
                ttft.series.append(
                    Series(label, [r for r, _ in when], [t for _, t in when], color=color, marker=marker)
                )
                continue
            for info in series:  # a method without a ratio: one reference line per run
                if (s := _score(info)) is not None:
                    band = info.method == legend.baseline
                    quality.series.append(
                        Series(
                            label,
                            [0.0],
                            [s[0]],
                            kind="hline",
                            low=[s[1]] if band else None,
                            high=[s[2]] if band else None,
                            color=color,
                            linestyle=line,
                        )
                    )
                if info.ttft is not None:
                    ttft.series.append(Series(label, [0.0], [info.ttft], kind="hline", color=color, linestyle=line))
        panels += [quality, ttft]
    caption = (
        f"r: method.recompute_ratio, the share of the non-query tokens {legend.label(legend.subject)} recomputes "
        f"after its check layer. {_metric_caption(grouped)} Methods without a ratio are horizontal lines (full "
        f"recompute's CI shaded). {TTFT_DEFINITION} {_samples(infos)}."
    )
    return panels, _titled("Quality and TTFT vs. recompute ratio", grouped), caption, 2


# ---------------------------------------------------------------------- Figs. 7–8: KV deviation
def deviation(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    profiled = [i for i in infos if i.deviations]
    if not profiled:
        raise ConfigError(
            "the deviation figure needs runs with profile.deviation=true",
            f"e.g. kvbench run method={legend.reuse} task=rag profile.deviation=true ...",
        )
    grouped = groups(profiled)
    panels, layers = [], set()
    for (model, dataset), runs in grouped.items():
        where = f"{_where(model, dataset)}: " if len(grouped) > 1 else ""
        n_layers = len(runs[0].deviations[0]["reused_kv_quantiles"])
        layer = n_layers // 2
        layers.add((layer, n_layers))
        spread = Panel(
            f"{where}KV deviation on layer {layer} (of {n_layers})",
            "reused tokens ranked by KV deviation, largest first",
            r"KV deviation $\|V - V_{\mathrm{full}}\|_2^2$",
            xpercent=True,
            shade=(0.0, 0.15),
        )
        spearman = Panel(
            f"{where}Rank correlation of KV deviation, layers i and i+1",
            "layer i",
            "Spearman correlation",
            xinteger=True,
        )
        palette = Palette(legend)
        shares = []
        for label, members in _same_curves(runs, legend):
            color, marker, _ = palette.style(members[0].method)
            dev = members[0].deviations
            curves = np.array([d["reused_kv_quantiles"][layer][::-1] for d in dev if d["reused_kv_quantiles"][layer]])
            if curves.size:
                spread.series.append(
                    Series(
                        label,
                        list(np.linspace(0.0, 1.0, curves.shape[1])),
                        list(curves.mean(axis=0)),
                        color=color,
                        marker="",
                    )
                )
            shares.append(float(np.mean([d["reused_kv_top15_share"][layer] for d in dev])))
            rho = _by_layer(dev)
            if rho:
                x, mean, low, high = zip(*rho)
                spearman.series.append(
                    Series(
                        label,
                        list(x),
                        list(mean),
                        low=list(low),
                        high=list(high),
                        band=True,
                        color=color,
                        marker=marker,
                    )
                )
        lowest = min((min(series.low or [0.0]) for series in spearman.series), default=0.0)
        spearman.ylim = (min(0.0, lowest - 0.05), 1.03)  # the full scale of a correlation, as the paper's Fig. 8
        if shares:
            spread.note = (
                "top 15% of tokens: " + ", ".join(f"{100 * s:.0f}%" for s in shares) + " of the total deviation"
            )
        panels += [spread, spearman]
    caption = (
        "KV deviation: a reused (re-rotated, not recomputed) token's squared L2 distance between its cached V and "
        f"the V of a full prefill, summed over heads and dimensions (the quantity {legend.label(legend.subject)} "
        "ranks by); left: the "
        "mean over samples of each sample's deviation at each rank, top 15% shaded; right: Spearman rank "
        "correlation of the per-token deviations of consecutive layers, mean over samples, min–max shaded (pairs with "
        "a layer that does not deviate, such as layer 0, left out). "
        f"Runs whose curves are identical share a line. {_samples(profiled)}."
    )
    return panels, _titled("KV deviation of reused tokens", grouped), caption, 2


def _same_curves(runs: list[RunInfo], legend: Legend) -> list[tuple[str, list[RunInfo]]]:
    """Runs with identical deviation records (a reused token's deviation does not depend on how many
    tokens a method recomputes afterwards) merged under one label, e.g. ``Full KV reuse, CacheBlend (r=0.15, 0.5)``."""
    merged: list[tuple[Any, list[RunInfo]]] = []
    for series in series_of(runs, legend):
        for info in series:
            key = [(d["reused_kv_mean"], d["spearman"]) for d in info.deviations]
            for known, members in merged:
                if known == key:
                    members.append(info)
                    break
            else:
                merged.append((key, [info]))
    out = []
    for _, members in merged:
        parts: dict[str, list[str]] = {}
        for info in members:
            parts.setdefault(info.label, []).extend([f"{info.ratio:g}"] if info.ratio is not None else [])
        out.append((", ".join(f"{label} (r={', '.join(r)})" if r else label for label, r in parts.items()), members))
    return out


def _by_layer(deviations: list[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """Per layer pair (i, i+1): (i, mean, min, max) of the Spearman correlation over the samples. A pair
    with a layer whose reused tokens do not deviate at all is left out: there is nothing to rank (layer
    0, whose K/V depend on the token alone, is such a layer); so is a sample's None (a constant vector)."""
    out = []
    for layer in range(max((len(d["spearman"]) for d in deviations), default=0)):
        values = [
            d["spearman"][layer]
            for d in deviations
            if layer < len(d["spearman"])
            and d["spearman"][layer] is not None
            and d["reused_kv_mean"][layer] > 0
            and d["reused_kv_mean"][layer + 1] > 0
        ]
        if values:
            out.append((layer, float(np.mean(values)), float(np.min(values)), float(np.max(values))))
    return out


# ---------------------------------------------------------------------- Fig. 6: attention deviation vs ratio
def selection(infos: list[RunInfo], legend: Legend) -> tuple[list[Panel], str, str, int]:
    profiled = [
        i
        for i in infos
        if (i.ratio is not None or i.method == legend.reuse)
        and i.deviations
        and any(d.get("attention_mean") is not None for d in i.deviations)
    ]
    grouped = {key: runs for key, runs in groups(profiled).items() if any(i.ratio is not None for i in runs)}
    if not grouped:
        raise ConfigError(
            f"the selection figure needs {legend.subject} runs with profile.deviation=true",
            f"e.g. kvbench run -m method={legend.subject} method.selection=hkvd,random "
            "method.recompute_ratio=0.05,0.15,0.3 profile.deviation=true task=rag ...",
        )
    panels = []
    for (model, dataset), runs in grouped.items():
        panel = _panel(
            grouped,
            model,
            dataset,
            RATIO_AXIS,
            r"attention deviation $\|A - A_{\mathrm{full}}\|_F$",
            xpercent=True,
            xlim=(0, None),
            ylim=(0, None),
        )
        palette = Palette(legend)
        for series in series_of(runs, legend):
            color, marker, line = palette.style(series[0].method)
            label = _selection_label(series[0])
            points = [
                (i, _mean_se([d["attention_mean"] for d in i.deviations if d.get("attention_mean") is not None]))
                for i in series
            ]
            if series[0].ratio is None:
                for _, (mean, _se) in points:
                    panel.series.append(Series(label, [0.0], [mean], kind="hline", color=color, linestyle=line))
                continue
            at = [(r, m, s) for i, (m, s) in points if (r := i.ratio) is not None]  # (every run of the series)
            panel.series.append(
                Series(
                    label,
                    [r for r, _, _ in at],
                    [m for _, m, _ in at],
                    low=[m - s for _, m, s in at],
                    high=[m + s for _, m, s in at],
                    color=color,
                    marker=marker,
                )
            )
        panels.append(panel)
    caption = (
        "Attention deviation: Frobenius norm of the difference between the query rows' attention (softmax over "
        "every prompt key) under reuse and under a full prefill, mean over heads and layers; mean over samples, "
        "bars: ±1 standard error. HKVD selection recomputes the tokens whose V deviates most at the check layer; "
        f"random selection recomputes as many tokens drawn at random. {_samples(profiled)}."
    )
    return panels, _titled("Attention deviation: HKVD vs. random selection", grouped), caption, 3


def _selection_label(info: RunInfo) -> str:
    if "method.selection" not in info.settings:  # a method without a selection rule: its plain label
        return info.label
    choice = {"hkvd": "HKVD selection", "random": "random selection"}.get(
        str(info.settings.get("method.selection")), ""
    )
    rest = ", ".join(p for p in info.variant.split(", ") if p and not p.startswith("selection="))
    return f"{info.name}, {choice}" + (f" ({rest})" if rest else "")


def _mean_se(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=float)
    se = float(array.std(ddof=1) / np.sqrt(len(array))) if len(array) > 1 else 0.0
    return float(array.mean()), se


BUILDERS: dict[str, Builder] = {
    "quality_ttft": quality_ttft,
    "ratio": ratio,
    "deviation": deviation,
    "selection": selection,
}
