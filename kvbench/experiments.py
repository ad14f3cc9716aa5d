"""Paper artifacts as experiment configs: ``conf/experiment/<paper>_<artifact>.yaml``.

One file per table or figure of a paper. It is a plain Hydra config (``# @package _global_``), so
``kvbench run -m +experiment=pqcache_table3`` runs its sweep like any other, and it carries a
``reproduce:`` block that only ``kvbench reproduce`` reads (Hydra composes it and kvbench drops it
before a run is hashed, so a run made through the experiment and the same run typed by hand share a
run directory). Why this shape:

* the **sweep** is ``hydra.sweeper.params`` — Hydra's own place for it, so the basic sweeper, the
  joblib launcher and the submitit launcher all see it; command-line values replace an axis of the
  same key (``method=pqcache`` narrows a method sweep), exactly as Hydra's basic sweeper merges them;
* the file's body (group choices in ``defaults``, ``task``/``budget`` values, data folders) is the
  ``cpu`` scale: what ``benchmarks/RESULTS.md`` reports on SmolLM2 / Qwen2.5-Coder-0.5B;
* ``reproduce.scales.<scale>.overrides`` are Hydra overrides applied after the body for the other
  scales (``smoke``: tiny random models, a handful of samples; ``paper``: the paper's model and data,
  validated here and run on a GPU machine); ``conf/scale/<scale>.yaml`` holds the overrides and
  protocol notes every experiment shares at that scale (those files are read by kvbench, they are
  not a Hydra config group);
* ``reproduce.also`` lists further sweeps (override lists) where one cartesian product cannot say it
  (ClusterKV's metric × clusters next to its method × budget); only ``kvbench reproduce`` runs those;
* ``reproduce.bench`` names a ``kvbench bench`` benchmark instead of a run sweep (latency figures);
  its options per scale are ``reproduce.scales.<scale>.bench``;
* ``reproduce.cannot`` says why an artifact of the papers cannot run in kvbench at any scale (a system
  kvbench does not have, a model it cannot hold): the file has no sweep, every scale is skipped with
  that reason, ``kvbench reproduce --list`` prints it beside the description, and ``kvbench
  reproduce`` renders the paper's numbers alone;
* ``reproduce.render`` says how to draw the artifact (tables beside the paper's numbers, claims,
  curves, heatmaps, paired statistics; :mod:`kvbench.render` documents each kind), ``compare``
  which published artifact of ``results/papers`` it is compared with, ``join`` / ``stand_ins`` how
  the paper's row keys map to ours, and ``why`` the reasons for each protocol difference.

Names: ``pqcache_table3`` is ``pqcache/table3`` (the paper is the part before the first ``_``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

SCALES = ("smoke", "cpu", "paper")
DEFAULT_SCALE = "cpu"
#: keys of the ``reproduce:`` block
_KEYS = (
    "compare",
    "description",
    "scales",
    "also",
    "bench",
    "render",
    "join",
    "stand_ins",
    "why",
    "notes",
    "paper_factor",
    "cannot",
)
_SCALE_KEYS = ("overrides", "bench", "why", "skip", "also")
FIX = "edit the experiment file (the schema is in kvbench/experiments.py)"


@dataclass(frozen=True)
class ScaleSpec:
    """What one scale changes: Hydra overrides (run sweeps) or benchmark options, and why."""

    overrides: tuple[str, ...] = ()
    bench: Mapping[str, Any] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)
    skip: str | None = None  # a reason this artifact cannot run at this scale
    also: tuple[tuple[str, ...], ...] | None = None  # replaces the experiment's ``also`` sweeps ([]: none)


@dataclass(frozen=True)
class Scale:
    """``conf/scale/<name>.yaml``: the overrides and protocol notes shared by every experiment."""

    name: str
    description: str
    overrides: tuple[str, ...]
    why: Mapping[str, str]


@dataclass(frozen=True)
class Experiment:
    name: str  # the file stem, pqcache_table3
    paper: str
    artifact: str
    compare: str  # <paper>/<artifact> of the published numbers
    description: str
    path: Path
    sweep: Mapping[str, str]  # hydra.sweeper.params
    scales: Mapping[str, ScaleSpec]
    also: tuple[tuple[str, ...], ...] = ()
    bench: str | None = None
    render: tuple[Mapping[str, Any], ...] = ()
    join: Mapping[str, str] = field(default_factory=dict)
    stand_ins: Mapping[str, Mapping[Any, Any]] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)
    notes: str | None = None
    paper_factor: float = 1.0  # multiplies the paper's "score (0-1)" numbers (100: kvbench's 0-100 scale)
    cannot: str | None = None  # why the artifact cannot run in kvbench at any scale (no sweep, every scale skipped)

    @property
    def ref(self) -> str:
        return f"{self.paper}/{self.artifact}"

    def scale(self, name: str) -> ScaleSpec:
        return self.scales.get(name, ScaleSpec())


# ---------------------------------------------------------------------- files
def conf_dir() -> Path:
    import kvbench.conf

    return Path(kvbench.conf.__file__).parent


def experiment_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def name_of(ref: str) -> str:
    """``pqcache/table3`` or ``pqcache_table3`` → ``pqcache_table3`` (checked to exist)."""
    name = ref.replace("/", "_", 1) if "/" in ref else ref
    if name not in experiment_names():
        import difflib

        refs = [n.replace("_", "/", 1) for n in experiment_names()]
        close = difflib.get_close_matches(ref.replace("_", "/", 1), refs, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(f"no experiment {ref!r}", f"{hint}`kvbench reproduce --list` shows them")
    return name


@functools.cache
def load_experiment(ref: str) -> Experiment:
    """The experiment ``pqcache/table3`` (or ``pqcache_table3``), validated."""
    import yaml

    name = name_of(ref)
    path = conf_dir() / "experiment" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return _experiment(name, path, data)


def _experiment(name: str, path: Path, data: Any) -> Experiment:
    def bad(message: str) -> ConfigError:
        return ConfigError(f"{path.name}: {message}", FIX)

    if not isinstance(data, dict) or not isinstance(data.get("reproduce"), dict):
        raise bad("no reproduce: block")
    spec = data["reproduce"]
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise bad(f"unknown reproduce keys {unknown}")
    paper, _, artifact = name.partition("_")
    if not artifact:
        raise bad("the file name must be <paper>_<artifact>.yaml")
    if not isinstance(spec.get("description"), str) or not spec["description"].strip():
        raise bad("reproduce.description must be a one-line text")
    sweep = ((data.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    if not isinstance(sweep, dict):
        raise bad("hydra.sweeper.params must map keys to comma-separated values")
    scales: dict[str, ScaleSpec] = {}
    for scale, entry in (spec.get("scales") or {}).items():
        if scale not in SCALES:
            raise bad(f"unknown scale {scale!r} (scales: {', '.join(SCALES)})")
        entry = entry or {}
        if not isinstance(entry, dict) or set(entry) - set(_SCALE_KEYS):
            raise bad(f"reproduce.scales.{scale} takes {', '.join(_SCALE_KEYS)}")
        scales[scale] = ScaleSpec(
            overrides=tuple(str(o) for o in entry.get("overrides") or ()),
            bench=dict(entry.get("bench") or {}),
            why=dict(entry.get("why") or {}),
            skip=entry.get("skip"),
            also=None
            if entry.get("also") is None
            else tuple(tuple(str(o) for o in sweep_) for sweep_ in entry["also"]),
        )
    also = tuple(tuple(str(o) for o in sweep_) for sweep_ in spec.get("also") or ())
    cannot = spec.get("cannot")
    if cannot is not None:
        if not isinstance(cannot, str) or not cannot.strip():
            raise bad("reproduce.cannot must say why the artifact cannot run")
        if sweep or also or spec.get("bench"):
            raise bad("an artifact that cannot run has no sweep, also or bench")
        cannot = " ".join(cannot.split())
        scales = {name: replace(scales.get(name, ScaleSpec()), skip=cannot) for name in SCALES}
    bench = spec.get("bench")
    if bench is not None:
        from kvbench.bench import discover

        if bench not in discover():
            raise bad(f"unknown benchmark {bench!r}")
        if sweep or also:
            raise bad("a bench experiment has no run sweep (drop hydra.sweeper.params / also)")
    render = tuple(spec.get("render") or ())
    from kvbench.render import check_render

    for index, item in enumerate(render):
        try:
            check_render(item)
        except ConfigError as error:
            raise bad(f"render[{index}]: {error.message}") from None
    description = " ".join(spec["description"].split())
    return Experiment(
        name=name,
        paper=paper,
        artifact=artifact,
        compare=str(spec.get("compare") or f"{paper}/{artifact}"),
        # `kvbench reproduce --list` prints the description: an artifact that cannot run says why there
        description=f"{description} — cannot run in kvbench: {cannot}" if cannot else description,
        path=path,
        sweep={str(k): _sweep_value(v) for k, v in sweep.items()},
        scales=scales,
        also=also,
        bench=bench,
        render=render,
        join=dict(spec.get("join") or {}),
        stand_ins=dict(spec.get("stand_ins") or {}),
        why=dict(spec.get("why") or {}),
        notes=spec.get("notes"),
        paper_factor=float(spec.get("paper_factor", 1.0)),
        cannot=cannot,
    )


def _sweep_value(value: Any) -> str:
    """A sweeper value as Hydra's command-line text (YAML may have parsed ``a,b`` or a list)."""
    if isinstance(value, (list, tuple)):
        return ",".join(_sweep_value(v) for v in value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@functools.cache
def load_scale(name: str) -> Scale:
    import yaml

    if name not in SCALES:
        raise ConfigError(f"unknown scale {name!r}", f"use scale={' | scale='.join(SCALES)}")
    path = conf_dir() / "scale" / f"{name}.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return Scale(
        name=name,
        description=" ".join(str(data.get("description", "")).split()),
        overrides=tuple(str(o) for o in data.get("overrides") or ()),
        why=dict(data.get("why") or {}),
    )


