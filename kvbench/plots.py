"""Figures: needle-in-a-haystack heatmaps in the style of the papers (greener = better), score by
question index for shared-context multi-query runs, RULER's score against length."""

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

        raise ConfigError("none of the matching runs asked several questions per context",
                          "run with task.queries_per_context=N (N > 1) or task.compression=question_agnostic")
    order = [m for m in ("question_aware", "question_agnostic") if m in modes] + sorted(set(modes) - {"question_aware", "question_agnostic"})
    labels = sorted({label for lines in modes.values() for label, _ in lines})
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, len(order), figsize=(4.6 * len(order) + 2.2, 3.6), dpi=120, squeeze=False,
                             sharey=True, layout="constrained")
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
