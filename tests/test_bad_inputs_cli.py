"""Bad input and command lines: every case is one ``kvbench: error:`` line with the fix, exit status 2, no
traceback and nothing written, decided before any model loads (the CLI runs in-process, as in
``tests/test_cli_reliability.py``; no model is loaded here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench import cli

from .test_cli_reliability import base_args

MUSIQUE_ROW = {"question": "who?", "answers": ["a"], "ctxs": [{"title": "t", "text": "some text"}]}


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model or a hub data set is loaded."""

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded before validation finished")

    monkeypatch.setattr("kvbench.models.loading.load_model", forbidden)
    monkeypatch.setattr("kvbench.tasks.sources.hub_rows", forbidden)


def data(tmp_path: Path) -> dict[str, str]:
    """Data folders, good and bad, named by the placeholders the cases use."""
    made = {}
    for name, files in {
        "RAG_DICT": {"musique_s.json": json.dumps({"data": [MUSIQUE_ROW]})},
        "RAG_CUT": {"musique_s.json": "[" + json.dumps(MUSIQUE_ROW) + ",\n" + json.dumps(MUSIQUE_ROW)[:30]},
        "RAG_EMPTY": {"musique_s.json": ""},
        "RAG_ROW": {"musique_s.json": json.dumps([MUSIQUE_ROW, {"question": "q", "ctxs": []}], indent=1)},
        "RAG_OK": {"musique_s.json": json.dumps([MUSIQUE_ROW])},
        "RAG_EXAMPLE": {"example_inputs/1.json": json.dumps({"query": "q", "chunk_num": 2, "0": "a"})},
        "LB_FIELD": {"multi_news.jsonl": json.dumps({"input": "", "answers": ["a"], "_id": "x"}) + "\n"},
        "LB_EMPTY": {"multi_news.jsonl": "\n"},
    }.items():
        folder = tmp_path / name.lower()
        for file, text in files.items():
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(text)
        made[name] = str(folder)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "a.txt").write_text("An essay. " * 100)
    (garbage / "b.txt").write_bytes(bytes(range(256)) * 8)
    made["GARBAGE"] = str(garbage)
    return made


def run_args(tmp_path: Path, essays: Path, extra: list[str]) -> list[str]:
    """tests/test_cli_reliability.py's small NIAH run on tiny_llama (``extra`` replaces the base keys it
    names), with ``extra``'s options first."""
    options = [a for a in extra if a.startswith("-")]
    return options + base_args(tmp_path, essays, [a for a in extra if a not in options])


RAG = ["task=rag", "method=cacheblend"]
CACHEBLEND_OK = [*RAG, "task.data_dir=RAG_OK"]