# ---------------------------------------------------------------------- the experiment of a `kvbench run` command
def selected_experiment(overrides: Sequence[str]) -> str | None:
    """The experiment an override list selects (``+experiment=NAME``), if any."""
    names = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+~") == "experiment"]
    if not names:
        return None
    if len(names) > 1 or "," in names[0]:
        raise ConfigError("several experiments in one command", "run one experiment at a time: +experiment=<name>")
    return names[0]


def sweeper_overrides(overrides: Sequence[str]) -> list[str]:
    """The ``hydra.sweeper.params`` of the experiment ``overrides`` select, as ``key=values`` overrides,
    to put before the command line's (what Hydra's basic sweeper does with them)."""
    name = selected_experiment(overrides)
    if name is None or name not in experiment_names():
        return []  # no experiment, or a name the group check reports
    return [f"{k}={v}" for k, v in load_experiment(name).sweep.items()]


# ---------------------------------------------------------------------- the sweeps of a reproduction
def sweeps(exp: Experiment, scale: str, extra: Sequence[str] = ()) -> list[list[str]]:
    """The override lists (each a sweep, ``-m`` style) of ``exp`` at ``scale``: the file's sweep and its
    ``also`` sweeps, each followed by the scale's overrides and then ``extra`` (later values win)."""
    if exp.bench is not None or exp.cannot is not None:
        return []
    shared = [*load_scale(scale).overrides, *exp.scale(scale).overrides, *extra]
    base = [f"{k}={v}" for k, v in exp.sweep.items()]
    also = exp.scale(scale).also
    return [[f"+experiment={exp.name}", *base, *more, *shared] for more in ((), *(exp.also if also is None else also))]


def bench_options(exp: Experiment, scale: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``kvbench bench`` options of a bench experiment at ``scale``."""
    return {**exp.scale(scale).bench, **(extra or {})}


def why(exp: Experiment, scale: str) -> dict[str, str]:
    """Reasons for the protocol differences. An experiment's top-level ``why`` explains its body, the
    cpu scale; at the smoke scale the scale's own reasons (a random model, a few samples) take
    precedence over it, and at the paper scale it does not apply. The experiment's per-scale ``why``
    comes last."""
    scale_why, own = load_scale(scale).why, exp.scale(scale).why
    if scale == "paper":
        return {**scale_why, **own}
    if scale == "smoke":
        return {**exp.why, **scale_why, **own}
    return {**scale_why, **exp.why, **own}
