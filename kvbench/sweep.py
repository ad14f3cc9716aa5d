"""The sweep service: a command line's overrides expanded into points, validated, and run.

``kvbench run`` (:mod:`kvbench.cli`) and ``kvbench reproduce`` (:mod:`kvbench.reproduce`) both go through
here. Before Hydra runs a job, every sweep point is expanded (an experiment's ``hydra.sweeper.params``
merged with the command line's values, shards split), composed and validated (:mod:`kvbench.validate`:
no model, no data, no torch for the config-only checks), so a bad value in the last point of a sweep is
reported in a second, not after the first points ran. :func:`run_sweep` then hands the points to Hydra
(:func:`launch`: in this process, or through a launcher such as joblib or Slurm), one :func:`run_job`
per point, and prints the sweep's runs table; ``dry_run`` stops after validation and prints each point's
run directory and resolved config.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

from kvbench.compose import CONFIG_MODULE, register_method_configs
from kvbench.errors import ConfigError, Interrupted, KvbenchError
from kvbench.listing import group_options

GROUPS = ("model", "method", "task", "experiment")
# What the Hydra job function reads (it takes only the job's config): set by launch() for its jobs.
_JOB: dict[str, Any] = {"wait": False, "command": None, "sweep": None}
_SWEEP_RUNS: list[Any] = []


def fail(error: KvbenchError, command: str | None) -> int:
    """Print ``error`` as one ``kvbench: error: ...`` line (an interruption: with the ``command`` that
    resumes) and return its exit status."""
    if isinstance(error, Interrupted):
        print(f"kvbench: {error.message}; resume with: {command}", file=sys.stderr, flush=True)
    else:
        print(f"kvbench: error: {error}", file=sys.stderr, flush=True)
    return error.exit_code


# ---------------------------------------------------------------------- checks of the overrides
def check_repeated_keys(overrides: Sequence[str]) -> None:
    """A key given twice with two values on one command line. Two choices of a group (``method=oracle
    method=full``) are refused: Hydra would keep the last silently and run another model, method or task
    than half of the command names (a sweep was meant). A plain key given twice (``task.limit=2 ...
    task.limit=5``, the usual way a script adds to a base command) keeps the last, as Hydra does, and a
    note says so, so it is not silent."""
    from kvbench.errors import note

    seen: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0].lstrip("+~")
        if key in seen and seen[key].partition("=")[1:] != item.partition("=")[1:]:  # (one value twice: harmless)
            if key in GROUPS:
                values = ",".join(o.partition("=")[2] for o in (seen[key], item))
                raise ConfigError(
                    f"{key} is given twice ({seen[key]} and {item}): only the last would run",
                    f"keep one; to run both, sweep them: -m {key}={values}",
                )
            note(f"{key} is given twice ({seen[key]}, then {item}): the last counts")
        seen[key] = item


def check_choices(overrides: Sequence[str]) -> None:
    """Group choices (``method=nope``) named with the valid names, before Hydra's longer message."""

    for item in overrides:
        key, sep, value = item.partition("=")
        group = key.lstrip("+~")
        if sep and group in GROUPS:
            for choice in value.split(","):
                if choice and choice not in group_options(group):
                    raise ConfigError(
                        f"unknown {group} {choice!r}",
                        f"choose one of: {', '.join(group_options(group))} (`kvbench list`)",
                    )


def validate_method_params(overrides: Sequence[str]) -> None:
    """Every sweep point's ``method.*`` settings against the method's declared parameters (torch-free)."""
    from kvbench.compose import method_sweep_points
    from kvbench.methods import validate_method_config

    for node in method_sweep_points(overrides):
        validate_method_config(node)


def _check_merged(overrides: Sequence[str]) -> None:
    """The checks every merged list of overrides passes before it is expanded."""
    check_choices(overrides)
    validate_method_params(overrides)


