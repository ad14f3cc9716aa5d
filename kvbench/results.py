"""Run directories on disk, and loading many of them into one DataFrame.

A run directory ``<output_dir>/<run-id>/`` holds:

* ``config.yaml`` — the fully resolved config (the run id is a hash of it); it is the run's truth: a
  resumed run whose config differs from it is refused before any work;
* ``samples.jsonl`` — one JSON object per finished sample, appended, flushed and fsynced one by one,
  so a killed run loses no finished sample and a re-run resumes after the last one;
* ``metrics.json`` — aggregates derived from ``samples.jsonl`` (rewritten atomically);
* ``status.json`` — ``state`` (running, interrupted, stopped, failed, finished; a stopped run's
  ``reason``: SIGTERM, disk full, permission denied), ``total`` (the number of samples the run will
  have, when the task knows it up front) and the command that resumes, so reports can show unfinished
  runs;
* ``run.log`` — what the run did, one timestamped plain line per event (start, model load, each
  sample with its score and the running mean, the end or the interruption);
* ``env.json`` — versions, git sha, device; plus task artifacts such as ``heatmap.png``.

Two rules keep these files trustworthy:

* **Reading never writes.** Readers (:meth:`RunDir.records`, :func:`load`, ``kvbench report``, the
  notebooks) skip what they cannot parse and say so; they never modify a file. Only the writer repairs,
  and only a torn *last* line (:meth:`RunDir.repair_tail`, a run killed mid-append); a damaged line in
  the middle is reported with its line number and kept, for a human to look at. A run whose
  ``config.yaml`` is missing, or whose ``status.json`` or ``metrics.json`` cannot be read, is a row with
  state ``damaged`` that names the file, never an exception that hides the other runs; metrics that
  disagree with ``samples.jsonl`` are recomputed from it (:func:`inspect_run`).
* **One writer per run directory.** The runner holds :meth:`RunDir.lock` (``flock`` on
  ``<output_dir>/.<run-id>.lock``, beside the run directory because that is only created when the
  first sample finishes) while it computes samples; a second process is refused with the holder's pid,
  host and start time, or waits for it. A lock file that no process holds (its writer was killed, or
  its host went away) is stale: readers say so in one line, and the next writer replaces it. Should a
  sample id appear twice anyway (files written before the lock existed), the *first* record counts:
  it is the one a resumed run skipped on.

The writer never leaves a wrong state behind: a failed write leaves no temporary file, and a full or
read-only folder, Ctrl-C or SIGTERM end the run with ``status.json`` saying so (:mod:`kvbench.runfiles`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError
from kvbench.metrics import prefill_compute_ratio
from kvbench.runfiles import (  # noqa: F401 - re-exported: the names results' users import from here
    OUTPUT_FAULTS,
    OutputError,
    RunLock,
    RunLocked,
    Stopped,
    _append_line,
    _overwrite,
    interrupts_deferred,
    now,
    output_fault,
    read_config,
    read_json,
    stop_on_sigterm,
    warn,
    write_atomic,
)

SAMPLES = "samples.jsonl"
METRICS = "metrics.json"
CONFIG = "config.yaml"
ENV = "env.json"
STATUS = "status.json"
LOG = "run.log"
#: config keys that do not change results: not hashed, and free to differ when a run is resumed
UNHASHED = ("output_dir", "progress", "prefill_cache", "engine")


def config_hash(resolved: dict[str, Any], ignore: Iterable[str] = UNHASHED) -> str:
    """Stable hash of a resolved config, without keys that do not change results and without method and
    task keys at their legacy value (a key added later, set as runs before it behaved: :func:`identity`)."""
    data = {key: value for key, value in identity(resolved).items() if key not in set(ignore)}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def identity(resolved: dict[str, Any]) -> dict[str, Any]:
    """``resolved`` as it identifies a run: the method and task nodes without the keys added after runs were
    recorded that sit at their legacy value (declared with their parameters, :meth:`kvbench.params.Params.identity`;
    each method's and task's module), so a run recorded before a key existed and
    the same run with the key at that value are one run. Nothing heavy is imported."""
    return _each_component(resolved, lambda params, node: params.identity(node))


def with_legacy(resolved: dict[str, Any]) -> dict[str, Any]:
    """``resolved`` with each key its method or task declares a legacy value for (:func:`kvbench.params.param`)
    and lacks set to that value: what a run recorded before the key existed did, so that it reads like
    a run that sets the key (a figure's labels). Nothing heavy is imported."""
    from kvbench.params import legacy_values

    return _each_component(resolved, lambda params, node: {**legacy_values(params), **node})


def _each_component(
    resolved: dict[str, Any], change: Callable[[Any, dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """``resolved`` with its task and method nodes replaced by ``change(their Params class, a copy)``
    (a node whose name declares no parameters is kept)."""
    from kvbench.methods import PARAMS
    from kvbench.tasks.params import TASK_PARAMS

    for group, declared in (("task", TASK_PARAMS), ("method", PARAMS)):
        node = resolved.get(group)
        if not isinstance(node, dict):
            continue
        params = declared.get(str(node.get("name")))
        if params is not None:
            resolved = {**resolved, group: change(params, dict(node))}
    return resolved


def run_id_for(resolved: dict[str, Any]) -> str:
    """``<task>-<method>-<model>-<hash>``: readable, and unique per resolved config."""
    names = [str((resolved.get(group) or {}).get("name", group)) for group in ("task", "method", "model")]
    return "-".join(names + [config_hash(resolved)])


# ---------------------------------------------------------------------- samples.jsonl
@dataclass
class Scan:
    """What ``samples.jsonl`` holds: parsed records (with line numbers), damaged complete lines, and
    where a torn last line (bytes after the last newline) starts."""

    records: list[tuple[int, dict[str, Any]]]
    damaged: list[tuple[int, str]]
    torn_at: int  # == the file size when the file ends with a newline
    size: int


def scan_samples(raw: bytes) -> Scan:
    lines = raw.split(b"\n")
    tail = lines.pop()  # what follows the last newline: empty unless the last append was torn
    records: list[tuple[int, dict[str, Any]]] = []
    damaged: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            damaged.append((number, f"not JSON: {str(exc).split(':')[0]}"))
            continue
        if not isinstance(record, dict) or "id" not in record:
            damaged.append((number, "not a sample record (no id)"))
            continue
        records.append((number, record))
    return Scan(records=records, damaged=damaged, torn_at=len(raw) - len(tail), size=len(raw))


_WARNED: set[tuple[str, int, int]] = set()


def _warn_once(path: Path, size: int, number: int, message: str) -> None:
    """Print a warning about one line of one version of a file once per process."""
    key = (str(path), size, number)
    if key not in _WARNED:
        _WARNED.add(key)
        warn(message)


# ---------------------------------------------------------------------- one run directory
@dataclass
class RunState:
    """Where a run stands: ``status`` is finished, running, unfinished, stopped (SIGTERM, a full or
    read-only folder: ``reason`` says which), failed, stale (metrics.json counts other samples than
    samples.jsonl holds) or damaged (a file of the run cannot be read: ``reason`` names it)."""

    status: str
    done: int
    total: int | None
    #: for a run made of shards (``task.shard=i/n``): how many of its n shard directories exist, and n
    shards: tuple[int, int] | None = None
    reason: str | None = None

    @property
    def label(self) -> str:
        if self.status in ("finished", "stale"):
            return self.status
        if self.status == "damaged":
            return f"damaged: {self.reason}"
        label = f"{self.status} {self.done}/{self.total}" if self.total is not None else f"{self.status} {self.done}"
        label += f" ({self.reason})" if self.reason else ""
        return f"{label} (shards {self.shards[0]}/{self.shards[1]})" if self.shards else label


_NOTED_LOCKS: set[str] = set()


class RunDir:
    """One run's directory: created when the first sample finishes, appended sample by sample."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._log_buffer: list[str] = []

    @property
    def samples_path(self) -> Path:
        return self.path / SAMPLES

    def exists(self) -> bool:
        return self.samples_path.exists()

    # ------------------------------------------------------------------ reading (never writes)
    def records(self) -> list[dict[str, Any]]:
        """Finished samples, each id once (the first record wins).

        A torn last line (a run killed mid-append, or a writer appending right now) is skipped
        silently; a damaged line elsewhere is skipped with a warning naming the file and line. The file
        is never modified here.
        """
        if not self.samples_path.exists():
            return []
        raw = self.samples_path.read_bytes()
        scan = scan_samples(raw)
        for number, reason in scan.damaged:
            _warn_once(
                self.samples_path,
                scan.size,
                number,
                f"{self.samples_path}:{number}: damaged line skipped ({reason}); the file is left as it is",
            )
        records: list[dict[str, Any]] = []
        seen: dict[str, int] = {}
        for number, record in scan.records:
            key = str(record["id"])
            if key in seen:
                _warn_once(
                    self.samples_path,
                    scan.size,
                    number,
                    f"{self.samples_path}:{number}: sample {key} already recorded on line {seen[key]}; "
                    "counting the first record",
                )
                continue
            seen[key] = number
            records.append(record)
        return records

    def finished_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.records()}

    def config(self) -> dict[str, Any] | None:
        """The recorded config; None when it is missing or damaged (:func:`read_config` says which)."""
        return read_config(self.path / CONFIG)[0]

    def check_config(self, resolved: dict[str, Any]) -> None:
        """Refuse to resume a run whose recorded ``config.yaml`` differs from ``resolved`` (a hand edit,
        or a directory copied under the wrong name): its samples would not be this config's."""
        recorded, problem = read_config(self.path / CONFIG)
        if recorded is None:
            if problem and (self.path / CONFIG).exists():
                raise ConfigError(
                    f"{self.path / CONFIG}: {problem.removeprefix(CONFIG + ' ')}; its samples cannot be matched "
                    "to this run's config",
                    f"restore {self.path / CONFIG} (its hash is the directory name), "
                    f"or move {self.path} away to start over",
                )
            return
        ours = json.loads(json.dumps(identity(resolved), default=str))
        differences = _differences(identity(recorded), ours, skip=UNHASHED)
        if differences:
            key, was, now_ = differences[0]
            more = f" and {len(differences) - 1} more key(s)" if len(differences) > 1 else ""
            raise ConfigError(
                f"{self.path / CONFIG} records {key}={was!r} but this run has {key}={now_!r}{more}; "
                "its samples belong to the recorded config",
                f"restore {self.path / CONFIG} (its hash is the directory name), "
                f"or move {self.path} away to start over",
            )

    def metrics(self) -> dict[str, Any]:
        """``metrics.json`` ({} when missing or damaged: :func:`read_json` says which)."""
        return read_json(self.path / METRICS)[0]

    def status(self) -> dict[str, Any]:
        """``status.json`` ({} when missing or damaged)."""
        return read_json(self.path / STATUS)[0]

    def state(self, records: list[dict[str, Any]] | None = None, metrics: dict[str, Any] | None = None) -> RunState:
        """Finished, running (a live process holds the lock), stopped, failed, unfinished, stale, or
        damaged (config.yaml, status.json or metrics.json unreadable; samples.jsonl unreadable).
        ``metrics``: judge by these (metrics recomputed from the samples) instead of ``metrics.json``.
        A lock file that no process holds is named once on stderr as stale."""
        try:
            done = len(self.records() if records is None else records)
        except OSError as exc:
            return RunState("damaged", 0, None, reason=f"{SAMPLES} unreadable ({exc.strerror})")
        status, problem = read_json(self.path / STATUS)
        total = status.get("total")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
            problem, total = problem or f"{STATUS} total {total!r} is not a count", None
        lock = RunLock(self.path)
        probe = lock.probe()
        if probe == "held":
            return RunState("running", done, total)
        if probe == "stale" and lock.holder() and str(lock.path) not in _NOTED_LOCKS:
            _NOTED_LOCKS.add(str(lock.path))
            warn(lock.stale_note())
        problem = read_config(self.path / CONFIG)[1] or problem
        if metrics is None:
            metrics, metrics_problem = read_json(self.path / METRICS)
            problem = problem or metrics_problem
        if problem:
            return RunState("damaged", done, total, reason=problem)
        if status.get("state") in ("failed", "stopped"):
            return RunState(status["state"], done, total, reason=status.get("reason"))
        if not metrics or (total is not None and done < total):
            return RunState("unfinished", done, total)
        if metrics.get("n") is not None and metrics["n"] != done:
            return RunState("stale", done, total)
        return RunState("finished", done, total)

    # ------------------------------------------------------------------ writing (the lock holder only)
    @contextmanager
    def lock(self, *, wait: bool = False, command: str | None = None) -> Iterator[None]:
        """Hold the run directory's lock for the body (see :class:`RunLock`)."""
        lock = RunLock(self.path)
        lock.acquire(wait=wait, command=command)
        try:
            yield
        finally:
            lock.release()

    def repair_tail(self) -> int:
        """Drop a torn last line — bytes after the last newline, or a last line that is not JSON — and
        return how many bytes went. Only the writer calls this, holding the lock; damaged lines
        before the last one are kept (and reported by :meth:`records`)."""
        if not self.samples_path.exists():
            return 0
        raw = self.samples_path.read_bytes()
        scan = scan_samples(raw)
        keep = scan.torn_at
        lines = raw[:keep].split(b"\n")[:-1]
        if lines and scan.damaged and scan.damaged[-1][0] == len(lines):
            keep -= len(lines[-1]) + 1
        if keep < len(raw):
            with open(self.samples_path, "r+b") as handle:
                handle.truncate(keep)
                os.fsync(handle.fileno())
            self.log(f"dropped a torn last line of {SAMPLES} ({len(raw) - keep} bytes); its sample runs again")
        return len(raw) - keep

    def create(self, config_yaml: str, env: dict[str, Any], total: int | None = None) -> None:
        """Make the directory with its config, environment and status (idempotent)."""
        self.path.mkdir(parents=True, exist_ok=True)
        config = self.path / CONFIG
        if not config.exists():
            write_atomic(config, config_yaml)
        write_atomic(self.path / ENV, json.dumps(env, indent=2, sort_keys=True) + "\n")
        self.set_status("running", total=total)

    def set_status(self, state: str, **extra: Any) -> None:
        """Record the run's state (only once the directory exists: a run leaves no trace before).
        ``updated`` is when the state last changed: revisiting a finished run rewrites nothing. Keys
        given with a state (a failure's ``error``) leave with it; ``total`` stays."""
        if not self.path.is_dir():
            return
        current, problem = read_json(self.path / STATUS)
        if problem:
            self.log(f"{problem}: rewritten")
        kept = current if current.get("state") == state else {k: v for k, v in current.items() if k == "total"}
        status = {**kept, **extra, "state": state}
        if status == current:  # the same state with the same keys (its ``updated`` kept): nothing changes
            return
        status["updated"] = now()
        text = json.dumps(status, indent=2, sort_keys=True) + "\n"
        try:
            write_atomic(self.path / STATUS, text)
        except OSError as exc:
            if not output_fault(exc) or not (self.path / STATUS).exists():
                raise
            _overwrite(self.path / STATUS, text)  # a full disk or read-only folder: the file itself may take it

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n"
        with interrupts_deferred():
            _append_line(self.samples_path, line)

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        write_atomic(self.path / METRICS, json.dumps(metrics, indent=2, sort_keys=True, default=_jsonable) + "\n")

    def log(self, message: str) -> None:
        """Append a timestamped line to ``run.log`` (held in memory until the directory exists)."""
        self._log_buffer.append(f"{now()} {message}\n")
        if self.path.is_dir():
            with open(self.path / LOG, "a", encoding="utf-8") as handle:
                handle.writelines(self._log_buffer)
            self._log_buffer.clear()


def _differences(recorded: Any, ours: Any, prefix: str = "", skip: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ between two nested configs (a missing key reads as absent)."""
    if isinstance(recorded, dict) and isinstance(ours, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(recorded) | set(ours), key=str):
            if not prefix and key in skip:
                continue
            name = f"{prefix}.{key}" if prefix else str(key)
            out += _differences(recorded.get(key, "<absent>"), ours.get(key, "<absent>"), name)
        return out
    return [] if recorded == ours else [(prefix, recorded, ours)]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


# ---------------------------------------------------------------------- many runs
#: the files that make a folder a run directory: a run lacking its config.yaml is listed as damaged
RUN_FILES = (CONFIG, SAMPLES, STATUS)


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories at or below ``paths`` (folders holding a ``config.yaml``, ``samples.jsonl`` or
    ``status.json``: one whose config is missing is still a run, a damaged one), finished or not."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if any((path / name).exists() for name in RUN_FILES):
            found.append(path)
        elif path.is_dir():
            inside = {p.parent for name in RUN_FILES for p in path.glob(f"**/{name}")}
            found.extend(sorted(p for p in inside if not p.name.startswith(".")))
    return found


def default_results(start: str | Path | None = None) -> Path:
    """``$KVBENCH_RESULTS``, else the nearest ``results/runs`` from ``start`` (the working directory)
    upwards — so a notebook opened from ``notebooks/`` finds the repository's runs — else
    ``results/runs`` under ``start``."""
    if os.environ.get("KVBENCH_RESULTS"):
        return Path(os.environ["KVBENCH_RESULTS"]).expanduser()
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "results" / "runs").is_dir():
            return folder / "results" / "runs"
    return here / "results" / "runs"


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def load(paths: Iterable[str | Path] | str | Path = "results/runs", *, samples: bool = False) -> Any:
    """A pandas DataFrame of runs (one row per run: config and metrics flattened with dots, plus
    ``state`` — finished, running, unfinished, failed or stale — ``status`` such as ``unfinished 3/10``,
    and the ``done`` and ``total`` sample counts), or of samples (``samples=True``: one row per sample,
    with its run's config columns and ``state``).

    Unfinished runs are included, marked by ``state``; keep ``state == "finished"`` for final numbers.
    Reading never modifies the files (see the module doc)."""
    import pandas as pd

    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    shards: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for run in find_runs(paths):
        config = read_config(run / CONFIG)[0]
        base_config = unsharded(config) if config is not None else None
        if config is not None and base_config is not None:
            shards.setdefault(run_id_for(base_config), []).append((run, config))
            continue
        records, state, metrics = inspect_run(run, config)
        if config is None and state.status == "damaged":  # no model, method or task to tell it by
            state.reason = f"{state.reason} ({run.name})"
        base: dict[str, Any] = {"run_id": run.name, "run_dir": str(run), "state": state.status}
        _flatten("config", config or {}, base)
        _rows(base, records, state, metrics, samples, rows)
    for run_id, parts in shards.items():
        config = unsharded(parts[0][1]) or {}
        merged = merge_shards([run for run, _ in parts])
        base = {
            "run_id": run_id,
            "run_dir": str(parts[0][0]),
            "state": merged.state.status,
            "shard_dirs": [str(run) for run, _ in sorted(parts)],
        }
        _flatten("config", config, base)
        _rows(base, merged.records, merged.state, merged.metrics, samples, rows)
    return pd.DataFrame(rows)


def inspect_run(run: Path, config: dict[str, Any] | None) -> tuple[list[dict[str, Any]], RunState, dict[str, Any]]:
    """A run directory's samples, state and metrics, whatever is damaged, without writing anything.

    Metrics that disagree with ``samples.jsonl`` — ``metrics.json`` unreadable, or counting another
    ``n`` (a torn last line, samples added by hand) — are recomputed from the samples as the runner
    computes them; when that is impossible (no config, an unknown method) they are left out and the
    run is ``damaged``, naming why."""
    run_dir = RunDir(run)
    try:
        records = run_dir.records()
    except OSError as exc:
        return [], RunState("damaged", 0, None, reason=f"{SAMPLES} unreadable ({exc.strerror})"), {}
    metrics, problem = read_json(run / METRICS)
    stale = bool(metrics) and metrics.get("n") is not None and metrics["n"] != len(records)
    if not problem and not stale:
        return records, run_dir.state(records), metrics
    wrong = problem or f"{METRICS} counts n={metrics['n']} but {SAMPLES} holds {len(records)}"
    try:
        if config is None or not records:
            raise ValueError(f"{CONFIG} missing or damaged" if config is None else f"no samples in {SAMPLES}")
        recomputed = shard_metrics(config, records)
    except Exception as exc:  # any failure to recompute leaves the run readable, as damaged
        state = run_dir.state(records)
        why = state.reason if state.status == "damaged" else f"{wrong}, not recomputed ({exc})"
        return records, RunState("damaged", state.done, state.total, reason=why), {}
    state = run_dir.state(records, metrics=recomputed)
    if problem and state.status != "damaged":
        state = RunState("damaged", state.done, state.total, reason=f"{problem}; metrics recomputed from {SAMPLES}")
    elif state.status == "finished":
        state = RunState("stale", state.done, state.total)  # the file on disk is stale; the row is recomputed
    return records, state, ({**recomputed, "artifacts": metrics.get("artifacts")} if metrics else recomputed)


def _rows(
    base: dict[str, Any],
    records: list[dict[str, Any]],
    state: RunState,
    metrics: dict[str, Any],
    samples: bool,
    rows: list[dict[str, Any]],
) -> None:
    if samples:
        for record in records:
            row = dict(base)
            _flatten("", {k: v for k, v in record.items() if k not in ("meta", "telemetry", "budget")}, row)
            _flatten("meta", record.get("meta", {}), row)
            _flatten("telemetry", record.get("telemetry", {}), row)
            row["compute_ratio"] = prefill_compute_ratio(record)  # (the request's share, as in metrics.json)
            rows.append(row)
    else:
        row = {**base, "status": state.label, "done": state.done, "total": state.total}
        _flatten("", metrics, row)
        rows.append(row)


# ---------------------------------------------------------------------- shards (task.shard=i/n)
def unsharded(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config of the run a shard belongs to (``task.shard`` dropped), or None for an unsharded run.
    Its run id is the one the run would have had unsharded."""
    task = config.get("task") or {}
    if not isinstance(task, dict) or task.get("shard") is None:
        return None
    return {**config, "task": {k: v for k, v in task.items() if k != "shard"}}


@dataclass
class Merged:
    records: list[dict[str, Any]]
    state: RunState
    metrics: dict[str, Any]


def merge_shards(runs: list[Path]) -> Merged:
    """The run that the shard directories ``runs`` (of one config, ``task.shard=i/n``) make up: their
    samples (each id once), the metrics recomputed from them as the runner would, and its state —
    finished once all n shards are; otherwise unfinished (or running / failed / damaged when a shard is)."""
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    states, totals, count = [], [], None
    config: dict[str, Any] = {}
    for run in sorted(runs):
        run_dir = RunDir(run)
        config = read_config(run / CONFIG)[0] or config
        count = int(str(config["task"]["shard"]).partition("/")[2]) if config else count
        try:
            part = run_dir.records()
        except OSError as exc:
            part = []
            states.append(RunState("damaged", 0, None, reason=f"{SAMPLES} unreadable ({exc.strerror})"))
        else:
            states.append(run_dir.state(part))
        if states[-1].status == "damaged":
            states[-1].reason = f"shard {run.name}: {states[-1].reason}"
        totals.append(states[-1].total)
        for record in part:
            if str(record["id"]) not in seen:
                seen.add(str(record["id"]))
                records.append(record)
    complete = count is not None and len(runs) == count
    known = [t for t in totals if t is not None]
    total = sum(known) if complete and len(known) == len(totals) else None
    statuses = {s.status for s in states}
    status = (
        "finished"
        if complete and statuses == {"finished"}
        else "running"
        if "running" in statuses
        else "damaged"
        if "damaged" in statuses
        else "failed"
        if "failed" in statuses
        else "unfinished"
    )
    metrics = shard_metrics(unsharded(config) or config, records) if status == "finished" and records else {}
    shards = (len(runs), count) if count is not None else None
    reason = next((s.reason for s in states if s.status == "damaged"), None)
    return Merged(records=records, state=RunState(status, len(records), total, shards, reason), metrics=metrics)


def shard_metrics(config: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """``metrics.json`` of the merged run, computed from its samples like the runner computes it."""
    from kvbench.budget import BudgetConfig
    from kvbench.methods import create_method
    from kvbench.metrics import summarise
    from kvbench.tasks import create_task

    # a method without a budget records its budget keys as nulls (the runner's plan): the defaults stand in
    budget = {key: value for key, value in (config.get("budget") or {}).items() if value is not None}
    metrics = summarise(
        create_task(config["task"]), create_method(config["method"]), BudgetConfig.from_mapping(budget), records
    )
    return json.loads(json.dumps(metrics, default=_jsonable))


def run_records(row: Any) -> list[dict[str, Any]]:
    """The samples of a row of :func:`load` (a run, or shards merged into one)."""
    shard_dirs = row.get("shard_dirs") if hasattr(row, "get") else None
    if isinstance(shard_dirs, list) and shard_dirs:
        return merge_shards([Path(p) for p in shard_dirs]).records
    return RunDir(Path(row["run_dir"])).records()
