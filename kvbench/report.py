"""Tables of finished runs (markdown, CSV, LaTeX): one row per run, or a pivot of one metric.

A pivot is how the papers print comparisons (methods down, question positions or budgets across);
``--where`` narrows a folder of many runs to one study (``task=niah``, ``budget=256 tokens``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

COLUMNS = {
    "config.model.name": "model",
    "config.method.name": "method",
    "config.task.name": "task",
    "config.task.lengths": "lengths",
    "budget.label": "budget",
    "protocol.question_position": "question",
    "n": "n",
    "score": "score",
    "score_ci95": "95% CI",
    "recall": "recall",
    "hit_rate": "hit rate",
    "kv_bytes_ratio": "KV kept",
    "attended_tokens": "attended",
    "ttft_s": "TTFT s",
    "tt2t_s": "TT2T s",
    "tpot_s": "TPOT s",
}


#: besides the short names, any flattened key of a run works: ``config.method.metric``, ``bytes_h2d``, ...
KEY_HINT = f"a column of: {', '.join(COLUMNS.values())}; or any flattened key such as config.method.metric"


def runs_frame(paths: Iterable[str | Path], *, every_column: bool = False):
    """Runs as a DataFrame with the short column names; ``every_column`` keeps the other keys too."""
    from kvbench.results import load

    frame = load(list(paths))
    if frame.empty:
        return frame
    if not every_column:
        frame = frame[[c for c in COLUMNS if c in frame.columns]]
    return frame.rename(columns=COLUMNS)


def runs_table(paths: Iterable[str | Path], fmt: str = "md") -> str:
    """One row per run with its headline metrics."""
    frame = runs_frame(paths)
    if frame.empty:
        return "(no finished runs found)"
    frame = frame.sort_values([c for c in ("task", "model", "question", "method") if c in frame.columns])
    if fmt == "csv":
        return frame.to_csv(index=False)
    if fmt == "latex":
        return frame.to_latex(index=False, float_format="%.3g", na_rep="–")
    return to_markdown(frame)


def parse_where(items: Iterable[str]) -> dict[str, str]:
    """``["method=oracle", "budget=256 tokens"]`` → ``{"method": "oracle", "budget": "256 tokens"}``."""
    from kvbench.errors import ConfigError

    where: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad --where {item!r}", f"use <column>=<value> with {KEY_HINT}")
        where[key] = value
    return where


def filtered(frame, where: dict[str, str]):
    """Rows of ``frame`` whose columns equal ``where``'s values (compared as text, or as numbers when the
    value is one: ``512`` matches a column pandas holds as ``512.0``; ``None`` or ``null`` matches a
    missing value)."""
    import pandas as pd

    for key, value in where.items():
        if key not in frame.columns:
            return frame.iloc[0:0]
        if value in ("None", "null"):
            frame = frame[frame[key].isna()]
            continue
        equal = frame[key].astype(str) == value
        try:
            equal |= pd.to_numeric(frame[key], errors="coerce") == float(value)
        except ValueError:
            pass
        frame = frame[equal]
    return frame


def pivot_table(
    paths: Iterable[str | Path],
    rows: list[str],
    cols: list[str],
    value: str = "score",
    where: dict[str, str] | None = None,
    fmt: str = "md",
) -> str:
    """One metric of many runs as a grid: ``rows`` keys down, ``cols`` keys across.

    Two runs landing in the same cell is an error (it would hide one of them): add a ``where`` filter
    or another key.
    """
    from kvbench.errors import ConfigError

    frame = runs_frame(paths, every_column=True)
    rows, cols, value = [COLUMNS.get(k, k) for k in rows], [COLUMNS.get(k, k) for k in cols], COLUMNS.get(value, value)
    where = {COLUMNS.get(k, k): v for k, v in (where or {}).items()}
    keys = [*rows, *cols, value]
    unknown = [k for k in keys if k not in COLUMNS.values() and k not in frame.columns]
    if unknown:
        raise ConfigError(f"unknown report column(s) {', '.join(unknown)}", f"use {KEY_HINT}")
    frame = filtered(frame, where)
    if frame.empty:
        return "(no finished runs match)"
    frame = frame.copy()
    for key in [*rows, *cols]:
        frame[key] = frame[key].map(_label) if key in frame.columns else "–"
    if value not in frame.columns:
        frame[value] = None
    clash = frame.duplicated(subset=[*rows, *cols], keep=False)
    if clash.any():
        first = frame[clash].iloc[0]
        cell = ", ".join(f"{k}={first[k]}" for k in [*rows, *cols])
        raise ConfigError(f"several runs share the cell ({cell})", "narrow the runs with --where or add a key to --rows/--cols")
    grid = frame.pivot(index=rows, columns=cols, values=value) if cols else frame.set_index(rows)[[value]]
    grid = grid.sort_index(key=_natural_order)
    if cols:
        grid = grid.sort_index(axis=1, key=_natural_order)
    grid = grid.reset_index()
    grid.columns = [" · ".join(str(p) for p in c if str(p)) if isinstance(c, tuple) else str(c) for c in grid.columns]
    if fmt == "csv":
        return grid.to_csv(index=False)
    if fmt == "latex":
        return grid.to_latex(index=False, float_format="%.3g", na_rep="–")
    return to_markdown(grid)


def comparison_figure(paths: Iterable[str | Path], out: Path, where: dict[str, str] | None = None) -> Path:
    """The matching runs (all of one task) in the task's comparison figure: NIAH heatmaps side by side,
    PG19 perplexity curves overlaid. Each run is titled by the columns that differ between them."""
    from kvbench.errors import ConfigError
    from kvbench.results import RunDir
    from kvbench.tasks import REGISTRY

    frame = filtered(runs_frame(paths, every_column=True), {COLUMNS.get(k, k): v for k, v in (where or {}).items()})
    if frame.empty:
        raise ConfigError("no finished runs match", "check the folder and the --where filters")
    tasks = sorted(frame["task"].unique())
    if len(tasks) > 1:
        raise ConfigError(f"the matching runs span several tasks ({', '.join(tasks)})", "add --where task=<name>")
    frame = frame.assign(_dense=frame.get("budget", "") != "full cache")  # the uncompressed reference first
    frame = frame.sort_values([c for c in ("model", "question", "_dense", "budget", "method") if c in frame.columns])
    shown = [c for c in ("model", "method", "budget", "question", "lengths") if c in frame.columns
             and frame[c].astype(str).nunique() > 1] or ["method"]
    runs = []
    for _, row in frame.iterrows():
        # first line: the method (or what else differs); second line: the rest, and the run's score
        head, rest = shown[:1], shown[1:]
        title = " · ".join(str(row[c]) for c in head)
        second = " · ".join(str(row[c]) for c in rest)
        if row.get("score") == row.get("score") and row.get("score") is not None:
            second += f"  ({row['score']:.1f})"
        title = f"{title}\n{second.strip()}" if second.strip() else title
        runs.append((title, RunDir(Path(row["run_dir"])).records()))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return REGISTRY.get(tasks[0]).comparison_figure(runs, out)


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _label(value) -> str:
    """A cell key as text: ``256`` rather than ``256.0``, ``–`` for missing."""
    if _missing(value):
        return "–"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _natural_order(index):
    """Sort keys numerically where they are numbers (256 before 1024), as text otherwise."""
    import pandas as pd

    def key(text: str):
        try:
            return (0, float(text), "")
        except ValueError:
            return (1, 0.0, text)

    return pd.Index([key(str(v)) for v in index], tupleize_cols=False)


def to_markdown(frame) -> str:
    def cell(value) -> str:
        if _missing(value):
            return "–"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])


def protocol_diff(run_a: str | Path, run_b: str | Path) -> str:
    """Markdown table of every config and protocol value that differs between two runs."""
    import json

    import yaml

    def flat(run: Path) -> dict:
        from kvbench.results import _flatten

        out: dict = {}
        config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
        _flatten("config", config, out)
        metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").exists() else {}
        _flatten("protocol", metrics.get("protocol", {}), out)
        return out

    a, b = flat(Path(run_a)), flat(Path(run_b))
    rows = [(key, a.get(key, "–"), b.get(key, "–")) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    if not rows:
        return "(the two runs share every config and protocol value)"
    lines = [f"| key | {Path(run_a).name} | {Path(run_b).name} |", "|---|---|---|"]
    lines += [f"| {key} | {va} | {vb} |" for key, va, vb in rows]
    return "\n".join(lines)
