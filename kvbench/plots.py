"""Figures: needle-in-a-haystack heatmaps in the style of the papers (greener = better)."""

from __future__ import annotations

import os
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
        grid[depths.index(float(record["meta"]["depth"])), lengths.index(int(record["meta"]["length"]))] = record["score"]
    return lengths, depths, grid


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
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns + 1.2, height * rows + 0.4), dpi=120,
                             squeeze=False, layout="constrained")
    image = None
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


def curves_figure(points: Any, path: Path, *, title: str = "", xlabel: str = "", ylabel: str = "",
                  logx: bool = False, logy: bool = False) -> Path:
    """Lines of ``y`` against ``x``, one per ``series``, one panel per ``split`` (a DataFrame with those
    columns, and optionally ``label`` to annotate each point): recall against budget (ClusterKV Fig. 11),
    latency against context length (PQCache Fig. 11), quality against TTFT (CacheBlend Figs. 12, 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = list(dict.fromkeys(points["split"]))
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits) + 0.6, 3.6), dpi=120, squeeze=False,
                             layout="constrained")
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
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(_wrap(" · ".join(p for p in (title, str(split)) if p), 60), fontsize=9)
        ax.grid(alpha=0.3)
        if part["series"].nunique() > 1 or part["series"].iloc[0]:
            ax.legend(fontsize=7)
    return _save(fig, path)
