"""``kvbench reproduce <paper>/<artifact> [scale=smoke|cpu|paper] [overrides]``: run what is missing of
one paper artifact's sweep, then render it beside the published numbers.

The experiment (:mod:`kvbench.experiments`) gives the sweeps at the chosen scale. Every point is
composed and validated before anything runs, by the sweep service ``kvbench run -m`` uses
(:mod:`kvbench.sweep`: same override merging, same checks), then each point whose run directory is not
finished goes through :func:`kvbench.runner.run` — resumable sample by sample, one writer per run
directory. Passing a Hydra launcher (``hydra/launcher=joblib``, ``hydra/launcher=slurm``) hands each
sweep to the sweep service as ``kvbench run -m`` would (:func:`kvbench.sweep.run_sweep`) instead, so
the jobs run in parallel or on a cluster; the rendering then reads the same run directories.
A benchmark experiment runs ``kvbench bench`` once per scale and option set and keeps
its JSON record under ``<output_dir>/bench/``.

Rendering reads finished runs only (:mod:`kvbench.render`): the tables beside the paper's numbers,
claims, curves, figures, paired statistics, agreement with a baseline's answers and the
protocol-difference table, printed as markdown and written to
``results/reproduce/<scale>/<experiment>/`` as ``report.md``, ``report.tex``, one CSV per section and
the figures. ``kvbench report --html`` turns the same sections into web pages.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError
from kvbench.experiments import Experiment, bench_options, load_experiment, load_scale, sweeps, why
from kvbench.render import (
    Section,
    protocol_section,
    render_agreement,
    render_bench,
    render_chunk_scores,
    render_claims,
    render_curve,
    render_figure,
    render_paired,
    render_table,
    render_tune,
)

DEFAULT_OUT = Path("results/reproduce")


@dataclass
class Point:
    config: dict[str, Any]
    run_dir: Path
    label: str  # the swept values
    setting: str = ""  # the swept values besides the method (the "our runs" table's setting column)


@dataclass
class Report:
    exp: Experiment
    scale: str
    sections: list[Section]
    points: list[Point] = field(default_factory=list)
    finished: int = 0
    out_dir: Path | None = None

    @property
    def title(self) -> str:
        return f"{self.exp.ref} — {self.exp.description}"

    def markdown(self) -> str:
        parts = []
        for section in self.sections:
            parts.append(f"## {section.title}\n" if section.title else "")
            if section.markdown:
                parts.append(section.markdown + "\n")
            for figure in section.figures:
                parts.append(f"![{section.title}]({figure.name})\n")
            if section.note:
                parts.append(f"{section.note}\n")
        return f"# {self.title} (scale {self.scale})\n\n" + "\n".join(parts)


# ---------------------------------------------------------------------- points
def points(exp: Experiment, scale: str, extra: Sequence[str] = ()) -> list[Point]:
    """Every run of ``exp`` at ``scale``, composed and validated, one per run directory."""
    from kvbench.compose import compose_many
    from kvbench.runner import plan
    from kvbench.sweep import expand
    from kvbench.validate import validate_points

    lists = [point for sweep in sweeps(exp, scale, extra) for point in expand(sweep)]
    if not lists:
        return []
    configs = compose_many(lists)
    settings = [dict(o.partition("=")[::2] for o in point) for point in lists]
    varying = {k for k in set().union(*settings) if len({s.get(k) for s in settings}) > 1}
    labels = [" ".join(f"{k}={v}" for k, v in s.items() if k in varying) for s in settings]
    apart = [" ".join(f"{k}={v}" for k, v in s.items() if k in varying and k != "method") for s in settings]
    validate_points(configs, labels)
    out: dict[Path, Point] = {}
    for config, label, setting in zip(configs, labels, apart):
        p = plan(config)
        out.setdefault(p.run_dir.path, Point(config=config, run_dir=p.run_dir.path, label=label, setting=setting))
    return list(out.values())


def state_of(path: Path) -> str:
    from kvbench.results import RunDir

    return RunDir(path).state().label if (path / "config.yaml").exists() else "missing"


# ---------------------------------------------------------------------- running
def uses_launcher(extra: Sequence[str]) -> bool:
    return any(o.startswith(("hydra/launcher=", "hydra.launcher.")) for o in extra)


def run_points(exp: Experiment, scale: str, extra: Sequence[str], todo: list[Point], *, wait: bool = False) -> None:
    """Run the unfinished points: in this process through the runner, or (a Hydra launcher among the
    overrides) each sweep through the sweep service and its launcher, as ``kvbench run -m`` runs it."""
    from kvbench.runner import check_sources, format_summary, run

    check_sources([point.config for point in todo])
    if uses_launcher(extra):
        from kvbench.sweep import run_sweep

        for overrides in sweeps(exp, scale, extra):
            command = "kvbench run " + shlex.join(["-m", *(["--wait"] if wait else []), *overrides])
            code = run_sweep(overrides, multirun=True, wait=wait, command=command)
            if code:
                raise SystemExit(code)
        return
    from kvbench.shared import Sweep

    with Sweep.of([point.config for point in todo]) as sweep:  # the points share dense prefills (prefill_cache: null)
        for index, point in enumerate(todo, 1):
            command = f"kvbench reproduce {exp.ref} scale={scale} {shlex.join(extra)}".strip()
            print(f"[{index}/{len(todo)}] {point.label or point.run_dir.name}", flush=True)
            summary = run(point.config, wait=wait, command=command, sweep=sweep)
            print(format_summary(summary), flush=True)


def run_bench(
    exp: Experiment, scale: str, options: dict[str, Any], output_dir: Path, *, run: bool
) -> dict[str, Any] | None:
    """The benchmark record of ``exp`` at ``scale`` with ``options`` (run once, then read from disk)."""
    from kvbench.bench import BenchOptions, discover

    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:10]
    path = output_dir / "bench" / f"{exp.name}-{scale}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    if not run:
        return None
    import os

    import torch

    from kvbench.results import write_atomic
    from kvbench.runner import device_name

    known = set(BenchOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{exp.name}: unknown bench options {unknown}", f"bench options: {', '.join(sorted(known))}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    assert exp.bench is not None  # (called for bench experiments only)
    print(f"kvbench bench {exp.bench} {json.dumps(options)}", flush=True)
    result = discover()[exp.bench](BenchOptions(**values))
    device = str(values.get("device", "auto"))
    record = {
        "name": exp.bench,
        "options": options,
        "device": device_name("cuda" if torch.cuda.is_available() and device != "cpu" else "cpu"),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "title": result.title,
        "rows": result.rows,
        "notes": result.notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=2, default=str) + "\n")
    return record


# ---------------------------------------------------------------------- reading our runs
def our_runs(run_dirs: Sequence[Path], *, samples: bool = False) -> Any:
    """The runs at ``run_dirs`` (and the shards that make up any of them), finished ones only, in the
    order of ``run_dirs``."""
    import pandas as pd

    from kvbench.results import load

    wanted = {p.name for p in run_dirs}
    candidates: set[Path] = set()
    for path in run_dirs:
        if (path / "config.yaml").exists():
            candidates.add(path)
        prefix = path.name.rsplit("-", 1)[0]
        candidates.update(p.parent for p in path.parent.glob(f"{prefix}-*/config.yaml") if p.parent != path)
    if not candidates:
        return pd.DataFrame()
    frame = load(sorted(candidates), samples=samples)
    if frame.empty:
        return frame
    frame = frame[frame["run_id"].isin(wanted) & (frame["state"] == "finished")]
    # in the experiment's sweep order (not the folders' hash order): tables and legends follow it
    position = {p.name: i for i, p in enumerate(run_dirs)}
    return frame.sort_values("run_id", key=lambda ids: ids.map(position), kind="stable").reset_index(drop=True)


# ---------------------------------------------------------------------- the report
def reproduce(
    ref: str,
    scale: str = "cpu",
    extra: Sequence[str] = (),
    *,
    run: bool = True,
    dry_run: bool = False,
    out: Path | None = None,
    wait: bool = False,
    write: bool = True,
) -> Report:
    """Run what is missing of ``ref`` at ``scale`` (``run``), then render it (see the module doc)."""
    exp = load_experiment(ref)
    load_scale(scale)
    spec = exp.scale(scale)
    out_dir = Path(out) if out else DEFAULT_OUT / scale / exp.name
    bench = None
    pts: list[Point] = []
    if spec.skip:
        print(f"kvbench: note: {exp.ref} does not run at scale {scale}: {spec.skip}", file=sys.stderr)
        run = False
    if exp.bench is not None:
        options = bench_options(exp, scale)
        output_dir = Path(_override_value(extra, "output_dir") or "results/runs")
        if dry_run:
            print(f"# kvbench bench {exp.bench} with {json.dumps(options)}")
            return Report(exp, scale, [])
        bench = run_bench(exp, scale, options, output_dir, run=run)
    else:
        pts = points(exp, scale, extra)
        if dry_run:
            for point in pts:
                print(f"{state_of(point.run_dir):>16}  {point.run_dir}  {point.label}")
            return Report(exp, scale, [], points=pts)
        todo = [p for p in pts if state_of(p.run_dir) != "finished"]
        if run and todo:
            run_points(exp, scale, extra, todo, wait=wait)
    sections = render(
        exp, scale, [p.run_dir for p in pts], bench, out_dir, settings={p.run_dir.name: p.setting for p in pts}
    )
    report = Report(exp, scale, sections, points=pts, out_dir=out_dir)
    report.finished = sum(state_of(p.run_dir) == "finished" for p in pts)
    if write:
        write_report(report)
    return report


def _override_value(extra: Sequence[str], key: str) -> str | None:
    for item in extra:
        name, _, value = item.partition("=")
        if name.lstrip("+") == key:
            return value
    return None


def render(
    exp: Experiment,
    scale: str,
    run_dirs: Sequence[Path],
    bench: dict[str, Any] | None,
    out_dir: Path,
    settings: Mapping[str, str] | None = None,
) -> list[Section]:
    """Every section of the artifact, from the finished runs at ``run_dirs`` (or the bench record);
    ``settings`` (run id → its swept values besides the method) fill the "our runs" table's setting column."""
    import pandas as pd

    from kvbench.papers import get_artifact

    out_dir.mkdir(parents=True, exist_ok=True)
    art = get_artifact(exp.compare)
    runs = our_runs(run_dirs)
    needs_samples = any(
        kind in ("paired", "agreement", "tune") or (spec or {}).get("source") == "samples"
        for item in exp.render
        for kind, spec in item.items()
    )
    samples = our_runs(run_dirs, samples=True) if needs_samples and not runs.empty else None
    bench_rows = pd.DataFrame(bench["rows"]) if bench else None
    header = [f"Paper: {art.caption} ({art.where}); compared with `results/papers/{art.paper}.yaml` `{art.id}`."]
    if not art.numbers:
        header.append(f"The paper gives no numbers for this {art.kind}: ours alone. The paper says: {art.note}")
    if exp.bench:
        state = "measured" if bench else "not measured yet"
        header.append(f"`kvbench bench {exp.bench}`, {state} ({json.dumps(bench_options(exp, scale))}).")
    else:
        missing = len(run_dirs) - len(runs)
        header.append(
            f"Runs: {len(runs)} of {len(run_dirs)} finished"
            + (f"; {missing} not finished: `kvbench reproduce {exp.ref} scale={scale}` runs them" if missing else "")
            + "."
        )
    sections = [Section("", markdown="\n\n".join(header))]
    for index, item in enumerate(exp.render):
        ((kind, spec),) = item.items()
        spec = spec or {}
        stem = f"{exp.name}-{index}"
        if kind == "table":
            sections += render_table(exp, spec, runs)
        elif kind == "claims":
            sections += render_claims(exp, spec, runs, bench_rows, samples)
        elif kind == "curve":
            sections += render_curve(exp, spec, runs, samples, bench_rows, out_dir, stem)
        elif kind == "figure":
            sections += render_figure(exp, spec, runs, out_dir, stem)
        elif kind == "paired":
            sections += render_paired(exp, spec, runs, samples)
        elif kind == "agreement":
            sections += render_agreement(exp, spec, runs, samples)
        elif kind == "tune":
            sections += render_tune(exp, spec, runs, samples)
        elif kind == "chunk_scores":
            sections += render_chunk_scores(exp, spec, runs, out_dir, stem)
        elif kind == "bench":
            sections += render_bench(spec, bench_rows, bench["notes"] if bench else [])
    sections.append(protocol_section(exp, scale, runs, why(exp, scale), bench))
    if not runs.empty:
        from kvbench.report import runs_table

        paths = {
            Path(p)
            for _, row in runs.iterrows()
            for p in (row["shard_dirs"] if isinstance(row.get("shard_dirs"), list) else [row["run_dir"]])
        }
        shown = settings if settings and any(settings.values()) else None  # no column when only the method varies
        sections.append(Section("our runs", markdown=runs_table(sorted(paths), settings=shown)))
    return sections


def write_report(report: Report) -> None:
    """``report.md``, ``report.tex`` and one CSV per section under the report's folder."""
    out = report.out_dir
    assert out is not None
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(report.markdown(), encoding="utf-8")
    tex = [f"% {report.title} (scale {report.scale})"]
    for index, section in enumerate(report.sections):
        if section.latex:
            tex += [f"% {section.title}", section.latex, ""]
        if section.csv:
            (out / f"section-{index}.csv").write_text(section.csv, encoding="utf-8")
    (out / "report.tex").write_text("\n".join(tex) + "\n", encoding="utf-8")


def listing() -> str:
    """``kvbench reproduce --list``: every experiment with its one-line description."""
    from kvbench.experiments import experiment_names

    rows = []
    for name in experiment_names():
        exp = load_experiment(name)
        kind = "cannot run" if exp.cannot else f"bench {exp.bench}" if exp.bench else "runs"
        rows.append(f"{exp.ref:<28} {exp.description}  [{kind}]")
    return "\n".join(rows)
