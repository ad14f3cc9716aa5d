"""Figures: needle-in-a-haystack heatmaps in the style of the papers (greener = better), perplexity
curves, and panels of labelled series (:func:`series_panels`: the CacheBlend figures of the rag task,
whose data :mod:`kvbench.figures.rag` prepares), score by question index for shared-context
multi-query runs, RULER's score against length."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Kamradt's palette, used by PQCache Fig. 9 and most NIAH figures: red (0) → yellow → green (100).
NIAH_COLORS = ("#F0496E", "#EBB839", "#0CD79F")


def _niah_grid(records: list[dict[str, Any]]):
    import numpy as np

    lengths = sorted({int(r["meta"]["length"]) for r in records})
    depths = sorted({float(r["meta"]["depth"]) for r in records})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for record in records:
        row, col = depths.index(float(record["meta"]["depth"])), lengths.index(int(record["meta"]["length"]))
        grid[row, col] = record["score"]
    return lengths, depths, grid


def _reserve_bottom(fig: Any, share: float) -> None:
    """Keep the bottom ``share`` of a constrained-layout figure free (for its caption)."""
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    engine = fig.get_layout_engine()
    assert isinstance(engine, ConstrainedLayoutEngine)
    engine.set(rect=(0, share, 1, 1 - share))


def _draw_niah(ax: Any, records: list[dict[str, Any]], title: str, *, labels: bool = True) -> Any:
    """One depth (rows, 0 = top) × length (columns) heatmap on ``ax``; returns the image."""
    import numpy as np
    from matplotlib.colors import LinearSegmentedColormap

    lengths, depths, grid = _niah_grid(records)
    cmap = LinearSegmentedColormap.from_list("niah", NIAH_COLORS)
    image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=100, aspect="auto")
    for row in range(len(depths)):
        for col in range(len(lengths)):
            if not np.isnan(grid[row, col]):
                ax.text(col, row, f"{grid[row, col]:.0f}", ha="center", va="center", fontsize=8, color="black")
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    if labels:
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=9)
    return image


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def niah_heatmap(records: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Depth (rows, 0 = top of the document) × length (columns) heatmap of scores, 0–100."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, _ = _niah_grid(records)
    # wide enough for the axis labels and the title even for a 1 x 1 grid; long titles wrap
    width = max(1.2 + 0.9 * len(lengths), 4.0)
    fig, ax = plt.subplots(figsize=(width, 1.4 + 0.55 * len(depths)), dpi=120, layout="constrained")
    image = _draw_niah(ax, records, _wrap(title, int(width * 11)))
    fig.colorbar(image, ax=ax, label="score")
    return _save(fig, path)


def _wrap(title: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.fill(line, width) for line in title.splitlines()) if title else title


def niah_panels(panels: list[tuple[str, list[dict[str, Any]]]], path: Path, *, columns: int = 4) -> Path:
    """Several runs' NIAH heatmaps side by side, one titled panel each (PQCache Fig. 9).

    Panels share the depth axis labels (only the first column shows them) when every run has the same
    depth grid; runs with different grids keep their own labels, so no row is read against the wrong
    depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    grids = [_niah_grid(records)[:2] for _, records in panels]
    shared = len({tuple(depths) for _, depths in grids}) == 1
    n_lengths, n_depths = max(len(lengths) for lengths, _ in grids), max(len(depths) for _, depths in grids)
    width, height = max(0.8 + 0.8 * n_lengths, 2.2) + (0 if shared else 0.5), 1.0 + 0.4 * n_depths
    fig, axes = plt.subplots(
        rows,
        columns,
        figsize=(width * columns + 1.2, height * rows + 0.4),
        dpi=120,
        squeeze=False,
        layout="constrained",
    )
    image: Any = None
    for index, ax in enumerate(axes.flat):
        if index >= len(panels):
            ax.axis("off")
            continue
        title, records = panels[index]
        image = _draw_niah(ax, records, title, labels=False)
        if index % columns and shared:
            ax.tick_params(labelleft=False)
    fig.supxlabel("context length (tokens)", fontsize=9)
    fig.supylabel("needle depth", fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="score", shrink=0.8)
    return _save(fig, path)