# ---------------------------------------------------------------------- points
def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The points of one ``-m`` style sweep (shards split, values merged), checked as ``kvbench run -m``
    checks them; not composed (``kvbench reproduce`` composes all its sweeps' points at once)."""
    from kvbench.compose import merge_overrides, shard_overrides, sweep_points

    merged = merge_overrides(shard_overrides(overrides))
    _check_merged(merged)
    return sweep_points(merged)


def resolve_points(overrides: Sequence[str], multirun: bool) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """Every point of the command (one without ``-m``), composed and validated, before any runs."""
    from kvbench.compose import compose_many, is_sweep, merge_overrides, shard_overrides, sweep_points
    from kvbench.experiments import sweeper_overrides
    from kvbench.validate import validate_points

    # an experiment's hydra.sweeper.params come first and command-line values replace an axis, as in
    # Hydra's basic sweeper (which runs the jobs); validating the merged list checks what will run
    overrides = merge_overrides([*sweeper_overrides(overrides), *shard_overrides(overrides)])
    _check_merged(overrides)
    sweeps = is_sweep(overrides)
    if sweeps and not multirun:
        raise ConfigError(f"{sweeps[0]} is a sweep", "add -m to run every value (kvbench run -m ...)")
    points = sweep_points(overrides) if multirun else [list(overrides)]
    configs = compose_many(points)
    swept = {o.partition("=")[0] for o in sweeps}
    labels = [" ".join(o for o in point if o.partition("=")[0] in swept) for point in points]
    validate_points(configs, labels)
    return points, configs


def print_dry_run(configs: list[dict[str, Any]]) -> None:
    """Each point's run directory (with its state) and resolved config, as ``--dry-run`` prints them."""
    import yaml

    from kvbench.runner import plan

    for index, resolved in enumerate(configs):
        p = plan(resolved)
        state = p.run_dir.state() if (p.run_dir.path / "config.yaml").exists() else None
        known = p.task.shard_sample_ids()
        where = f"{state.label}" if state else "new"
        total = f" ({len(known)} samples)" if known is not None and not state else ""
        if len(configs) > 1:
            print(f"# point {index + 1}/{len(configs)}")
        print(f"# run directory: {p.run_dir.path} [{where}]{total}")
        print(yaml.safe_dump(p.resolved, sort_keys=False).rstrip())


# ---------------------------------------------------------------------- running
def run_sweep(overrides: Sequence[str], *, multirun: bool, wait: bool, command: str, dry_run: bool = False) -> int:
    """What ``kvbench run`` does with its overrides: check, expand, compose and validate every point,
    then print them (``dry_run``) or check their sources and :func:`launch` them. Errors print one line
    (:func:`fail`); returns the exit status."""
    from kvbench.compose import shard_overrides

    try:
        check_choices(overrides)  # (an unknown name first: it is the likelier slip)
        check_repeated_keys(overrides)
        overrides = shard_overrides(overrides)
        points, configs = resolve_points(overrides, multirun)
        if dry_run:
            print_dry_run(configs)
            return 0
        from kvbench.runner import check_sources

        check_sources(configs)
    except KvbenchError as error:
        return fail(error, command)
    except KeyboardInterrupt:
        return fail(Interrupted("interrupted before any sample ran"), command)
    return launch(list(overrides), points, configs, multirun=multirun, wait=wait, command=command)


def launch(
    overrides: list[str],
    points: list[list[str]],
    configs: list[dict[str, Any]],
    *,
    multirun: bool,
    wait: bool,
    command: str,
) -> int:
    """Run the validated points through Hydra (``--multirun`` with its launcher), one :func:`run_job`
    each; the sweep's methods share dense prefills. Ctrl-C prints one line with the number of runs
    finished and the ``command`` that resumes; a multirun ends with its runs table."""
    import hydra

    from kvbench.shared import Sweep

    register_method_configs()
    # the sweep's methods share dense prefills and chunk stores (prefill_cache: null); one run shares nothing
    sweep = Sweep.of(configs) if multirun else None
    _JOB.update(wait=wait, command=command, sweep=sweep)
    main = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base=None)(run_job)
    saved = sys.argv
    sys.argv = ["kvbench"] + (["--multirun"] if multirun else []) + overrides
    _SWEEP_RUNS.clear()
    try:
        main()
    except KeyboardInterrupt:  # between runs of a sweep, or inside Hydra: every finished sample is saved
        done = f"{len(_SWEEP_RUNS)} of {len(points)} runs finished" if len(points) > 1 else "nothing was lost"
        return fail(Interrupted(f"interrupted ({done})"), command)
    finally:
        sys.argv = saved
        _JOB["sweep"] = None
        if sweep is not None:
            sweep.close()
    if multirun and len(points) > 1:
        print("\n" + sweep_table(configs), flush=True)
    return 0


