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
    "score_ci95": "95% CI",
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