#: ``kvbench run`` cases: (overrides, what the one error line says)
RUN_CASES = {
    # a budget's parts against each other and against the prompt
    "sink beyond the model": (
        ["method=oracle", "budget.tokens=100", "budget.sink=100000"],
        "budget.sink=100000 is not smaller than model tiny_llama's 16384-token context",
    ),
    "sink beyond the prompt": (
        ["method=oracle", "budget.tokens=100", "budget.sink=600"],
        "budget.sink=600 is not smaller than the shortest prompt",
    ),
    "sink plus tokens cover the prompt": (
        ["method=oracle", "budget.tokens=100", "budget.sink=550"],
        "covers the whole 600-token prompt",
    ),
    "local beyond tokens": (
        ["method=streamingllm", "budget.tokens=100", "budget.local=200"],
        "budget.local=200 is larger than budget.tokens=100",
    ),
    "local beyond the ratio's budget": (
        ["method=oracle", "budget.token_ratio=0.1", "budget.local=300"],
        "budget.local=300 exceeds the resolved budget",
    ),
    "tokens and ratio together": (
        ["method=oracle", "budget.tokens=100", "budget.token_ratio=0.1"],
        "budget.tokens=100 and budget.token_ratio=0.1 both set the budget",
    ),
    # method values that cannot be right
    "no k-means iterations": (
        ["method=pqcache", "budget.token_ratio=0.1", "method.kmeans_iters=0"],
        "method.kmeans_iters=0 is out of range",
    ),
    "a million workers": (
        ["method=pqcache", "budget.token_ratio=0.1", "method.workers=1000000"],
        "method.workers=1000000 is out of range",
    ),
    "dense layer outside the model": (
        ["method=quest", "budget.token_ratio=0.1", "method.dense_layers=[99]"],
        "model tiny_llama has 4 layers (0-3), so there is no layer 99",
    ),
    "every layer dense": (
        ["method=clusterkv", "budget.token_ratio=0.1", "method.dense_layers=[0,1,2,3]"],
        "makes every layer of model tiny_llama dense",
    ),
    "PQ split not dividing the head": (
        ["method=pqcache", "budget.token_ratio=0.1", "method.m=5", "method.b=4"],
        "method.m=5 does not divide model tiny_llama's head dimension 32",
    ),
    "check layer outside the model": ([*CACHEBLEND_OK, "method.check_layer=9"], "model tiny_llama has 4 (0-3)"),
    # task values
    "no new tokens": (["task.max_new_tokens=0"], "task.max_new_tokens=0 is 0, below 1"),
    "more new tokens than the model holds": (["task.max_new_tokens=100000"], "leaves no room for a prompt"),
    # the command line itself
    "an added top-level key": (["+foo=bar"], "unknown setting foo"),
    "an added model key": (["+model.revison=main"], "has no setting model.revison"),
    "a method given twice": (["method=oracle", "method=full"], "method is given twice (method=oracle and method=full)"),
    "an unknown run option": (["--verbose"], "unknown option --verbose"),
    # data files, named by file and line, with the shape expected
    "rag file of the wrong shape": ([*RAG, "task.data_dir=RAG_DICT"], "musique_s.json:1: a JSON object, not a list"),
    "rag file of the wrong shape, dry run": (
        ["--dry-run", *RAG, "task.data_dir=RAG_DICT"],
        "musique_s.json:1: a JSON object, not a list (expected a JSON list of",
    ),
    "truncated rag file": ([*RAG, "task.data_dir=RAG_CUT"], "musique_s.json:2: not valid JSON"),
    "empty rag file": (["--dry-run", *RAG, "task.data_dir=RAG_EMPTY"], "musique_s.json is empty (expected"),
    "rag row without answers": ([*RAG, "task.data_dir=RAG_ROW"], "musique_s.json:14: the row has no 'answers'"),
    "rag example without its chunks": (
        [*RAG, "task.dataset=example", "task.data_dir=RAG_EXAMPLE"],
        "1.json: chunk '1' is missing",
    ),
    "longbench row without a field": (
        ["task=longbench", "task.data_dir=LB_FIELD"],
        "multi_news.jsonl:1: the row has no 'context'",
    ),
    "empty longbench file": (["task=longbench", "task.data_dir=LB_EMPTY"], "multi_news.jsonl holds no rows"),
    "binary essay": (["task.data_dir=GARBAGE"], "b.txt:1: a NUL byte: a binary file, not text"),
    "missing staged data": (
        [*RAG, "task.data_dir=../shared/nowhere/data/cacheblend"],
        "task.data_dir=../shared/nowhere/data/cacheblend (from",
    ),
}


@pytest.mark.parametrize("name", RUN_CASES)
def test_bad_run_is_one_line_before_anything_loads(name, tmp_path, essays, no_loading, capsys, monkeypatch):
    monkeypatch.delenv("KVBENCH_DATA", raising=False)
    extra, needle = RUN_CASES[name]
    places = data(tmp_path)
    extra = [next((a.replace(k, v) for k, v in places.items() if a.endswith("=" + k)), a) for a in extra]
    code = cli.main(["run", *run_args(tmp_path, essays, extra)])
    assert_one_line(code, capsys.readouterr().err, needle)
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "a refused run left files behind"


