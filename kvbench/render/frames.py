"""Our runs as the renderers read them: columns by name or alias, normalised keys, selections, split
groups, one row per run or per subset (:func:`long_frame`), and :class:`Section`, what every renderer
returns."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError
from kvbench.papers import AVERAGE  # long_frame: the dataset name of a run's own row when it has per-set scores

ALIASES = {
    "model": "config.model.name",
    "method": "config.method.name",
    "task": "config.task.name",
    "token_ratio": "config.budget.token_ratio",
    "comm_ratio": "config.budget.comm_ratio",
    "budget_tokens": "config.budget.tokens",
    "compensate": "config.budget.compensate",
    "question": "config.task.question_position",
    "question_position": "config.task.question_position",
    "budget": "budget.label",
    "lengths": "config.task.lengths",
}


@dataclass
class Section:
    """One rendered piece of an artifact: markdown for the terminal, LaTeX / CSV files, figures, and a
    frame of display strings for the HTML page."""

    title: str
    markdown: str = ""
    latex: str | None = None
    csv: str | None = None
    frame: Any = None
    figures: list[Path] = field(default_factory=list)
    note: str | None = None


# ---------------------------------------------------------------------- values and columns
def is_missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return isinstance(value, float) and math.isnan(value)
    except TypeError:
        return False


def norm(value: Any) -> str:
    """A key as text, the same for ``256``, ``256.0`` and ``"256"``; ``–`` for missing."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(norm(v) for v in value) + "]"
    if is_missing(value):
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{float(value):.10g}"
    text = str(value)
    try:
        return f"{float(text):.10g}"
    except ValueError:
        return text


def column(frame: Any, key: str) -> str | None:
    """The frame column ``key`` names (an alias, a flattened key, or a bare method/task/budget key)."""
    for candidate in (key, ALIASES.get(key), f"config.method.{key}", f"config.task.{key}", f"config.budget.{key}"):
        if candidate and candidate in frame.columns:
            return candidate
    return None


def values(frame: Any, key: str) -> Any:
    """The column ``key`` of ``frame`` as normalised text (``–`` where absent)."""
    import pandas as pd

    name = column(frame, key)
    if name is None:
        return pd.Series(["–"] * len(frame), index=frame.index)
    return frame[name].map(norm)


def select(frame: Any, selector: Mapping[str, Any] | None) -> Any:
    """Rows whose columns equal the selector's values (a list means any of them)."""
    if not selector or frame.empty:
        return frame
    keep = None
    for key, wanted in selector.items():
        options = {norm(w) for w in (wanted if isinstance(wanted, list) else [wanted])}
        match = values(frame, key).isin(options)
        keep = match if keep is None else keep & match
    return frame[keep]


def groups(frame: Any, split: Sequence[str]) -> list[tuple[str, Any]]:
    """``(label, rows)`` per split group of ``frame`` (one group, labelled '', without a split)."""
    if frame.empty or not split:
        return [("", frame)]
    keys = [values(frame, s) for s in split]
    label = keys[0].copy()
    for extra in keys[1:]:
        label = label + " · " + extra
    return [(name, frame[label == name]) for name in dict.fromkeys(label)]


def against_baseline(
    frame: Any, split: Sequence[str], baseline: Mapping[str, Any], match: Sequence[str]
) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(split label, run id, the run's rows, the baseline's rows)`` for every run of each ``split`` group
    of ``frame`` (samples) that is not a baseline run, against the one run of the group that ``baseline``
    selects and that shares the run's ``match`` keys; a run without exactly one such baseline is skipped."""
    for label, group in groups(frame, split):
        base_rows = select(group, baseline)
        for run_id, run in group.groupby("run_id", sort=False):
            if run_id in set(base_rows["run_id"]):
                continue
            base = base_rows
            for key in match:
                base = base[values(base, key) == values(run, key).iloc[0]]
            if base["run_id"].nunique() != 1:
                continue
            yield label, run_id, run, base


# ---------------------------------------------------------------------- our results
def long_frame(runs: Any) -> Any:
    """Our runs, one row per run, plus one row per subset where a run reports subsets (``dataset`` = the
    subset, score only); the run's own row then gets ``dataset=average`` (the papers' Average: the
    unweighted mean over the run's subsets)."""
    import pandas as pd

    rows = []
    for _, run in runs.iterrows():
        base = run.to_dict()
        subsets = {
            c.removeprefix("per_subset."): base[c]
            for c in runs.columns
            if c.startswith("per_subset.") and not is_missing(base.get(c))
        }
        for name, score in subsets.items():
            rows.append(
                {
                    **{
                        k: v
                        for k, v in base.items()
                        if k.startswith("config.") or k in ("run_id", "run_dir", "budget.label", "n", "state", "status")
                    },
                    "dataset": name,
                    "score": score,
                    RUN_LEVEL: False,
                }
            )
        rows.append({**base, "dataset": AVERAGE if subsets else None, RUN_LEVEL: True})
    return pd.DataFrame(rows)


RUN_LEVEL = "_run_level"  # long_frame: the run's own row (not a subset's)


def rows_for(frame: Any, keys: Sequence[str]) -> Any:
    """The rows a view of ``keys`` reads: per subset only when it names ``dataset``, else one per run."""
    if RUN_LEVEL not in frame.columns or "dataset" in keys:
        return frame
    return frame[frame[RUN_LEVEL].astype(bool)]


def check_metric(frame: Any, metric: str, kind: str = "claims") -> None:
    """A claim's metric (a curve's y) must name a column of the rows it reads, else every "ours" would
    print as missing (a curve as "no data yet"), which reads like runs that measured nothing: the error
    lists the columns ending alike."""
    import difflib

    if column(frame, metric) is not None:
        return
    leaf = metric.rsplit(".", 1)[-1]
    close = [c for c in frame.columns if str(c).endswith(leaf)] or difflib.get_close_matches(
        metric, [str(c) for c in frame.columns], n=3
    )
    raise ConfigError(
        f"{kind}: metric {metric!r} is not a column of the rows it reads",
        f"use one of {', '.join(map(str, close))}" if close else f"fix the {kind} item's metric",
    )
