"""``curve`` (y against x, a line per series) and ``figure`` (the task's own comparison figure) render
items (:mod:`kvbench.render`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbench.render.frames import (
    Section,
    check_metric,
    column,
    groups,
    is_missing,
    long_frame,
    norm,
    rows_for,
    select,
    values,
)
from kvbench.render.text import fmt, table_section


def render_curve(
    exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any, bench_rows: Any, out_dir: Path, stem: str
) -> list[Section]:
    """``curve``: see the module doc."""
    import pandas as pd

    source = spec.get("source", "runs")
    keys = [spec["x"], *(spec.get("series") or []), *(spec.get("split") or []), *(spec.get("where") or {})]
    frame = {
        "runs": lambda: rows_for(long_frame(runs), keys) if not runs.empty else pd.DataFrame(),
        "samples": lambda: samples,
        "bench": lambda: bench_rows,
    }[source]()
    frame = select(frame, spec.get("where")) if frame is not None and not frame.empty else pd.DataFrame()
    x = spec["x"]
    ys = spec["y"] if isinstance(spec["y"], list) else [spec["y"]]
    per = spec.get("per")
    for y in [*ys, *([per] if per else [])] if not frame.empty else []:
        check_metric(frame, y, "curve")
    if spec.get("explode") and not frame.empty:
        frame = _explode(frame, spec["y"], spec["x"])
    series = list(spec.get("series") or [])
    split = list(spec.get("split", ["model"] if source != "bench" else []))
    title = spec.get("title") or f"{', '.join(ys)} vs {x}"
    if frame.empty or column(frame, x) is None:
        return [Section(title, markdown="(no data yet)")]
    data = _curve_points(frame, spec, x, ys, per, series, split)
    if data.empty:
        return [Section(title, markdown="(no data yet)")]
    keys = ["split", "series", "x"] + (["label"] if "label" in data.columns else [])
    data = data.groupby(keys, sort=False, as_index=False)["y"].mean()
    path = out_dir / f"{stem}.png"
    from kvbench.plots import curves_figure

    curves_figure(
        data,
        path,
        title=title,
        xlabel=spec.get("xlabel") or x,
        ylabel=spec.get("ylabel") or ", ".join(ys),
        logx=bool(spec.get("logx")),
        logy=bool(spec.get("logy")),
    )
    grid = _curve_grid(data)
    return [table_section(title, grid, data.to_csv(index=False), figures=[path])]


def _curve_points(
    frame: Any, spec: Mapping[str, Any], x: str, ys: list[str], per: str | None, series: list[str], split: list[str]
) -> Any:
    """The curve's points ``(split, series, x, y[, label])``, one per row of ``frame`` and ``y``; rows
    without a numeric x or y are dropped."""
    import pandas as pd

    points = []
    for label, group in groups(frame, split):
        xs = pd.to_numeric(group[column(group, x)], errors="coerce")
        names = values(group, series[0]) if series else pd.Series([""] * len(group), index=group.index)
        for extra in series[1:]:
            names = names + " · " + values(group, extra)
        for y in ys:
            y_col = column(group, y)
            if y_col is None:
                continue
            line = names + (f" · {y}" if len(ys) > 1 or not series else "")
            line = line.str.strip(" ·")
            ys_of = pd.to_numeric(group[y_col], errors="coerce")
            if per:  # (a zero divisor gives NaN: the point is dropped, never infinite)
                ys_of = ys_of / pd.to_numeric(group[column(group, per)], errors="coerce").replace(0, float("nan"))
            part = pd.DataFrame({"split": label, "series": line, "x": xs, "y": ys_of})
            if spec.get("label"):
                part["label"] = values(group, spec["label"]).values
            points.append(part)
    return pd.concat(points).dropna(subset=["x", "y"]) if points else pd.DataFrame()


def _curve_grid(data: Any) -> Any:
    """The curve as a table: one row per series and a column per x, or, for a scatter (x not shared
    between series), one row per point."""
    table = data.assign(y=data["y"].map(lambda v: fmt(v, 3, measured=True)))
    index = ["split", "series"] if data["split"].nunique() > 1 else ["series"]
    grid = table.pivot_table(
        index=index + (["label"] if "label" in data.columns else []),
        columns="x",
        values="y",
        aggfunc="first",
        sort=False,
    )
    if grid.isna().to_numpy().mean() > 0.5:  # a scatter (x not shared between series): the points, one per row
        grid = table.assign(x=table["x"].map(lambda v: fmt(v, 3)))[
            [*index, *(["label"] if "label" in table else []), "x", "y"]
        ]
    else:
        grid = grid.sort_index(axis=1).reset_index()  # x ascending, whatever order the runs came in
        grid.columns = [f"{c:g}" if isinstance(c, float) else str(c) for c in grid.columns]  # 0, 0.05, 0.1
        grid = grid.fillna("–")
    return grid


def _explode(frame: Any, y: str, x: str) -> Any:
    """Rows whose ``y`` holds a list (a per-layer curve) as one row per element, its index in ``x``."""
    name = column(frame, y)
    if name is None:
        return frame
    rows = []
    for _, row in frame.iterrows():
        items = row[name] if isinstance(row[name], list) else [row[name]]
        for index, item in enumerate(items):
            rows.append({**row.to_dict(), name: item, x: index})
    import pandas as pd

    return pd.DataFrame(rows)


def render_figure(exp: Any, spec: Mapping[str, Any], runs: Any, out_dir: Path, stem: str) -> list[Section]:
    """``figure``: the task's comparison figure of the runs, per split group."""
    from kvbench.report import FigureRun
    from kvbench.results import RunDir, run_records
    from kvbench.tasks import REGISTRY

    frame = select(runs, spec.get("where")) if not runs.empty else runs
    kind = spec.get("kind")
    titles = list(spec.get("title") or ["method", "budget"])
    split = list(spec.get("split", ["model"]))
    if frame.empty:
        return [Section("figure", markdown="(no finished runs yet)")]
    sections = []
    for index, (label, group) in enumerate(groups(frame, split)):
        task = REGISTRY.get(str(values(group, "task").iloc[0]))
        task.check_figure_kind(kind, option="the figure's kind")
        panels: list[tuple[str, list[dict[str, Any]]]] = []  # FigureRuns: (title, records) with their config
        for _, row in group.iterrows():
            name = " · ".join(norm(row.get(column(group, t)) if column(group, t) else "–") for t in titles)
            score = row.get("score")
            title = f"{name}\n({fmt(score, 1, measured=True)})" if not is_missing(score) else name
            shards = row.get("shard_dirs")
            first = Path(shards[0] if isinstance(shards, list) and shards else row["run_dir"])
            panels.append(FigureRun(title, run_records(row), RunDir(first).config()))
        path = out_dir / f"{stem}-{index}.png"
        task.draw_figure(panels, path, kind)
        sections.append(Section(f"{task.name} runs{' — ' + label if label else ''}", figures=[path]))
    return sections
