"""The protocol-difference section of a reproduced artifact: per aspect the paper's protocol, ours, and
why they differ, then the keys that differ between our runs."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvbench.render.frames import Section, is_missing, norm, values
from kvbench.render.text import to_latex, to_markdown

ASPECTS = (
    "model",
    "data",
    "n",
    "truncation",
    "template",
    "question",
    "generation",
    "budget",
    "precision",
    "hardware",
    "metric",
    "notes",
)


def protocol_section(
    exp: Any, scale: str, runs: Any, reasons: Mapping[str, str], bench: Mapping[str, Any] | None
) -> Section:
    """The protocol-difference table: per aspect the paper's protocol, ours, and why they differ; then
    the keys that differ between our runs (the sweep) — ``kvbench report --diff`` over all of them."""
    import pandas as pd

    from kvbench.papers import get_artifact
    from kvbench.report import flat_protocol

    art = get_artifact(exp.compare)
    protocol = dict(art.protocol)
    paper = {
        "model": art.model_label
        or (", ".join(art.model) if isinstance(art.model, tuple) else art.model)
        or "not stated",
        "data": protocol.get("data", "–"),
        "truncation": protocol.get("truncation", "–"),
        "template": protocol.get("template", "–"),
        "question": str(art.fixed.get("question_position", "end (not stated)" if art.task else "–")),
        "generation": protocol.get("generation", "–"),
        "budget": protocol.get("budget", ", ".join(f"{k} {v}" for k, v in art.fixed.items()) or "–"),
        "precision": protocol.get("precision", "–"),
        "hardware": protocol.get("hardware", "–"),
        "metric": protocol.get("metric", art.metric if isinstance(art.metric, str) else "–"),
        "notes": protocol.get("notes", "–"),
        "n": protocol.get("n", "–"),
    }
    for key in ("lengths", "chunks", "criterion"):
        if key in protocol:
            paper["data"] = f"{paper['data']}; {key}: {protocol[key]}"
    flats = [flat_protocol(Path(p)) for p in runs["run_dir"]] if not runs.empty else []
    constant, varying = _split_keys(flats)
    ours = _ours_aspects(runs, constant, varying, bench) if (flats or bench) else {a: "(not run yet)" for a in ASPECTS}
    ours["notes"] = exp.notes or "–"
    rows = [
        {"aspect": a, "paper": str(paper.get(a, "–")), "ours": str(ours.get(a, "–")), "why": reasons.get(a, "")}
        for a in ASPECTS
        if paper.get(a, "–") != "–" or ours.get(a, "–") not in ("–", "") or reasons.get(a)
    ]
    table = pd.DataFrame(rows)
    markdown = to_markdown(table)
    if varying:
        sweep = pd.DataFrame([{"key": k, "values in our runs": ", ".join(v)} for k, v in varying.items()])
        markdown += (
            "\n\nKeys that differ between our runs (`kvbench report --diff` of any two of them):\n\n"
            + to_markdown(sweep)
        )
    return Section(
        f"protocol differences (scale {scale})",
        markdown=markdown,
        latex=to_latex(table),
        csv=table.to_csv(index=False),
        frame=table,
    )


def _split_keys(flats: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Keys every run shares (with the value) and keys that differ (with the values seen). A method
    parameter counts as differing only between runs of the same method: that the methods have
    different parameters is what makes them different methods."""
    keys = sorted({k for f in flats for k in f})
    constant, varying = {}, {}
    for key in keys:
        if key in ("config.output_dir", "config.progress"):
            continue
        seen = list(dict.fromkeys(norm(f.get(key)) for f in flats))
        if key.startswith("config.method.") and key != "config.method.name":
            per_method: dict[str, set[str]] = {}
            for f in flats:
                per_method.setdefault(norm(f.get("config.method.name")), set()).add(norm(f.get(key)))
            if all(len(v) == 1 for v in per_method.values()):
                continue
        if len(seen) == 1:
            constant[key] = seen[0]
        else:
            varying[key] = seen
    return constant, varying


def _ours_aspects(runs: Any, constant: dict[str, Any], varying: dict[str, list[str]], bench: Any) -> dict[str, str]:
    def pick(*words: str, prefix: str = "protocol.") -> str:
        found = [
            f"{k.removeprefix(prefix)}: {v}"
            for k, v in constant.items()
            if k.startswith(prefix) and any(w in k.lower() for w in words) and len(v) <= 160
        ]
        found += [
            f"{k.removeprefix(prefix)}: {' | '.join(v)}"
            for k, v in varying.items()
            if k.startswith(prefix) and any(w in k.lower() for w in words)
        ]
        return "; ".join(found) or "–"

    if bench is not None:
        options = bench.get("options", {})
        return {
            "model": str(options.get("model") or "the benchmark's default"),
            "data": f"kvbench bench {bench.get('name')}: synthetic prompts",
            "generation": str(options.get("new_tokens") or "the benchmark's default"),
            "hardware": f"{bench.get('device')} ({bench.get('cpus')} CPUs, torch {bench.get('torch')})",
        }
    models = " | ".join(dict.fromkeys(values(runs, "model")))
    task_keys = [
        k
        for k in list(constant) + list(varying)
        if k.startswith("config.task.")
        and k.split(".")[-1]
        in ("subsets", "dataset", "file", "lengths", "depths", "data_dir", "limit", "book", "chunk_tokens", "top_k")
    ]
    data = "; ".join(
        f"{k.removeprefix('config.task.')}: {constant.get(k) or ' | '.join(varying[k])}" for k in task_keys
    )
    ns = [int(n) for n in runs.get("n", []) if not is_missing(n)]
    n = (
        f"{min(ns)}–{max(ns)} samples per run, {len(ns)} runs"
        if ns and min(ns) != max(ns)
        else f"{ns[0]} samples per run, {len(ns)} runs"
        if ns
        else "–"
    )
    budgets = " | ".join(dict.fromkeys(values(runs, "budget")))
    envs = _environments(runs)
    return {
        "model": models,
        "data": f"{', '.join(dict.fromkeys(values(runs, 'task')))} — {data}",
        "n": n,
        "truncation": pick("max_length", "truncat", "overflow"),
        "template": pick("template", "chat", "prompt"),
        "question": ", ".join(dict.fromkeys(values(runs, "question"))),
        "generation": pick("max_new_tokens", "stop", "generation"),
        "budget": budgets,
        "precision": envs[0],
        "hardware": envs[1],
        "metric": pick("scorer", "metric", "extraction"),
    }


def _environments(runs: Any) -> tuple[str, str]:
    import json

    dtypes, devices = set(), set()
    for path in runs.get("run_dir", []):
        env = Path(path) / "env.json"
        if env.exists():
            data = json.loads(env.read_text())
            dtypes.add(str((data.get("model") or {}).get("dtype", "?")))
            threads = data.get("torch_threads")
            devices.add(
                f"{data.get('device_name')} ({data.get('device')}, {threads} thread{'' if threads == 1 else 's'})"
            )
    return ", ".join(sorted(dtypes)) or "–", ", ".join(sorted(devices)) or "–"