def run_job(cfg: Any) -> None:
    """One Hydra job: the point's resolved config run by :func:`kvbench.runner.run`, its summary printed."""
    from omegaconf import OmegaConf

    from kvbench.compose import NOT_RUN_KEYS
    from kvbench.runner import format_summary, run

    resolved = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    for key in NOT_RUN_KEYS:
        resolved.pop(key, None)
    pin_device(resolved)
    try:
        summary = run(resolved, wait=_JOB["wait"], command=_JOB["command"], sweep=_JOB["sweep"])
    except KvbenchError as error:
        raise SystemExit(fail(error, _JOB["command"])) from None
    _SWEEP_RUNS.append(summary)
    print(format_summary(summary), flush=True)


def pinned_device(job_index: int, device_count: int) -> int | None:
    """The GPU a sweep job uses on a node with several: job ``i`` takes GPU ``i mod count`` (None with
    fewer than two GPUs: nothing to choose)."""
    return job_index % device_count if device_count > 1 else None


def pin_device(resolved: dict[str, Any]) -> None:
    """Per-job device pinning on multi-GPU nodes: a launcher's job ``i`` (Hydra's job number) runs on
    GPU ``i mod n``, so ``hydra/launcher=joblib hydra.launcher.n_jobs=8`` on an 8-GPU node spreads the
    jobs over the GPUs. Only for ``model.device`` auto/cuda (an explicit ``cuda:k`` is kept), and not
    when ``KVBENCH_PIN_DEVICES=0``; Slurm jobs that get one GPU each see one device and are left alone.
    The run's config is unchanged (the device is chosen with ``torch.cuda.set_device``), so a pinned
    job writes the same run directory as an unpinned one."""
    import os

    if os.environ.get("KVBENCH_PIN_DEVICES", "1") == "0":
        return
    if str((resolved.get("model") or {}).get("device", "auto")) not in ("auto", "cuda"):
        return
    try:
        import torch
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        if not torch.cuda.is_available():
            return
        # a single run (no --multirun) has no job number: hydra.job.num is MISSING there, and reading
        # it raised, which stopped every plain `kvbench run` on a CUDA machine
        hydra_cfg: Any = HydraConfig.get()  # (typed HydraConf; a DictConfig at run time)
        number = OmegaConf.select(hydra_cfg, "job.num", default=None, throw_on_missing=False)
        if number is None:
            return
        index = pinned_device(int(number), torch.cuda.device_count())
    except (ImportError, ValueError):
        return
    if index is not None:
        torch.cuda.set_device(index)


def sweep_table(configs: list[dict[str, Any]]) -> str:
    """The runs table of a sweep's points, from their run directories (jobs may have run in other
    processes or on other machines, through a launcher)."""
    from kvbench.report import runs_table
    from kvbench.runner import plan

    paths = list(dict.fromkeys(plan(c).run_dir.path for c in configs))
    existing = [p for p in paths if p.exists()]
    return runs_table(existing) if existing else "(no run directory was written)"