def assert_one_line(code: int, err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("kvbench: error: ") and needle in lines[0] and "(fix: " in lines[0], lines[0]


def test_missing_staged_data_names_the_variable(tmp_path, essays, no_loading, capsys, monkeypatch):
    monkeypatch.delenv("KVBENCH_DATA", raising=False)
    code = cli.main(["run", *run_args(tmp_path, essays, [*RAG, "task.data_dir=../shared/data/nowhere"])])
    err = capsys.readouterr().err
    assert_one_line(code, err, "task.data_dir=../shared/data/nowhere")
    assert "set KVBENCH_DATA=" in err and "KVBENCH_DATA is unset" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("dry", [False, True])
def test_cuda_on_a_cpu_machine(dry, tmp_path, essays, no_loading, capsys):
    options = ["--dry-run"] if dry else []
    code = cli.main(["run", *options, *run_args(tmp_path, essays, ["model.device=cuda"])])
    assert_one_line(code, capsys.readouterr().err, "model.device=cuda, but this machine has no CUDA device")
    assert not (tmp_path / "runs").exists()


#: other sub-commands: (arguments, what the one error line says); FOLDER is a fresh folder
COMMAND_CASES = {
    "reproduce: options after the name, a bad scale after them": (
        ["reproduce", "pqcache/table3", "--no-run", "scale=nope"],
        "unknown scale 'nope'",
    ),
    "reproduce: a method given twice": (
        ["reproduce", "pqcache/table3", "method=full", "--dry-run", "method=oracle"],
        "method is given twice",
    ),
    "bench: an unknown model": (["bench", "pqcache_e2e", "--model", "nosuch"], "unknown model 'nosuch' (--model)"),
    "bench: negative repeats": (["bench", "--repeats", "-1", "pqcache_e2e"], "--repeats -1 runs nothing"),
    "bench: an unknown method": (["bench", "decode_host", "--methods", "full,nope"], "unknown method 'nope'"),
    "bench: a device that is none": (["bench", "decode_host", "--device", "gpu"], "unknown model.device 'gpu'"),
    "report: a figure that is not a PNG": (["report", "FOLDER", "--figure", "FOLDER/x.txt"], "must end in .png"),
    "report: a figure in a missing folder that cannot be made": (
        ["report", "--figure", "/proc/kvbench-none/x.png", "FOLDER"],
        "cannot write in /proc",
    ),
    "report: a figure in a folder that cannot be written": (
        ["report", "FOLDER", "--figure", "/proc/kvbench-figure.png"],
        "cannot write in /proc",
    ),
    "list: an unknown group": (["list", "widgets"], "kvbench list: argument what: invalid choice: 'widgets'"),
    "report: an unknown option": (["report", "--colour", "red"], "kvbench report: unrecognized arguments: --colour"),
}


@pytest.mark.parametrize("name", COMMAND_CASES)
def test_bad_command_is_one_line(name, tmp_path, no_loading, capsys):
    if "/proc" in name and not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    args, needle = COMMAND_CASES[name]
    args, needle = [a.replace("FOLDER", str(tmp_path)) for a in args], needle.replace("FOLDER", str(tmp_path))
    before = sorted(tmp_path.rglob("*"))
    started = time.perf_counter()
    code = cli.main(args)
    assert_one_line(code, capsys.readouterr().err, needle)
    assert sorted(tmp_path.rglob("*")) == before, "a refused command wrote files"
    assert time.perf_counter() - started < 5


def test_a_plain_key_given_twice_keeps_the_last_with_a_note(tmp_path, essays, no_loading, capsys):
    args = run_args(tmp_path, essays, ["--dry-run"]) + ["task.max_new_tokens=6"]
    assert cli.main(["run", *args]) == 0
    captured = capsys.readouterr()
    assert "max_new_tokens: 6" in captured.out
    assert captured.err == (
        "kvbench: note: task.max_new_tokens is given twice (task.max_new_tokens=4, then task.max_new_tokens=6): "
        "the last counts\n"
    )


def test_reproduce_takes_options_after_the_overrides(monkeypatch, capsys):
    """``kvbench reproduce NAME --no-run scale=cpu``: options and overrides in any order."""
    seen = {}

    def fake(ref, scale, extra, **kwargs):
        seen.update(ref=ref, scale=scale, extra=list(extra), **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("kvbench.reproduce.reproduce", fake)
    with pytest.raises(SystemExit):
        cli.main(["reproduce", "pqcache/table3", "--no-run", "scale=smoke", "--wait", "task.limit=1"])
    assert seen["scale"] == "smoke" and seen["extra"] == ["task.limit=1"] and seen["run"] is False and seen["wait"]


def test_list_is_fast_and_shows_any_groups_parameters():
    """``kvbench list`` imports no method module (no torch): well under 2 s in a fresh process; ``list
    tasks`` shows each task's keys like ``list methods`` does; both draw names from ``run --help``'s
    registry (``pqcache_niah`` too)."""
    script = "import sys; from kvbench.cli import main; main(sys.argv[1:]); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script, "list"], capture_output=True, text=True, timeout=60, env=env)
    seconds = time.perf_counter() - started
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "False", out.stderr
    assert seconds < 2, f"kvbench list took {seconds:.1f} s"
    listed = {line.split(":")[0]: line.split(": ", 1)[1].split(", ") for line in out.stdout.splitlines()[:-1]}
    helped = {line.split("=")[0].strip(): line.split("=", 1)[1].strip().split(", ") for line in _help_groups()}
    assert listed["methods"] == helped["method"] and "pqcache_niah" in listed["methods"]
    assert listed["tasks"] == helped["task"] and listed["models"] == helped["model"]


def _help_groups() -> list[str]:
    text = cli.run_usage()
    block = text.split("config groups", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return [line for line in block if "=" in line]


def test_list_tasks_shows_parameters(capsys):
    assert cli.main(["list", "tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("niah") for line in lines)
    row = next(line.split() for line in lines if line.split()[:1] == ["max_new_tokens"])
    assert row[1:3] == ["int", "256"]  # gsm8k_cot's, the first task listed
    assert any("whole-prompt lengths in tokens" in line for line in lines)  # the YAML comment is the help
    assert cli.main(["list", "budget"]) == 0 and "token_ratio" in capsys.readouterr().out
    assert cli.main(["list", "methods"]) == 0 and "pqcache_niah (preset: method=pqcache" in capsys.readouterr().out
