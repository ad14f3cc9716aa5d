"""Run one (model, method, task) configuration end to end, resumably.

The run directory is named by a hash of the resolved config, so re-running the same command finds
the finished samples and only runs the rest (when the task knows its sample ids up front, a finished
run does not even load the model). Before any work the config is validated (:mod:`kvbench.validate`)
and compared with the ``config.yaml`` of an existing run directory; then the run takes the directory's
lock (one writer per run directory, :meth:`kvbench.results.RunDir.lock`). The directory itself is
created when the first sample finishes, so a run that fails on bad input leaves no trace.

Ctrl-C ends a run with :class:`~kvbench.errors.Interrupted` (how many samples are saved); the CLI
turns it into one line with the command that resumes. ``status.json`` and ``run.log`` record what
happened, for ``kvbench report`` and for people.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench.budget import BudgetConfig
from kvbench.config import RunConfig
from kvbench.engine.settings import EngineSettings
from kvbench.errors import ConfigError, Interrupted
from kvbench.metrics import summarise
from kvbench.profile import Profile
from kvbench.results import (
    OutputError,
    RunDir,
    Stopped,
    output_fault,
    run_id_for,
    stop_on_sigterm,
    warn,
)

if TYPE_CHECKING:
    from kvbench.engine.prefill_cache import PrefillSharing
    from kvbench.shared import Sweep


@dataclass
class RunSummary:
    run_dir: Path
    metrics: dict[str, Any]
    ran: int  # samples computed by this invocation
    seconds: float


@dataclass
class Plan:
    """A validated run, before anything is loaded: its typed configuration, the task and method built
    from it, and its run directory."""

    resolved: dict[str, Any]  # as recorded in config.yaml (a dense method's budget nulled)
    config: RunConfig  # the typed groups, parsed once (kvbench.config)
    task: Any
    method: Any
    run_dir: RunDir


def plan(resolved: dict[str, Any]) -> Plan:
    """Validate ``resolved`` and build the task, method and budget; loads no model and writes nothing."""
    from kvbench.methods import create_method
    from kvbench.tasks import create_task
    from kvbench.validate import check_config, check_method

    check_config(resolved)  # every group and the rules between them (a method without its budget, ...)
    method = create_method(resolved["method"])
    config = check_method(resolved, method)  # the checks that need torch; the typed groups
    task = create_task(resolved["task"])
    if not config.method.needs_budget:
        # a method that does not compress ignores the budget: runs of one sweep share its run directory
        resolved = {**resolved, "budget": {key: None for key in (resolved.get("budget") or {})}}
    # options a task gained after runs were recorded stay out of the run id at their defaults
    resolved = {**resolved, "task": task.recorded_config(resolved["task"])}
    if not config.method.uses_chunk_store:
        # only reuse methods read store.*: other methods' run ids do not depend on it
        resolved = {key: value for key, value in resolved.items() if key != "store"}
    return Plan(resolved, config, task, method, RunDir(config.output_dir / run_id_for(resolved)))


def check_sources(configs: Sequence[dict[str, Any]]) -> None:
    """Before a command runs ``configs``: every run that still has samples to run and reads its data from
    the Hugging Face hub finds the hub answering (each data set asked once). Not part of validation, so
    that a dry run plans offline; :func:`run` asks again for its own run."""
    from kvbench.tasks import create_task

    asked: set[tuple[str, str]] = set()
    for resolved in configs:
        hub = create_task(resolved["task"]).hub_source()
        if hub is None or hub in asked:
            continue
        p = plan(resolved)
        if _check_hub(p.task, p.run_dir):
            asked.add(hub)


def _check_hub(task: Any, run_dir: RunDir) -> bool:
    """Whether the hub was asked (and answered) for ``task``'s data: not when the task reads none from it
    or ``run_dir`` is finished (nothing left to read)."""
    hub = task.hub_source()
    if hub is None or run_dir.status().get("state") == "finished":
        return False
    from kvbench.tasks.sources import check_hub

    check_hub(*hub)
    return True


def run(
    resolved: dict[str, Any], *, wait: bool = False, command: str | None = None, sweep: Sweep | None = None
) -> RunSummary:
    """Run the config ``resolved`` (a plain dict: model, method, task, budget, profile, output_dir).

    ``wait``: when another process writes the same run directory, wait for it instead of failing.
    ``command``: how this run was started (recorded in the lock and ``run.log``).
    ``sweep``: the sweep this run is a point of, whose dense prefills and chunk stores it may share
    (:mod:`kvbench.shared`; :func:`sharing` says what it takes); ``None``: a run on its own.
    """
    started = time.perf_counter()
    p = plan(resolved)
    run_dir, task = p.run_dir, p.task
    run_dir.check_config(p.resolved)
    _check_hub(task, run_dir)  # before the lock and the model: one line, nothing written
    known = task.shard_sample_ids()
    with run_dir.lock(wait=wait, command=command), stop_on_sigterm():
        try:
            metrics, ran = _run_locked(p, known, command, sweep)
        except BaseException as exc:
            error = _record_end(exc, run_dir, known, command)
            if error is exc:
                raise
            raise error from None
    return RunSummary(run_dir=run_dir.path, metrics=metrics, ran=ran, seconds=time.perf_counter() - started)


def _run_locked(
    p: Plan, known: list[str] | None, command: str | None, sweep: Sweep | None
) -> tuple[dict[str, Any], int]:
    """The body of :func:`run`, holding the lock: the samples left, then metrics, artifacts and status."""
    run_dir, task = p.run_dir, p.task
    run_dir.repair_tail()
    done = run_dir.finished_ids()
    ran = 0
    if known is None or not set(known) <= done:
        run_dir.log(
            f"start: pid {os.getpid()} on {socket.gethostname()}"
            + (f", {len(done & set(known))} of {len(known)} samples done" if known is not None else "")
            + (f"; command: {command}" if command else "")
        )
        ran = _run_samples(p, done, sweep)
    records = run_dir.records()
    if known is not None:
        wanted = set(known)
        records = [r for r in records if str(r["id"]) in wanted]
    if not records:
        raise ConfigError("the task produced no samples", "check task.limit, task.lengths or the data set")
    metrics = summarise(task, p.method, p.config.budget, records)
    run_dir.write_metrics(metrics)
    title = f"{p.config.model.name} · {p.method.name} · {p.method.budget_label(p.config.budget)}"
    metrics["artifacts"] = [path.name for path in task.artifacts(records, run_dir.path, title)]
    run_dir.write_metrics(metrics)
    run_dir.set_status("finished", total=len(records) if known is None else len(known))
    if ran:
        run_dir.log(f"finished: {ran} new samples, n={metrics.get('n')}, score {metrics.get('score')}")
    return metrics, ran


def _record_end(exc: BaseException, run_dir: RunDir, known: list[str] | None, command: str | None) -> BaseException:
    """Record in ``status.json`` and ``run.log`` why a run ended early, and return what to raise:
    Ctrl-C and SIGTERM become :class:`Interrupted` (state ``interrupted`` / ``stopped``), a full or
    read-only output folder an :class:`OutputError` (state ``stopped``) — each naming the samples saved
    and the command that resumes; anything else is recorded as ``failed`` and raised as it is. Recording
    is best effort: a folder that takes no write leaves the status as it was, and says so."""
    count = _saved(run_dir, known)
    saved = "?" if count is None else str(count)
    of = f" of {len(known)}" if known is not None else ""
    resume = {"resume": command} if command else {}
    again = f"run `{command}` again" if command else "run the same command again"
    fault = output_fault(exc)
    if isinstance(exc, (KeyboardInterrupt, Stopped)):
        if isinstance(exc, Stopped):
            why = str(exc)
            _record(run_dir, "stopped", reason=signal.Signals(exc.signum).name, **resume)
        else:
            why = "interrupted"
            _record(run_dir, "interrupted", **resume)
        _record_log(run_dir, f"{why}: {saved} samples saved")
        error = Interrupted(
            f"{why}: {saved}{of} samples saved in {run_dir.path}",
            saved=count or 0,
            total=len(known) if known is not None else None,
            run_dir=run_dir.path,
        )
        if isinstance(exc, Stopped):
            error.exit_code = 128 + exc.signum
        return error
    if fault and isinstance(exc, OSError):
        where = exc.filename or run_dir.path
        _record(run_dir, "stopped", reason=fault, error=f"{exc.strerror}: {where}", **resume)
        _record_log(run_dir, f"stopped: {exc.strerror}: {where}; {saved} samples saved")
        folder = where if Path(where).exists() else Path(where).parent  # a file that was never made: its folder
        fix = "free space on that disk" if fault in ("disk full", "disk quota exceeded") else f"make {folder} writable"
        return OutputError(
            f"cannot write {where}: {exc.strerror}; {saved}{of} samples are saved in {run_dir.path}",
            f"{fix}, then {again}: it resumes after them",
        )
    _record(run_dir, "failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__, **resume)
    _record_log(run_dir, f"failed: {type(exc).__name__}: {exc}")
    return exc


def _saved(run_dir: RunDir, known: list[str] | None) -> int | None:
    """How many samples ``samples.jsonl`` holds (of the run's own, when known); None when unreadable."""
    try:
        ids = run_dir.finished_ids()
    except OSError:
        return None
    return len(ids & set(known)) if known is not None else len(ids)


def _record(run_dir: RunDir, state: str, **extra: Any) -> None:
    """:meth:`RunDir.set_status`, best effort (the run is ending already: say what could not be written)."""
    try:
        run_dir.set_status(state, **extra)
    except OSError as exc:
        warn(f"could not record state {state} in {run_dir.path / 'status.json'} ({exc.strerror})")


def _record_log(run_dir: RunDir, message: str) -> None:
    try:
        run_dir.log(message)
    except OSError:
        pass


def sharing(p: Plan, sweep: Sweep | None) -> tuple[PrefillSharing | None, bool]:
    """What a run takes from its sweep: (the shared dense prefills or None, whether it takes the sweep's
    chunk store). ``prefill_cache: null`` shares inside a sweep and not alone; ``true`` shares (a run
    alone gets a cache of its own); ``false`` never. The chunk store is shared with the prefills, unless
    the task starts every run on an empty store (a request stream) or the method fills the store from its
    own prompts (its entries are this run's, and sharing saves it no precomputation)."""
    from kvbench.engine.prefill_cache import PrefillSharing, environment_cache
    from kvbench.methods import create_method

    setting = p.config.prefill_cache
    if not (sweep is not None if setting is None else setting):
        return None, False
    cache = sweep.prefill_cache() if sweep is not None else environment_cache()
    cache.begin_run()  # (the earlier runs' entries may now be evicted, this run's are kept)
    points = sweep.points if sweep is not None else ()
    fills = bool(getattr(p.method, "fills_store", False))  # (a reuse method's; others have no store)
    shared_store = sweep is not None and p.task.shares_chunk_store and not fills
    return PrefillSharing(cache, points, build=create_method), shared_store


def _run_samples(p: Plan, done: set[str], sweep: Sweep | None) -> int:
    """Load the model and run the samples of ``p`` not in ``done``, appending each as it finishes."""
    import yaml

    from kvbench.kv.chunks import ChunkStore
    from kvbench.models.loading import load_model
    from kvbench.progress import Progress

    config, task, method, run_dir = p.config, p.task, p.method, p.run_dir
    clock = time.perf_counter()
    model = load_model(config.model.node)
    prefills, shared_store = sharing(p, sweep)
    if config.store is not None:
        method.attach_store(sweep.chunk_store(config.store) if sweep and shared_store else ChunkStore(config.store))
    run_dir.log(f"model {config.model.name} loaded in {time.perf_counter() - clock:.1f} s")
    config_yaml = yaml.safe_dump(p.resolved, sort_keys=True)
    ids = task.shard_sample_ids()
    total = len(ids) - len(done & set(ids)) if ids is not None else None
    ran = 0
    settings = (config.budget, config.profile, config.engine, prefills)
    replay = Replay(run_dir, done) if task.order_dependent and done else None
    progress = Progress(run_dir, total=total, enabled=config.progress)
    try:
        for sample in task.shard_samples(model):
            if sample.id in done:
                if replay is not None:  # rebuild the state the later samples depend on
                    replay.check(sample.id, run_sample(task, sample, model, method, *settings))
                continue
            if replay is not None:
                replay.close()
            clock = time.perf_counter()
            result = run_sample(task, sample, model, method, *settings)
            record = result.to_record()
            record["protocol"] = task.protocol()
            if ran == 0:
                run_dir.create(config_yaml, environment(model.spec), total=len(ids) if ids is not None else None)
            run_dir.append(record)
            ran += 1
            progress.sample(sample.id, result.score, time.perf_counter() - clock)
    finally:
        progress.close()
    return ran


class Replay:
    """The finished samples of an order-dependent task (:attr:`Task.order_dependent`) served again on a
    resume, unrecorded, before the first new one; logs how many answers came out as recorded (all of them
    when the run is deterministic, as on CPU at the recorded thread count)."""

    def __init__(self, run_dir: RunDir, done: set[str]) -> None:
        self.run_dir, self.recorded = run_dir, {str(r["id"]): r.get("prediction") for r in run_dir.records()}
        self.served = self.same = 0
        self.open = True
        run_dir.log(f"replay: serving the {len(done)} finished samples again, unrecorded, to rebuild the state")

    def check(self, sample_id: str, result: Any) -> None:
        self.served += 1
        self.same += result.prediction == self.recorded.get(sample_id)

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        line = f"replay: {self.served} samples served again, {self.same} answers as recorded"
        self.run_dir.log(line)
        if self.same < self.served:
            print(f"kvbench: warning: {line} (the state the next samples see may differ)", file=sys.stderr)


def run_sample(
    task: Any,
    sample: Any,
    model: Any,
    method: Any,
    budget: BudgetConfig,
    profile: Profile,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Any:
    """Execute the sample's requests with the engine, in order, and let the task score the outputs; a
    :class:`~kvbench.requests.FollowUp` is expanded, when reached, into the requests it builds from the
    outputs so far."""
    from kvbench.engine import execute
    from kvbench.requests import FollowUp

    pending = list(task.requests(sample, model))
    outputs: list[Any] = []
    while pending:
        request = pending.pop(0)
        if isinstance(request, FollowUp):
            pending = list(request.build(list(outputs))) + pending
            continue
        outputs.append(execute(model, method, request, budget, profile, engine, sharing))
    return task.result(sample, outputs)


def device_name(device: str) -> str:
    """A human name for the device timings were taken on (the CPU model, not just the architecture)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(spec: Any) -> dict[str, Any]:
    import torch
    import transformers

    import kvbench

    device = spec.device
    return {
        "kvbench": kvbench.__version__,
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "device": device,
        "device_name": device_name(device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": spec.to_dict(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _git_sha() -> str | None:
    """The code's commit (``-dirty`` with local changes); ``KVBENCH_GIT_SHA`` names it for installed copies."""
    if os.environ.get("KVBENCH_GIT_SHA"):
        return os.environ["KVBENCH_GIT_SHA"]
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=5,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def format_summary(summary: RunSummary) -> str:
    """A short human-readable table of one run's results."""
    m = summary.metrics
    lines = [f"run: {summary.run_dir}  ({summary.ran} new samples, {summary.seconds:.1f} s)"]
    fields = [
        ("score", m.get("score")),
        ("n", m.get("n")),
        ("TTFT s", m.get("ttft_s")),
        ("TT2T s", m.get("tt2t_s")),
        ("TPOT s", m.get("tpot_s")),
        ("recall", m.get("recall")),
        ("hit rate", m.get("hit_rate")),
        ("KV kept", m.get("kv_bytes_ratio")),
        ("attended", m.get("attended_tokens")),
    ]
    lines.append("  ".join(f"{name}={_fmt(value)}" for name, value in fields if value is not None))
    grid = m.get("grid")
    if grid:
        depths = sorted({d for row in grid.values() for d in row}, key=float)
        lines.append("length \\ depth  " + "  ".join(f"{float(d):>5.2f}" for d in depths))
        for length in sorted(grid, key=int):
            lines.append(f"{length:>14}  " + "  ".join(f"{grid[length].get(d, float('nan')):>5.0f}" for d in depths))
    elif m.get("per_subset"):
        lines.append("  ".join(f"{k}={v}" for k, v in m["per_subset"].items()))
    if m.get("artifacts"):
        lines.append("artifacts: " + ", ".join(str(summary.run_dir / a) for a in m["artifacts"]))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)
