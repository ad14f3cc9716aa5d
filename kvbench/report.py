"""Tables of finished runs (markdown, CSV, LaTeX)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

COLUMNS = {
    "config.model.name": "model",
    "config.method.name": "method",
    "config.task.name": "task",
    "budget.label": "budget",
    "protocol.question_position": "question",
    "n": "n",
    "score": "score",
    "recall": "recall",
    "hit_rate": "hit rate",
    "kv_bytes_ratio": "KV kept",
    "attended_tokens": "attended",
    "ttft_s": "TTFT s",
    "tt2t_s": "TT2T s",
    "tpot_s": "TPOT s",
}


def runs_frame(paths: Iterable[str | Path]):
    from kvbench.results import load

    frame = load(list(paths))
    if frame.empty:
        return frame
    present = [c for c in COLUMNS if c in frame.columns]
    return frame[present].rename(columns=COLUMNS)


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


def to_markdown(frame) -> str:
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and value != value):
            return "–"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    header = "| " + " | ".join(str(c) for c in frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *rows])
