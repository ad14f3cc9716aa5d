"""The ``kvbench`` command.

``kvbench run [overrides]`` composes the Hydra config tree shipped in ``kvbench.conf`` (``-m`` sweeps
over comma-separated values); ``list``, ``fetch``, ``report``, ``check``, ``bench`` and ``reproduce``
are plain sub-commands. User mistakes print one ``kvbench: error: ...`` line with the fix and exit
non-zero.

``kvbench run`` parses its flags here and hands the overrides to the sweep service
(:mod:`kvbench.sweep`), which expands every sweep point, composes and validates it before Hydra runs a
job. ``--dry-run`` stops there and prints each point's run directory and resolved config; ``--wait``
queues behind another process writing the same run directory. Ctrl-C prints one line with the number
of samples saved and the command that resumes, and exits with status 130.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError, KvbenchError
from kvbench.listing import conf_dir, group_options
from kvbench.sweep import GROUPS, check_repeated_keys, fail, run_sweep

__all__ = ["conf_dir", "group_options", "main"]


def check_code_origin() -> None:
    """kvbench's core, tasks, methods and configs come from one copy of the code. An editable install
    maps ``kvbench.tasks``/``methods``/``conf`` to the checkout it was installed from; started in another
    checkout (whose ``kvbench/`` is found first, from the working directory), a run would mix two copies
    of the code while its env.json names one commit."""
    import importlib.util

    import kvbench

    core = Path(kvbench.__file__).resolve().parent
    for name in ("kvbench.tasks", "kvbench.methods", "kvbench.conf"):
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            continue
        folder = Path(locations[0]).resolve()
        if folder.parent not in (core, core.parent):
            raise ConfigError(
                f"kvbench's code comes from {core} but {name} from {folder} (an editable install of another checkout)",
                f"run from {folder.parent}, or give this checkout its own environment (make install)",
            )


# ---------------------------------------------------------------------- run
RUN_FLAGS = ("-m", "--multirun", "-h", "--help", "--dry-run", "--cfg", "--wait")
_OPTIONS: dict[str, Any] = {"command": None}  # the command line, for the resume hint of an interruption


def run_usage() -> str:
    """``kvbench run --help``: the groups and their names, the common keys, examples."""
    groups = "\n".join(f"  {g + '=':<12}{', '.join(group_options(g)) or '(none)'}" for g in GROUPS)
    return f"""usage: kvbench run [-m] [--dry-run] [--wait] [key=value ...]

Run one model x method x task config (Hydra overrides); -m runs a sweep over comma-separated values.
Finished samples are saved one by one: running the same command again resumes.

options:
  -m, --multirun   sweep: every combination of the comma-separated values (method=full,oracle)
  --dry-run        validate every point, print its run directory and resolved config; run nothing
                   (--cfg job is accepted as a synonym)
  --wait           when another process is writing the same run directory, wait for it
  -h, --help       this message

config groups (`kvbench list` for details):
{groups}

common keys:
  budget.token_ratio=0.1   fraction of the prompt attended/kept    budget.tokens=1024   absolute budget
  budget.sink=32  budget.local=64  budget.comm_ratio=0.0078125  budget.compensate=true
  task.lengths=[1024,2048]  task.depths=[0,0.5,1]  task.limit=10  task.question_position=start
  task.data_dir=/data/longbench    model.path=/models/llama (model=hf)    model.max_length=32768
  profile.recall=true    output_dir=results/runs    progress=false

examples:
  kvbench run method=oracle budget.token_ratio=0.1 task.lengths=[2048] task.depths=[0.5]
  kvbench run -m method=full,oracle,streamingllm budget.token_ratio=0.1
  kvbench run --dry-run model=hf model.path=/models/llama task=longbench task.data_dir=/data/longbench
  kvbench run 'output_dir="/tmp/résumé"'     (quote values with non-ASCII characters or spaces)

