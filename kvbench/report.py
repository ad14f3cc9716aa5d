"""Tables of runs (markdown, CSV, LaTeX): one row per run, or a pivot of one metric.

A pivot is how the papers print comparisons (methods down, question positions or budgets across);
``--where`` narrows a folder of many runs to one study (``task=niah``, ``budget=256 tokens``).

The runs table shows every run with its ``status`` — ``finished``, ``running 3/10``, ``unfinished
3/10`` (interrupted or killed; the same command resumes it), ``stopped 3/10 (SIGTERM)`` (or ``disk
full``: the same command resumes), ``failed 3/10``, ``stale`` (metrics.json counts other samples than
samples.jsonl holds: the row is recomputed from the samples; re-run to refresh) or ``damaged: <what>``
(a file of the run cannot be read: the other runs are listed all the same) — so an interrupted run
is not mistaken for a missing one. Pivots and figures compare finished runs only, and say how many they left
out.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

COLUMNS = {
    "config.model.name": "model",
    "config.method.name": "method",
    "config.task.name": "task",
    "config.task.lengths": "lengths",
    "budget.label": "budget",
    "protocol.question_position": "question",
    "status": "status",
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


def check_paths(paths: Iterable[str | Path]) -> list[Path]:
    """The results folders, each of which must exist (a typo should not read as "no runs")."""
    from kvbench.errors import ConfigError

    folders = [Path(p) for p in paths]
    for path in folders:
        if not path.exists():
            raise ConfigError(
                f"no results folder {path}",
                "pass the folder that holds your runs (kvbench run writes "
                "to results/runs unless output_dir= says otherwise)",
            )
    return folders


def runs_frame(paths: Iterable[str | Path], *, every_column: bool = False, subsets: bool = False):
    """Runs as a DataFrame with the short column names; ``every_column`` keeps the other keys too.
    ``subsets`` adds one row per subset of a run that reports subsets (``dataset`` = the subset, its
    score; the run's own row gets ``dataset=average``), as :func:`kvbench.render.long_frame` does."""
    from kvbench.results import load

    frame = load(list(paths))
    if frame.empty:
        return frame
    if subsets:
        from kvbench.render.frames import RUN_LEVEL, long_frame

        frame = long_frame(frame).drop(columns=[RUN_LEVEL])
    for key in ("config.model.name", "config.method.name", "config.task.name"):
        if key not in frame.columns:  # only damaged runs, whose config is unreadable
            frame[key] = None
    if not every_column:
        frame = frame[[c for c in COLUMNS if c in frame.columns]]
    return frame.rename(columns=COLUMNS)


def finished_runs(frame):
    """The finished runs of ``frame``; a note on stderr names how many others were left out."""
    if frame.empty or "state" not in frame.columns:
        return frame
    finished = frame["state"] == "finished"
    if (~finished).any():
        left = frame[~finished]
        print(
            f"kvbench: note: left out {len(left)} run(s) that are not finished "
            f"({', '.join(sorted(set(left['status'])))}); `kvbench report` lists them",
            file=sys.stderr,
        )
    return frame[finished]


def runs_table(
    paths: Iterable[str | Path],
    fmt: str = "md",
    where: dict[str, str] | None = None,
    settings: Mapping[str, str] | None = None,
) -> str:
    """One row per run with its status and headline metrics. ``settings`` (run id → what sets the run
    apart from the others of its sweep, e.g. ``store.tier=disk``) adds a "setting" column after the
    method, so that the runs of one method can be told apart."""
    frame = runs_frame(paths, every_column=bool(where) or settings is not None)
    if frame.empty:
        return f"(no runs found under {', '.join(str(p) for p in paths)})"
    if where:
        frame = filtered(frame, {COLUMNS.get(k, k): v for k, v in where.items()})
        if frame.empty:
            return "(no runs match)"
    shown = list(COLUMNS.values())
    if settings is not None:
        frame = frame.assign(setting=[settings.get(run_id) or "–" for run_id in frame["run_id"]])
        shown.insert(shown.index("method") + 1, "setting")
    frame = frame[[c for c in shown if c in frame.columns]]
    frame = frame.sort_values([c for c in ("task", "model", "question", "method", "setting") if c in frame.columns])
    if fmt == "csv":
        return frame.to_csv(index=False)
    if fmt == "latex":
        return frame.to_latex(index=False, float_format="%.3g", na_rep="–")
    return to_markdown(frame)


def parse_where(items: Iterable[str], flag: str = "--where") -> dict[str, str]:
    """``["method=oracle", "budget=256 tokens"]`` → ``{"method": "oracle", "budget": "256 tokens"}``; an
    item without ``=`` (or without a value, for ``--paired``) is refused naming ``flag``."""
    from kvbench.errors import ConfigError

    where: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or (flag == "--paired" and not value):
            raise ConfigError(f"bad {flag} {item!r}", f"use <column>=<value> with {KEY_HINT}")
        where[key] = value
    return where


def check_columns(frame, keys: Iterable[str], what: str) -> None:
    """Every key names a column of ``frame`` (or a short name); else one line listing the valid ones."""
    from kvbench.errors import ConfigError

    unknown = [k for k in keys if k not in COLUMNS.values() and k not in frame.columns]
    if not unknown:
        return
    valid = list(COLUMNS.values()) + sorted(c for c in frame.columns if c not in COLUMNS.values())
    close = difflib.get_close_matches(unknown[0], valid, n=3)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    shown = ", ".join(valid[:60]) + (f", ... ({len(valid) - 60} more)" if len(valid) > 60 else "")
    raise ConfigError(f"unknown {what} column(s) {', '.join(unknown)}", f"{hint}valid columns: {shown}")


def filtered(frame, where: dict[str, str]):
    """Rows of ``frame`` whose columns equal ``where``'s values (compared as text, or as numbers when the
    value is one: ``512`` matches a column pandas holds as ``512.0``; ``None`` or ``null`` matches a
    missing value). An unknown column is an error that lists the valid ones."""
    import pandas as pd

    if frame.empty:
        return frame
    check_columns(frame, where, "--where")
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
    """One metric of many runs as a grid: ``rows`` keys down, ``cols`` keys across. The key ``dataset``
    splits each run into its subsets (LongBench's datasets, RULER's tasks) plus their ``average``.

    Two runs landing in the same cell is an error (it would hide one of them): add a ``where`` filter
    or another key.
    """
    from kvbench.errors import ConfigError

    rows, cols, value = [COLUMNS.get(k, k) for k in rows], [COLUMNS.get(k, k) for k in cols], COLUMNS.get(value, value)
    frame = runs_frame(paths, every_column=True, subsets="dataset" in [*rows, *cols])
    if frame.empty:
        return f"(no runs found under {', '.join(str(p) for p in paths)})"
    where = {COLUMNS.get(k, k): v for k, v in (where or {}).items()}
    check_columns(frame, [*rows, *cols, value], "report")
    frame = finished_runs(filtered(frame, where))
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
        same = frame[(frame[[*rows, *cols]] == first[[*rows, *cols]]).all(axis=1)]
        differ = _differing_columns(same)
        example = f"--where {differ[0]}={_label(first[differ[0]])}" if differ else "--where <column>=<value>"
        wider = f"--pivot {','.join(rows + differ[:1])} {','.join(cols) or repr('')}"
        raise ConfigError(
            f"several runs share the cell ({cell}): {len(same)} runs"
            + (f" that differ in {', '.join(differ[:4])}" if differ else ""),
            f"narrow the runs ({example}), or add a column that differs to --pivot ROWS COLS (e.g. {wider})",
        )
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


class FigureRun(tuple[str, list[dict[str, Any]]]):
    """One run handed to a task's ``comparison_figure``: it unpacks as ``(title, records)`` — all a
    heatmap or a curve needs — and carries the run's resolved ``config`` for figures that place runs by
    their settings (the rag figures: method, recompute ratio, selection)."""

    config: dict[str, Any]

    def __new__(cls, title: str, records: list[dict[str, Any]], config: dict[str, Any] | None = None) -> FigureRun:
        run = super().__new__(cls, (title, records))
        run.config = config or {}
        return run


def comparison_figure(
    paths: Iterable[str | Path], out: Path, where: dict[str, str] | None = None, kind: str | None = None
) -> Path:
    """The matching runs (all of one task) in the task's comparison figure: NIAH heatmaps side by side,
    PG19 perplexity curves overlaid, the rag task's CacheBlend figures. Each run is titled by the columns
    that differ between them. ``kind`` picks one of the task's figures (``Task.figure_kinds``; the
    first is the default, and a note on stderr names the others)."""
    from kvbench.errors import ConfigError
    from kvbench.results import RunDir, run_records
    from kvbench.tasks import REGISTRY

    frame = runs_frame(paths, every_column=True)
    frame = finished_runs(filtered(frame, {COLUMNS.get(k, k): v for k, v in (where or {}).items()}))
    if frame.empty:
        raise ConfigError(
            "no finished runs match", "check the folder and the --where filters (`kvbench report` lists the runs)"
        )
    tasks = sorted(frame["task"].unique())
    if len(tasks) > 1:
        raise ConfigError(f"the matching runs span several tasks ({', '.join(tasks)})", "add --where task=<name>")
    task = REGISTRY.get(tasks[0])
    task.check_figure_kind(kind)
    kinds = task.figure_kinds
    if kind is None and len(kinds) > 1:
        print(
            f"kvbench: note: drew the {kinds[0]} figure; --figure-kind {'|'.join(kinds[1:])} draws the others",
            file=sys.stderr,
        )
    frame = frame.assign(_dense=frame.get("budget", "") != "full cache")  # the uncompressed reference first
    frame = frame.sort_values([c for c in ("model", "question", "_dense", "budget", "method") if c in frame.columns])
    shown = [
        c
        for c in ("model", "method", "budget", "question", "lengths")
        if c in frame.columns and frame[c].astype(str).nunique() > 1 and c not in task.figure_joins
    ] or ["method"]
    joined = _joined_runs(frame, task.figure_joins)
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    for rows in joined:
        row = rows[0]
        # first line: the method (or what else differs); second line: the rest, and the run's score
        head, rest = shown[:1], shown[1:]
        title = " · ".join(str(row[c]) for c in head)
        second = " · ".join(str(row[c]) for c in rest)
        if len(rows) == 1 and row.get("score") == row.get("score") and row.get("score") is not None:
            second += f"  ({row['score']:.1f})"
        title = f"{title}\n{second.strip()}" if second.strip() else title
        records = [record for r in rows for record in run_records(r)]
        runs.append(FigureRun(title, records, RunDir(Path(row["run_dir"])).config()))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return task.draw_figure(runs, out, kind)


def distinct_labels(labels: Sequence[str], configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """``labels`` (one per run, with its resolved config), where two runs would read alike extended by the
    config keys that tell them apart (``cacheblend · store.tier=disk``): for a figure whose lines are
    labelled by one line of text (the request-stream figure). A key a run was recorded without reads as
    its legacy value (:func:`kvbench.results.with_legacy`); the output folder and progress bars never count."""
    from kvbench.results import with_legacy

    def flat(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if isinstance(value, Mapping):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    flats = [flat(with_legacy(dict(config))) for config in configs]
    result = list(labels)
    for label in {x for x in labels if list(labels).count(x) > 1}:
        alike = [i for i, x in enumerate(labels) if x == label]
        keys = sorted({k for i in alike for k in flats[i]} - {"output_dir", "progress"})
        differing = [k for k in keys if len({repr(flats[i].get(k)) for i in alike}) > 1]
        for i in alike:
            result[i] = " · ".join([label, *(f"{k}={flats[i].get(k)}" for k in differing)])
    return result


def _joined_runs(frame, joins: Sequence[str]) -> list[list[Any]]:
    """The rows of ``frame`` in order, grouped so that runs differing only in the ``joins`` columns
    (and in what follows from them: run id, score, timings) share a group; one row per group without
    joins. Runs are the same when every other config key (``config.*``) agrees."""
    rows = [row for _, row in frame.iterrows()]
    if not joins:
        return [[row] for row in rows]
    dropped = {*joins, *(f"config.task.{c}" for c in joins), "config.output_dir"}
    renamed = {short for key, short in COLUMNS.items() if key.startswith("config.")}  # model, method, ...
    keys = sorted(c for c in frame.columns if (c.startswith("config.") or c in renamed) and c not in dropped)
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(json.dumps([str(row[c]) for c in keys]), []).append(row)
    return list(groups.values())


def _differing_columns(frame) -> list[str]:
    """Short names first, then config and protocol keys, whose values differ between the rows of ``frame``."""
    preferred = [c for c in COLUMNS.values() if c in frame.columns]
    others = sorted(
        c for c in frame.columns if c.startswith(("config.", "protocol.")) and c not in ("config.output_dir",)
    )
    out = []
    for column in preferred + others:
        if column in ("status", "state", "n", "score", "95% CI") or column in out:
            continue
        if frame[column].map(lambda v: _label(v) if not isinstance(v, (list, dict)) else str(v)).nunique() > 1:
            out.append(column)
    return out


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


def flat_protocol(run: Path) -> dict:
    """A run's config (``config.*``) and task protocol (``protocol.*``) as one flat mapping: what
    :func:`protocol_diff` compares, and what ``kvbench reproduce`` lists as our protocol."""
    from kvbench.results import _flatten, read_config, read_json

    out: dict = {}
    _flatten("config", read_config(run / "config.yaml")[0] or {}, out)  # damaged files read as empty
    _flatten("protocol", read_json(run / "metrics.json")[0].get("protocol", {}), out)
    return out


def protocol_diff(run_a: str | Path, run_b: str | Path) -> str:
    """Markdown table of every config and protocol value that differs between two runs."""
    a, b = flat_protocol(Path(run_a)), flat_protocol(Path(run_b))
    rows = [(key, a.get(key, "–"), b.get(key, "–")) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    if not rows:
        return "(the two runs share every config and protocol value)"
    lines = [f"| key | {Path(run_a).name} | {Path(run_b).name} |", "|---|---|---|"]
    lines += [f"| {key} | {va} | {vb} |" for key, va, vb in rows]
    return "\n".join(lines)