def perplexity_curves(curves: dict[str, list[list[float]]], path: Path, *, title: str = "") -> Path:
    """Cumulative perplexity against position, one line per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    for label, curve in curves.items():
        if curve:
            ax.plot([p for p, _ in curve], [v for _, v in curve], label=label, linewidth=1.2)
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("cumulative perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------------- series panels (the rag figures)
@dataclass
class Series:
    """One labelled series of a :class:`Panel`.

    ``kind``: ``line`` (points joined in the given order), ``points`` (markers only) or ``hline`` (a
    reference value ``y[0]`` across the panel, for a method that has no x value, such as full recompute
    on a recompute-ratio axis). ``low``/``high`` bound each point (error bars; for an ``hline``, a
    shaded band); with ``band`` a line's bounds are shaded instead of drawn as bars. ``notes`` are short
    texts written next to the points (a recompute ratio beside its point)."""

    label: str
    x: list[float]
    y: list[float]
    kind: str = "line"
    low: list[float] | None = None
    high: list[float] | None = None
    band: bool = False
    notes: list[str] | None = None
    color: str | None = None
    marker: str = "o"
    linestyle: str = "-"


@dataclass
class Panel:
    """One axes: a title, axis labels (with units), its series, and an optional one-line ``note``
    printed inside the axes. ``xpercent`` shows x fractions as percentages, ``xinteger`` only whole x
    ticks (layers); ``shade`` is an x interval to shade (the top 15 % of tokens of a deviation curve);
    ``xlim``/``ylim`` fix an end of an axis (None: automatic), e.g. time axes that start at 0."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    note: str = ""
    xpercent: bool = False
    shade: tuple[float, float] | None = None
    xinteger: bool = False
    xlim: tuple[float | None, float | None] | None = None
    ylim: tuple[float | None, float | None] | None = None