Results land in <output_dir>/<task>-<method>-<model>-<hash>/ (config.yaml, samples.jsonl, metrics.json,
run.log); `kvbench report` tabulates them."""


def _parse_run_args(argv: Sequence[str]) -> tuple[dict[str, bool], list[str]]:
    """Split ``kvbench run`` arguments into our flags and Hydra overrides."""

    flags = {"multirun": False, "help": False, "dry_run": False, "wait": False}
    overrides: list[str] = []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-m", "--multirun"):
            flags["multirun"] = True
        elif arg in ("-h", "--help"):
            flags["help"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg == "--wait":
            flags["wait"] = True
        elif arg == "--cfg" or arg.startswith("--cfg="):
            value = arg.partition("=")[2] or (args.pop(0) if args else "")
            if value != "job":
                raise ConfigError(
                    f"--cfg {value} is not supported", "use --dry-run (or --cfg job) to print the resolved config"
                )
            flags["dry_run"] = True
        elif arg.startswith("-"):
            raise ConfigError(
                f"unknown option {arg}",
                f"kvbench run takes {', '.join(RUN_FLAGS)} and key=value overrides (kvbench run --help)",
            )
        else:
            overrides.append(arg)
    return flags, overrides


def cmd_run(argv: Sequence[str]) -> int:
    import shlex

    from kvbench.errors import Interrupted

    command = "kvbench run " + shlex.join(a for a in argv if a not in ("--dry-run",))
    _OPTIONS["command"] = command
    try:
        flags, overrides = _parse_run_args(argv)
        if flags["help"]:
            print(run_usage())
            return 0
    except KvbenchError as error:
        return _fail(error)
    except KeyboardInterrupt:
        return _fail(Interrupted("interrupted before any sample ran"))
    return run_sweep(
        overrides, multirun=flags["multirun"], wait=flags["wait"], command=command, dry_run=flags["dry_run"]
    )


def _fail(error: KvbenchError) -> int:
    return fail(error, _OPTIONS["command"])


# ---------------------------------------------------------------------- list / fetch / report
def cmd_list(args: argparse.Namespace) -> int:
    from kvbench.listing import listing

    print(listing(args.what))
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from kvbench.assets import ASSETS, fetch_asset, get_asset
    from kvbench.models.loading import converted_model_dir

    names = args.assets or ["smollm2_135m", "paul_graham_essays"]
    if names == ["all"]:
        names = sorted(ASSETS)
    for name in names:
        path = converted_model_dir(name) if get_asset(name).kind == "gguf_model" else fetch_asset(name)
        print(f"{name}: {path}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from kvbench.check import run_checks

    return run_checks(
        args.golden, names=args.names, output_dir=args.output_dir, update=args.update, add_cpu=args.add_cpu
    )


def cmd_report(args: argparse.Namespace) -> int:
    from kvbench.report import check_paths, comparison_figure, parse_where, pivot_table, protocol_diff, runs_table

    if args.html:
        from kvbench.html import build

        output_dir = Path(args.paths[0]) if args.paths else Path("results/runs")
        print(build(Path(args.html), args.scale, output_dir))
        return 0
    if args.diff:
        missing = [p for p in args.diff if not (Path(p) / "config.yaml").exists()]
        if missing:
            raise ConfigError(f"not a run directory: {missing[0]}", "pass two folders under results/runs")
        print(protocol_diff(*args.diff))
        return 0
    paths = check_paths(args.paths or ["results/runs"])
    where = parse_where(args.where)
    if args.figure:
        check_figure_path(Path(args.figure))
        print(comparison_figure(paths, Path(args.figure), where=where, kind=args.figure_kind))
        return 0
    if args.paired:
        from kvbench.compare import paired_report

        print(paired_report(paths, args.paired, where=where))
        return 0
    if args.pivot:
        rows, cols = (part.split(",") if part else [] for part in args.pivot)
        print(pivot_table(paths, rows, cols, value=args.value, where=where, fmt=args.format))
        return 0
    print(runs_table(paths, fmt=args.format, where=where))
    return 0


def check_figure_path(path: Path) -> None:
    """``report --figure F``: a ``.png`` name (figures are PNG files; F.csv and F.md may go beside) in a
    folder that can be written (or made: its nearest existing parent can be written), checked before
    any run is read."""
    import os
    import tempfile

    if path.suffix.lower() != ".png":
        raise ConfigError(
            f"--figure {path}: figures are written as PNG, so the file must end in .png",
            f"use --figure {path.with_suffix('.png') if path.suffix else Path(str(path) + '.png')}",
        )
    if path.is_dir():
        raise ConfigError(f"--figure {path} is a folder", f"name a file in it, e.g. --figure {path / 'figure.png'}")
    folder = path.parent if str(path.parent) else Path(".")
    while not folder.exists() and folder != folder.parent:  # a missing folder is made when the figure is written
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"--figure {path}: {folder} is not a folder", "name a file in a folder")
    try:
        handle, probe = tempfile.mkstemp(prefix=".kvbench-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"--figure {path}: cannot write in {folder} ({exc.strerror})", "choose a folder you can write to"
        ) from None


def cmd_reproduce(args: argparse.Namespace) -> int:
    """``kvbench reproduce``: list the paper artifacts, or run one's missing runs and render it."""
    from kvbench.experiments import DEFAULT_SCALE, SCALES
    from kvbench.reproduce import listing, reproduce

    if args.list or not args.name:
        print(listing())
        return 0
    check_repeated_keys(args.overrides)
    scale, extra = DEFAULT_SCALE, []
    for item in args.overrides:
        if item.startswith("scale="):
            scale = item.partition("=")[2]
            if scale not in SCALES:
                raise ConfigError(f"unknown scale {scale!r}", f"use scale={' | scale='.join(SCALES)}")
        else:
            extra.append(item)
    report = reproduce(
        args.name,
        scale,
        extra,
        run=not args.no_run,
        dry_run=args.dry_run,
        out=Path(args.out) if args.out else None,
        wait=args.wait,
    )
    if not args.dry_run:
        print(report.markdown())
        if report.out_dir is not None:
            print(f"written: {report.out_dir}/ (report.md, report.tex, section-*.csv, figures)")
    return 0


