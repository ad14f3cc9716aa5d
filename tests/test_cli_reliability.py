"""``kvbench run`` refuses bad configs before loading anything, explains itself, and stops cleanly."""

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench import cli
from kvbench.sweep import resolve_points

from .conftest import kvbench_in_process

KVBENCH = [sys.executable, "-m", "kvbench"]


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model or a hub data set is loaded."""

    def forbidden(*args, **kwargs):
        raise AssertionError("loaded before validation finished")

    monkeypatch.setattr("kvbench.models.loading.load_model", forbidden)
    monkeypatch.setattr("kvbench.tasks.sources.hub_rows", forbidden)


def base_args(tmp_path, essays, extra=()):
    """A small NIAH run on tiny_llama; ``extra`` overrides replace the base keys they name."""
    base = [
        "model=tiny_llama",
        f"output_dir={tmp_path / 'runs'}",
        "progress=false",
        f"task.data_dir={essays}",
        "task.lengths=[600]",
        "task.depths=[0]",
        "task.max_new_tokens=4",
    ]
    keys = {a.partition("=")[0] for a in extra}
    if "task" in keys:  # another task: none of NIAH's keys
        base = [a for a in base if not a.startswith("task.")]
    return [a for a in base if a.partition("=")[0] not in keys] + list(extra)


def bad_jsonl(tmp_path):
    folder = tmp_path / "longbench"
    folder.mkdir()
    row = {"input": "q", "context": "c", "answers": ["a"], "length": 3, "_id": "x"}
    (folder / "multi_news.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n" + '{"input": "q", \n')
    return folder


CASES = {
    "ratio not a number": (
        ["method=oracle", "budget.token_ratio=abc"],
        "budget.token_ratio=abc is not a number or null (budget)",
    ),
    "negative tokens": (["method=oracle", "budget.tokens=-3"], "budget.tokens=-3"),
    "fractional sink": (
        ["method=oracle", "budget.token_ratio=0.1", "budget.sink=1.5"],
        "budget.sink=1.5 is not an integer or null (budget)",
    ),
    "lengths not a list": (["task.lengths=abc"], "task.lengths='abc' is not a list"),
    "negative generation": (["task.max_new_tokens=-4"], "task.max_new_tokens=-4 is negative"),
    "limit not a number": (["task.limit=ten"], "task.limit='ten' is not a whole number"),
    "longer than the model": (["model.max_length=500"], "exceeds model tiny_llama's maximum of 500"),
    "budget beyond the context": (["method=oracle", "budget.tokens=5000"], "larger than the context"),
    "missing model folder": (
        ["model=hf", "model.path=/nonexistent/models/llama"],
        "model.path=/nonexistent/models/llama is not a folder",
    ),
    "no model path": (["model=hf"], "model=hf needs a path"),
    "unknown dtype": (["model.dtype=fp8"], "unknown model.dtype 'fp8'"),
    "unknown device": (["model.device=gpu0"], "unknown model.device 'gpu0'"),
    "bad second sweep point": (
        ["-m", "method=full,oracle", "budget.token_ratio=0.1,abc"],
        "(sweep point 2/4: method=full budget.token_ratio=abc)",
    ),
    "sweep without -m": (["method=full,oracle"], "method=full,oracle is a sweep"),
    "output under a file": (["output_dir=FILE/runs"], "FILE is not a folder"),
    "output in /proc": (["output_dir=/proc/kvbench-runs"], "cannot write results under /proc/kvbench-runs"),
    "non-ASCII path": (["output_dir=/tmp/résumé"], "'output_dir=\"/tmp/résumé\"'"),
    "malformed data line": (["task=longbench", "task.data_dir=LONGBENCH"], "multi_news.jsonl:3: not a valid JSON line"),
    "unknown option": (["--verbose"], "unknown option --verbose"),
    "hub unreachable": (["task=longbench"], "THUDM/LongBench needs the Hugging Face hub, which is unreachable"),
    "pg19 without books": (["task=pg19", "task.source=data_dir"], "task pg19 needs books"),
    "pg19 book not there": (["task=pg19", "task.data_dir=FOLDER", "task.book=moby"], "no book moby in FOLDER"),
    "gsm8k pqcache prompt": (["task=gsm8k_cot", "task.protocol=pqcache"], "needs PQCache's prompt file"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_config_fails_fast_before_loading(name, tmp_path, essays, no_loading, capsys, monkeypatch):
    if name == "output in /proc" and not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: a hub that does not answer
    extra, needle = CASES[name]
    (tmp_path / "file").write_text("a file, not a folder")
    places = {
        "LONGBENCH": str(bad_jsonl(tmp_path)) if "LONGBENCH" in str(extra) else "",
        "FILE": str(tmp_path / "file"),
        "FOLDER": str(tmp_path),
    }
    for key, value in places.items():
        extra, needle = [a.replace(key, value) for a in extra], needle.replace(key, value)
    from kvbench.methods import available_methods

    available_methods()  # the method checks import every method (torch, transformers): a one-off cost, not timed

    started = time.perf_counter()
    code = cli.main(["run", *base_args(tmp_path, essays, extra)])
    seconds = time.perf_counter() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvbench: error: ") and needle in lines[0] and "(fix: " in lines[0], lines[0]
    assert seconds < 3, f"validation took {seconds:.1f} s"
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "a refused run left files behind"


def test_validation_needs_no_torch(tmp_path, essays):
    """In a fresh interpreter the config-only checks answer without importing torch (about 2 s alone)."""
    script = (
        "import sys; from kvbench.cli import main; code = main(sys.argv[1:]); "
        "print('torch' in sys.modules, 'transformers' in sys.modules); sys.exit(code)"
    )
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", script, "run", *base_args(tmp_path, essays, ["budget.token_ratio=abc"])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "budget.token_ratio=abc" in out.stderr
    assert out.stdout.split() == ["False", "False"], "validation imported torch or transformers"
    print(f"fresh-process validation error after {time.perf_counter() - started:.2f} s")


def test_run_help_prints_usage():
    out = subprocess.run(KVBENCH + ["run", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    for needle in (
        "usage: kvbench run",
        "--dry-run",
        "--wait",
        "method=",
        "streamingllm",
        "task=",
        "niah",
        "budget.token_ratio",
        "examples:",
        "kvbench run -m method=full,oracle",
    ):
        assert needle in out.stdout, needle


def test_dry_run_prints_the_run_directory_and_config_and_runs_nothing(tmp_path, essays, no_loading, capsys):
    args = base_args(tmp_path, essays)
    assert cli.main(["run", "--dry-run", "-m", *args, "method=full,streamingllm", "budget.token_ratio=0.1"]) == 0
    out = capsys.readouterr().out
    dirs = [line.split(": ", 1)[1].split(" [")[0] for line in out.splitlines() if line.startswith("# run directory:")]
    assert len(dirs) == 2 and all(Path(d).parent == tmp_path / "runs" for d in dirs)
    assert "niah-full-tiny_llama-" in dirs[0] and "[new] (1 samples)" in out
    assert "token_ratio: 0.1" in out and "token_ratio: null" in out  # full ignores the budget (and hashes none)
    assert not (tmp_path / "runs").exists()
    assert cli.main(["run", "--cfg", "job", *args]) == 0 and "# run directory:" in capsys.readouterr().out


def test_quoted_non_ascii_output_dir_is_accepted(tmp_path, essays, no_loading, capsys):
    target = tmp_path / "résumé"
    args = [a for a in base_args(tmp_path, essays) if not a.startswith("output_dir=")]
    assert cli.main(["run", "--dry-run", f'output_dir="{target}"', *args]) == 0
    assert str(target) in capsys.readouterr().out


def test_ctrl_c_saves_samples_and_prints_the_resume_command(tmp_path, essays):
    args = [
        "run",
        "model=tiny_llama",
        f"output_dir={tmp_path / 'runs'}",
        f"task.data_dir={essays}",
        "task.lengths=[600,700,800]",
        "task.depths=[0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9]",
        "task.max_new_tokens=16",
    ]
    total = 30  # enough work (seconds) that the interrupt lands mid-run even on a busy 2-core machine
    # SIGINT back to its default in the child: a shell's background job (nohup ... &) starts with SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler, so the run would ignore Ctrl-C.
    proc = subprocess.Popen(
        KVBENCH + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 180
    while time.time() < deadline:
        found = list((tmp_path / "runs").glob("*/samples.jsonl"))
        if found and found[0].read_text().count("\n") >= 1:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    samples = found[0]
    saved = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert last.startswith(
        f"kvbench: interrupted: {len(saved)} of {total} samples saved in {samples.parent}; resume with: kvbench run "
    )
    assert 1 <= len(saved) < total
    assert json.loads((samples.parent / "status.json").read_text())["state"] == "interrupted"
    # the report and the resume in this process (the interrupted run was a real process)
    report = kvbench_in_process("report", str(tmp_path / "runs"))
    assert f"unfinished {len(saved)}/{total}" in report.stdout
    resume = shlex.split(last.split("resume with: ", 1)[1])
    assert resume[:2] == ["kvbench", "run"] and resume[2:] == args[1:]
    done = kvbench_in_process(*resume[1:])
    assert done.returncode == 0, done.stderr
    final = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert final[: len(saved)] == saved and len(final) == len(set(final)) == total
    assert f"({total - len(saved)} new samples" in done.stdout


def test_plain_progress_when_not_a_terminal(tmp_path):
    import io

    from kvbench.progress import Progress
    from kvbench.results import RunDir

    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    stream = io.StringIO()
    progress = Progress(run_dir, total=3, stream=stream, interval=0.0)
    for sample_id, score in (("a", 100.0), ("b", 0.0), ("c", 50.0)):
        progress.sample(sample_id, score, 0.1)
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text and text.count("\n") == 3
    assert text.splitlines()[1].endswith("2/3 samples, mean score 50.0, 0 s")  # the mean, not the last score
    log = (run_dir.path / "run.log").read_text().splitlines()
    assert len(log) == 3 and "sample c: score 50.00" in log[2] and "mean score 50.00" in log[2]


def test_check_names_the_real_checks(tmp_path, capsys):
    golden = tmp_path / "checks.yaml"
    golden.write_text("- {name: niah_full, overrides: [model=tiny_llama], expect: {score: 0}}\n")
    assert cli.main(["check", "--golden", str(golden), "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown check(s) nope" in err and "choose from: niah_full" in err


def test_offline_hub_fails_at_once(monkeypatch):
    from kvbench.errors import ConfigError
    from kvbench.tasks.sources import hub_rows

    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: pytest.fail("went to the hub"))
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="unreachable") as err:
        next(hub_rows("THUDM/LongBench", "multi_news", "test", "LongBench's data.zip"))
    assert time.perf_counter() - started < 5
    assert "task.data_dir" in err.value.fix and "HF_HUB_OFFLINE=1" in err.value.fix


def test_every_dtype_and_device_name_validation_accepts_loads():
    """The torch-free names validation accepts are what the loader resolves: each dtype name to its
    torch dtype (auto: fp32 on CPU), cpu and auto to a device; a CUDA device on a machine without one is
    the loader's clear error (it needs torch to know)."""
    import torch

    from kvbench.errors import ConfigError
    from kvbench.models import DTYPE_NAMES
    from kvbench.models.loading import pick_device, pick_dtype

    cpu = torch.device("cpu")
    assert {name: pick_dtype(name, cpu) for name in DTYPE_NAMES} == {
        name: {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[target]
        for name, target in DTYPE_NAMES.items()
    }
    assert pick_dtype("auto", cpu) == torch.float32 and pick_device("cpu") == cpu
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            pick_device("cuda:1")
    with pytest.raises(ConfigError, match="unknown model.device 'gpu0'"):
        pick_device("gpu0")  # the loader refuses with validation's own line
    with pytest.raises(ConfigError, match="unknown model.dtype 'fp8'"):
        pick_dtype("fp8", cpu)


def test_hub_is_asked_only_for_runs_with_samples_left(tmp_path, monkeypatch, no_loading, capsys):
    """A hub that does not answer fails `kvbench run` in one line before anything loads, yet a dry run
    still plans and a finished run (its samples on disk) does not ask the hub."""
    from kvbench.errors import ConfigError
    from kvbench.runner import check_sources, plan

    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    args = ["task=longbench", "model=tiny_llama", "progress=false", f"output_dir={tmp_path / 'runs'}"]
    assert cli.main(["run", "--dry-run", *args]) == 0
    _, configs = resolve_points(args, False)
    with pytest.raises(ConfigError, match="THUDM/LongBench needs the Hugging Face hub"):
        check_sources(configs)
    run_dir = plan(configs[0]).run_dir
    run_dir.path.mkdir(parents=True)
    run_dir.set_status("finished")
    check_sources(configs)  # nothing left to read
    _, sweep = resolve_points([*args, "task.limit=1,2"], True)
    assert plan(sweep[0]).run_dir != run_dir
    plan(sweep[0]).run_dir.path.mkdir(parents=True)
    plan(sweep[0]).run_dir.set_status("finished")
    with pytest.raises(ConfigError, match="unreachable"):  # a finished run does not vouch for the next
        check_sources(sweep)
    capsys.readouterr()


def test_a_note_prints_once_per_process(capsys):
    from kvbench.errors import note

    note("ruler: skipping qa_1")
    note("ruler: skipping qa_1")
    note("ruler: skipping qa_2")
    assert capsys.readouterr().err.splitlines() == [
        "kvbench: note: ruler: skipping qa_1",
        "kvbench: note: ruler: skipping qa_2",
    ]


def test_no_weight_loading_bar_in_a_log(capsys):
    """Redirected to a file, transformers' "Loading weights" bar is off while a model loads, and on again
    after (kvbench.progress's rule for the sample loop)."""
    from transformers.utils import logging as hf_logging

    from kvbench.models.loading import quiet_loading_bar

    assert hf_logging.is_progress_bar_enabled()
    with quiet_loading_bar():  # capsys: stderr is not a terminal
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()


def test_a_second_checkout_does_not_mix_with_the_installed_one(tmp_path):
    """Started where another copy of kvbench/ is found first (a second checkout beside an editable
    install), kvbench refuses to run half of each copy."""
    import shutil

    import kvbench

    if not (Path(kvbench.__file__).resolve().parents[1] / "tasks").is_dir():
        pytest.skip("kvbench is not an editable install of a checkout here")
    if (Path(kvbench.__file__).parent / "tasks").exists():  # (benchmarks/gpu.sh links the subpackages there)
        pytest.skip("kvbench/ holds its subpackages itself here: a copy of it carries them along, nothing mixes")
    shutil.copytree(Path(kvbench.__file__).resolve().parent, tmp_path / "kvbench")
    out = subprocess.run([*KVBENCH, "list", "models"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "an editable install of another checkout" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1
    ok = subprocess.run([*KVBENCH, "list", "models"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "smollm2_135m" in ok.stdout, ok.stderr
