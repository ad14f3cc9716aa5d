"""The argument parsers of ``kvbench``'s sub-commands other than ``run`` (which parses its own: Hydra
overrides and four flags, :func:`kvbench.cli.cmd_run`).

Every sub-command takes its options and its positional arguments (names, paths, Hydra overrides) in any
order (``kvbench reproduce NAME --no-run scale=cpu``): :func:`parse` uses argparse's intermixed parsing.
argparse's own complaints (an unknown option, a bad choice) are kvbench's one error line with the fix,
exit status 2, like every other user error.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from kvbench.errors import ConfigError
from kvbench.listing import KEY_GROUPS


class Parser(argparse.ArgumentParser):
    """argparse with its complaints as kvbench's one error line (exit status 2), not usage text."""

    def error(self, message: str) -> Any:  # (argparse's signature says NoReturn; raising keeps that)
        raise ConfigError(f"{self.prog}: {message}", f"see `{self.prog} --help`")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``kvbench <command> ...`` as a namespace with ``command`` set; raises :class:`ConfigError`."""
    parser = Parser(prog="kvbench", description="Benchmark harness for KV-cache methods.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _simple_parsers(sub)
    commands["report"] = _report_parser(sub)
    commands["reproduce"] = _reproduce_parser(sub)
    commands["check"] = _check_parser(sub)
    commands["bench"] = _bench_parser(sub)
    if argv and argv[0] in commands:  # options and positional arguments in any order
        args = commands[argv[0]].parse_intermixed_args(list(argv[1:]))
        args.command = argv[0]
        return args
    return parser.parse_args(list(argv))


def _simple_parsers(sub: Any) -> dict[str, argparse.ArgumentParser]:
    """``run`` (for the help only), ``list`` and ``fetch``."""
    sub.add_parser(
        "run", help="run a model x method x task config (Hydra overrides; -m for sweeps; kvbench run --help)"
    )
    p_list = sub.add_parser(
        "list",
        help="list models, methods, tasks, experiments and assets; `kvbench list tasks` (methods, models, "
        "budget, ...): that group's parameters",
    )
    p_list.add_argument("what", nargs="?", choices=["models", "methods", "tasks", "experiments", "assets", *KEY_GROUPS])
    p_fetch = sub.add_parser("fetch", help="download and convert offline assets ahead of time")
    p_fetch.add_argument("assets", nargs="*", help="asset names (default: the quickstart's; 'all' for every asset)")
    return {"list": p_list, "fetch": p_fetch}


def _report_parser(sub: Any) -> argparse.ArgumentParser:
    """``kvbench report``."""
    p_report = sub.add_parser("report", help="table of runs (finished, running or unfinished), pivots and figures")
    p_report.add_argument("paths", nargs="*", help="run directories or folders of runs (default results/runs)")
    p_report.add_argument("--format", choices=["md", "csv", "latex"], default="md")
    p_report.add_argument("--diff", nargs=2, metavar=("RUN_A", "RUN_B"), help="config/protocol differences of two runs")
    p_report.add_argument(
        "--pivot",
        nargs=2,
        metavar=("ROWS", "COLS"),
        help="one metric as a grid: comma-separated columns down and across, e.g. method question; "
        "the column dataset splits runs into their subsets (dataset method: a task-by-method table)",
    )
    p_report.add_argument("--value", default="score", help="the metric a pivot shows (default score; e.g. recall)")
    p_report.add_argument(
        "--paired",
        metavar="COL=VALUE",
        help="every run against the baseline run this selects (e.g. method=full) among the runs of its model "
        "and task settings, on the samples both have (unfinished runs too): mean difference, paired 95%% "
        "interval and test, and agreement of the answers (exact, ROUGE-L F1, Jaccard)",
    )
    p_report.add_argument(
        "--figure",
        metavar="FILE.png",
        help="the matching runs in their task's comparison figure (NIAH heatmaps, PG19 curves, "
        "rag: CacheBlend's figures)",
    )
    p_report.add_argument(
        "--figure-kind",
        metavar="KIND",
        help="which figure, for tasks with several (rag: quality_ttft (default), ratio, deviation, selection)",
    )
    p_report.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="COL=VALUE",
        help="keep only runs whose column has this value (repeatable), e.g. task=niah; "
        "unknown columns are refused with the valid ones",
    )
    p_report.add_argument(
        "--html",
        metavar="DIR",
        help="a self-contained web report in DIR: one page per paper "
        "artifact (kvbench reproduce's tables and figures, embedded)",
    )
    p_report.add_argument(
        "--scale",
        default="cpu",
        choices=["smoke", "cpu", "paper"],
        help="--html: which scale's runs the pages show (default cpu)",
    )
    return p_report


def _reproduce_parser(sub: Any) -> argparse.ArgumentParser:
    """``kvbench reproduce``."""
    p_repro = sub.add_parser(
        "reproduce",
        help="run a paper artifact's sweep (what is missing) and render it beside the "
        "published numbers; --list shows the artifacts",
    )
    p_repro.add_argument("name", nargs="?", help="<paper>/<artifact>, e.g. pqcache/table3")
    p_repro.add_argument(
        "overrides",
        nargs="*",
        help="scale=smoke|cpu|paper (default cpu), then Hydra overrides "
        "(hydra/launcher=joblib runs the sweep in parallel)",
    )
    p_repro.add_argument("--list", action="store_true", help="list the artifacts with a one-line description")
    p_repro.add_argument(
        "--dry-run", action="store_true", help="validate every point and show its run directory and state"
    )
    p_repro.add_argument("--no-run", action="store_true", help="render from the runs that exist; run nothing")
    p_repro.add_argument("--out", default=None, help="where the report goes (default results/reproduce/<scale>/<name>)")
    p_repro.add_argument("--wait", action="store_true", help="wait for another process writing a run directory")
    return p_repro


def _check_parser(sub: Any) -> argparse.ArgumentParser:
    """``kvbench check``."""
    p_check = sub.add_parser("check", help="re-run golden configs and compare their scores (regression guard)")
    p_check.add_argument("names", nargs="*", help="check names (default: all)")
    p_check.add_argument("--golden", default=None, help="golden file (default: results/golden/checks.yaml)")
    p_check.add_argument(
        "--output-dir",
        default=None,
        help="where the check runs go (default: a temporary folder, removed when every check passes)",
    )
    p_check.add_argument(
        "--update",
        action="store_true",
        help="re-run the checks and rewrite their expected values, printing what changed",
    )
    p_check.add_argument(
        "--add-cpu",
        action="store_true",
        help="record the values this CPU reproduces beside the expected ones (for selections that "
        "break float ties differently across CPUs); the expected values stay",
    )
    return p_check


def _bench_parser(sub: Any) -> argparse.ArgumentParser:
    """``kvbench bench``."""
    p_bench = sub.add_parser("bench", help="performance micro-benchmarks (ratios measured side by side)")
    p_bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    p_bench.add_argument("--json", action="store_true", help="machine-readable output")
    p_bench.add_argument("--save", metavar="FILE.json", help="also write the machine-readable record to FILE.json")
    p_bench.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p_bench.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p_bench.add_argument("--repeats", type=int, default=5)
    p_bench.add_argument("--model", default=None, help="end-to-end benchmarks: model config (e.g. llama31_8b_shape)")
    p_bench.add_argument(
        "--lengths", default=None, help="end-to-end benchmarks: prompt lengths, e.g. 32768,65536,131072"
    )
    p_bench.add_argument("--new-tokens", type=int, default=None, help="end-to-end benchmarks: tokens generated per run")
    p_bench.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="end-to-end benchmarks: a parameter of the compared method (repeatable), e.g. kmeans_device=model",
    )
    p_bench.add_argument(
        "--rounds", type=int, default=None, help="end-to-end benchmarks: timed rounds, best kept (default 2; --quick 1)"
    )
    p_bench.add_argument("--methods", default=None, help="per-method benchmarks: the methods, e.g. full,quest")
    p_bench.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="end-to-end benchmarks: an engine setting (repeatable), e.g. decode=dynamic",
    )
    return p_bench