def check_bench_options(args: argparse.Namespace) -> None:
    """``kvbench bench``'s counts and names, in kvbench's words, before a benchmark starts."""
    for option, value in (("--rounds", args.rounds), ("--repeats", args.repeats), ("--new-tokens", args.new_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{option} {value} runs nothing", f"give {option} 1 or more")
    if args.model is not None and args.model not in group_options("model"):
        raise ConfigError(
            f"unknown model {args.model!r} (--model)", f"choose one of: {', '.join(group_options('model'))}"
        )
    for entry in (args.methods or "").split(","):
        method = entry.partition(":")[0]  # (reuse_ttft takes name:tier; it checks the tier itself)
        if method and method not in group_options("method"):
            raise ConfigError(
                f"unknown method {method!r} (--methods)", f"choose from: {', '.join(group_options('method'))}"
            )
    from kvbench.models import check_device

    check_device(args.device)


def cmd_bench(args: argparse.Namespace) -> int:
    import json
    import os

    check_bench_options(args)  # before torch and the benchmarks load
    import torch

    from kvbench.bench import BenchOptions, discover, render

    benches = discover()
    names = args.names or sorted(benches)
    unknown = [n for n in names if n not in benches]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}", f"choose from: {', '.join(sorted(benches))}")
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None
        if lengths is not None and min(lengths) < 1:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--lengths {args.lengths!r} is not a list of token counts", "e.g. --lengths 32768,65536"
        ) from None
    import yaml

    def key_values(items: list[str], flag: str, example: str) -> dict[str, Any]:
        """``--flag KEY=VALUE`` options as a mapping (each VALUE read as YAML)."""
        out = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"{flag} {item!r} is not KEY=VALUE", f"e.g. {flag} {example}")
            out[key] = yaml.safe_load(value)
        return out

    params = key_values(args.param, "--param", "kmeans_device=model")
    engine = key_values(args.engine, "--engine", "decode=dynamic")
    from kvbench.engine.settings import engine_settings

    engine_settings(engine)  # a bad key or value: one line, before anything runs
    options = BenchOptions(
        quick=args.quick,
        device=args.device,
        repeats=args.repeats,
        model=args.model,
        lengths=lengths,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        params=params,
        save=args.save,
        methods=tuple(m for m in args.methods.split(",") if m) if args.methods else None,
        engine=engine,
    )
    results = [benches[name](options) for name in names]
    from kvbench.runner import device_name

    device = device_name("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    record = json.dumps(
        {
            "device": device,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "results": [r.__dict__ for r in results],
        },
        indent=2,
        default=str,
    )
    if args.save:
        from kvbench.results import write_atomic

        write_atomic(Path(args.save), record + "\n")
    print(record if args.json else "\n\n".join(render(r) for r in results))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import shlex

    from kvbench.errors import Interrupted

    argv = list(sys.argv[1:] if argv is None else argv)
    _OPTIONS["command"] = "kvbench " + shlex.join(argv)
    try:
        check_code_origin()
    except KvbenchError as error:
        return _fail(error)
    if argv and argv[0] == "run":
        return cmd_run(argv[1:])
    from kvbench.cli_parser import parse

    try:
        args = parse(argv)
    except KvbenchError as error:
        return _fail(error)
    handlers = {
        "list": cmd_list,
        "fetch": cmd_fetch,
        "report": cmd_report,
        "bench": cmd_bench,
        "check": cmd_check,
        "reproduce": cmd_reproduce,
    }
    try:
        return handlers[args.command](args)
    except KvbenchError as error:
        return _fail(error)
    except KeyboardInterrupt:
        return _fail(Interrupted("interrupted"))


if __name__ == "__main__":
    sys.exit(main())