def series_panels(
    panels: list[Panel],
    path: Path,
    *,
    title: str,
    caption: str = "",
    columns: int = 2,
    panel_size: tuple[float, float] = (4.6, 3.4),
) -> Path:
    """Panels of line/point/reference series in a grid, with a figure title and a caption under it
    (the metric definitions), as a paper prints a figure. Each panel has its own legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    width = max(panel_size[0] * columns, 6.4)
    caption = _wrap(caption, int(width * 17)) if caption else ""
    caption_in = 0.12 + 0.125 * (caption.count("\n") + 1) if caption else 0.0
    height = panel_size[1] * rows + 0.5 + caption_in
    fig, axes = plt.subplots(rows, columns, figsize=(width, height), dpi=150, squeeze=False, layout="constrained")
    _reserve_bottom(fig, caption_in / height)
    for index, ax in enumerate(axes.flat):
        if index >= len(panels):
            ax.axis("off")
            continue
        _draw_panel(ax, panels[index])
    fig.suptitle(_wrap(title, int(width * 12)), fontsize=11)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7.5, va="bottom", ha="left", color="#333333")
    return _save(fig, path)


def _pinned(data: Any, limits: tuple[float | None, float | None]) -> tuple[float, float]:
    """Axis limits with the given ends pinned and the free ones 6 % of the span beyond the data (the
    automatic margin would be computed on the data alone, and sit too close once an end is pinned at 0)."""
    low, high = (float(v) for v in data)
    lo = limits[0] if limits[0] is not None else None
    hi = limits[1] if limits[1] is not None else None
    span = (hi if hi is not None else high) - (lo if lo is not None else low)
    pad = 0.06 * span if span > 0 else max(1.0, 0.1 * abs(high))  # all data at the pinned end: show a unit
    return (lo if lo is not None else low - pad, hi if hi is not None else high + pad)


def _draw_panel(ax: Any, panel: Panel) -> None:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    for series in panel.series:
        color = series.color
        if series.kind == "hline":
            line = ax.axhline(series.y[0], color=color, linestyle=series.linestyle, linewidth=1.3, label=series.label)
            if series.low is not None and series.high is not None:
                ax.axhspan(series.low[0], series.high[0], color=line.get_color(), alpha=0.1, linewidth=0)
            continue
        style = series.linestyle if series.kind == "line" else "none"
        yerr = None
        if series.low is not None and series.high is not None and not series.band:
            yerr = [
                [max(0.0, y - lo) for y, lo in zip(series.y, series.low)],
                [max(0.0, hi - y) for y, hi in zip(series.y, series.high)],
            ]
        drawn = ax.errorbar(
            series.x,
            series.y,
            yerr=yerr,
            color=color,
            marker=series.marker,
            linestyle=style,
            linewidth=1.4,
            markersize=5.5 if len(series.x) <= 12 else 3.5,
            capsize=2.5,
            elinewidth=0.9,
            label=series.label,
            clip_on=False,
            zorder=3,
        )
        color = drawn.lines[0].get_color()
        if series.band and series.low is not None and series.high is not None:
            ax.fill_between(series.x, series.low, series.high, color=color, alpha=0.15, linewidth=0)
        for x, y, note in zip(series.x, series.y, series.notes or []):
            if note:
                ax.annotate(note, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=color)
    if panel.shade is not None:
        ax.axvspan(*panel.shade, color="#999999", alpha=0.12, linewidth=0)
    if panel.xpercent:
        ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    if panel.xinteger:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.xlim is not None:
        ax.set_xlim(*_pinned(ax.dataLim.intervalx, panel.xlim))
    if panel.ylim is not None:
        ax.set_ylim(*_pinned(ax.dataLim.intervaly, panel.ylim))
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel(panel.xlabel, fontsize=8.5)
    ax.set_ylabel(panel.ylabel, fontsize=8.5)
    ax.tick_params(labelsize=7.5)
    ax.grid(alpha=0.25, linewidth=0.6)
    if panel.note:
        ax.text(
            0.98,
            0.97,
            panel.note,
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=7.5,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": "#bbbbbb", "alpha": 0.9},
        )
    if panel.series:
        ax.legend(fontsize=7, loc="best", framealpha=0.9)


# ---------------------------------------------------------------------- CacheBlend system figures
def stream_figure(
    curves: list[tuple[str, list[dict[str, Any]]]],
    path: Path,
    *,
    title: str,
    caption: str = "",
    colors: dict[str, str] | None = None,
) -> Path:
    """TTFT under load against achieved throughput (CacheBlend Fig. 14): per run, the p50 (solid) and p90
    (dashed) TTFT at each arrival rate, on a log time axis; ``curves`` are ``(label, rows)`` with rows of
    :func:`kvbench.stream.stream_stats` (``throughput``, ``ttft_p50_s``, ``ttft_p90_s``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    caption = _wrap(caption, 115) if caption else ""
    caption_in = 0.15 + 0.11 * (caption.count("\n") + 1) if caption else 0.0
    # one legend line per run below the axes (labels are long), then the two line styles
    labels = [_wrap(label, 110) for label, _ in curves]
    legend_in = 0.25 + 0.125 * (sum(label.count("\n") + 1 for label in labels) + 1)
    height = 4.0 + legend_in + caption_in
    fig, ax = plt.subplots(figsize=(6.4, height), dpi=150, layout="constrained")
    _reserve_bottom(fig, caption_in / height)
    handles = []
    for (label, rows), text in zip(curves, labels):
        x = [row["throughput"] for row in rows]
        color = (colors or {}).get(label)
        line = ax.plot(
            x, [row["ttft_p50_s"] for row in rows], marker="o", markersize=4, linewidth=1.5, color=color, label=text
        )[0]
        ax.plot(
            x,
            [row["ttft_p90_s"] for row in rows],
            marker="^",
            markersize=4,
            linewidth=1.1,
            linestyle="--",
            color=line.get_color(),
        )
        handles.append(line)
    styles = [
        Line2D([], [], color="#555555", marker="o", markersize=4, linewidth=1.5, label="p50 (solid)"),
        Line2D([], [], color="#555555", marker="^", markersize=4, linewidth=1.1, linestyle="--", label="p90 (dashed)"),
    ]
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (requests/s)", fontsize=9)
    ax.set_ylabel("TTFT incl. queueing (s, log scale)", fontsize=9)
    ax.grid(alpha=0.3, which="both", linewidth=0.5)
    ax.add_artist(ax.legend(handles=styles, fontsize=7, loc="upper left"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=6.5, frameon=False)
    ax.set_title(_wrap(title, 80), fontsize=10)
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=6.5, va="bottom", ha="left", color="#333333")
    return _save(fig, path)


# ---------------------------------------------------------------------- multi-query and RULER
def _label(title: str) -> str:
    """A run's panel title (``kvbench report``'s, two lines, the score in brackets) as one legend line."""
    import re

    return re.sub(r"\s*\([-\d.]+\)\s*$", "", " · ".join(part for part in title.splitlines() if part.strip()))


def score_by_query(runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
    """Mean score at each question index (1 = the first question about a context), one line per run,
    one panel per compression mode (question-aware: the method compressed with the first question in
    view; question-agnostic: before any question) — first vs follow-up questions at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes: dict[str, list[tuple[str, dict[int, float]]]] = {}
    for title, records in runs:
        by_index: dict[int, list[float]] = {}
        for record in records:
            for query in record.get("queries") or []:
                by_index.setdefault(int(query["index"]), []).append(float(query["score"]))
        if not by_index:
            continue
        mode = str(next((r["meta"].get("compression") for r in records if r.get("meta")), "question_aware"))
        modes.setdefault(mode, []).append((_label(title), {i: float(np.mean(v)) for i, v in sorted(by_index.items())}))
    if not modes:
        from kvbench.errors import ConfigError

        raise ConfigError(
            "none of the matching runs asked several questions per context",
            "run with task.queries_per_context=N (N > 1) or task.compression=question_agnostic",
        )
    order = [m for m in ("question_aware", "question_agnostic") if m in modes] + sorted(
        set(modes) - {"question_aware", "question_agnostic"}
    )
    labels = sorted({label for lines in modes.values() for label, _ in lines})
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(
        1, len(order), figsize=(4.6 * len(order) + 2.2, 3.6), dpi=120, squeeze=False, sharey=True, layout="constrained"
    )
    for ax, mode in zip(axes[0], order):
        for label, curve in modes[mode]:
            xs = [i + 1 for i in curve]
            ax.plot(xs, list(curve.values()), marker="o", linewidth=1.4, color=colors[label], label=label)
        ax.set_title(mode.replace("_", "-"), fontsize=9)
        ax.set_xlabel("question about the context")
        ax.set_xticks(sorted({i + 1 for _, c in modes[mode] for i in c}))
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles.keys()), loc="outside right center", fontsize=7)
    return _save(fig, path)


def ruler_by_length(runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
    """RULER's score (mean over its tasks of each task's mean) against the context length, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=120, layout="constrained")
    for title, records in runs:
        cells: dict[tuple[str, int], list[float]] = {}
        for record in records:
            meta = record.get("meta", {})
            cells.setdefault((str(meta.get("task")), int(meta.get("length"))), []).append(float(record["score"]))
        lengths = sorted({length for _, length in cells})
        means = [float(np.mean([np.mean(v) for (_, n), v in cells.items() if n == length])) for length in lengths]
        ax.plot(lengths, means, marker="o", linewidth=1.4, label=_label(title))
    ax.set_xscale("log", base=2)
    lengths = sorted({int(r["meta"]["length"]) for _, records in runs for r in records})
    ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("context length (tokens, generation included)")
    ax.set_ylabel("RULER score (mean over tasks)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


# ---------------------------------------------------------------------- curves (kvbench reproduce)
def _tick_label(x: float) -> str:
    """A swept value as a reader knows it: ``1/128`` for a fraction that is one over a whole number
    (communication ratios, token ratios like 1/5), else the shortest decimal (``0.3``, ``2048``)."""
    if 0 < x < 1 and abs(1 / x - round(1 / x)) < 1e-6 * (1 / x):
        return f"1/{round(1 / x)}"
    return f"{x:g}"


def curves_figure(
    points: Any,
    path: Path,
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """Lines of ``y`` against ``x``, one per ``series``, one panel per ``split`` (a DataFrame with those
    columns, and optionally ``label`` to annotate each point): recall against budget (ClusterKV Fig. 11),
    latency against context length (PQCache Fig. 11), quality against TTFT (CacheBlend Figs. 12, 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(points["split"]))
    fig, axes = plt.subplots(
        1, len(splits), figsize=(5.2 * len(splits) + 0.6, 3.6), dpi=120, squeeze=False, layout="constrained"
    )
    for ax, split in zip(axes.flat, splits):
        part = points[points["split"] == split]
        for name in dict.fromkeys(part["series"]):
            line = part[part["series"] == name].sort_values("x")
            ax.plot(line["x"], line["y"], marker="o", markersize=3.5, linewidth=1.2, label=name or ylabel)
            if "label" in line.columns:
                for x, y, text in zip(line["x"], line["y"], line["label"]):
                    ax.annotate(str(text), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log" if logx else "linear")
        ax.set_yscale("log" if logy else "linear")
        xs = sorted(set(part["x"]))
        if logx and len(xs) <= 8:  # a few swept values (1/128 ... 1/16): label those, not powers of ten
            ax.set_xticks(xs, [_tick_label(x) for x in xs])
            ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(_wrap(" · ".join(p for p in (title, str(split)) if p), 60), fontsize=9)
        ax.grid(alpha=0.3)
        if part["series"].nunique() > 1 or part["series"].iloc[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)
