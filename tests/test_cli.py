"""Bad input: one clear error line naming the fix, a non-zero exit, nothing written.

The cases run the CLI in this process (``kvbench_in_process``: the same exit status and output as a child,
without a child's start-up); ``kvbench list`` runs as a real ``python -m kvbench`` process."""

import subprocess
import sys

import pytest

from .conftest import kvbench_in_process as kvbench

KVBENCH = [sys.executable, "-m", "kvbench"]


def test_list_names_everything():
    out = subprocess.run([*KVBENCH, "list"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for name in ("smollm2_135m", "tiny_llama", "llama31_8b_shape", "full", "oracle", "streamingllm", "niah"):
        assert name in out.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["method=nope"], "unknown method 'nope'"),
        (["model=gpt5"], "unknown model 'gpt5'"),
        (["task=bogus"], "unknown task 'bogus'"),
        (["-m", "method=full,nope"], "unknown method 'nope'"),
        (["budget.token_ratio=-0.5", "method=oracle"], "budget.token_ratio=-0.5"),
        (["budget.tokens=-3", "method=oracle"], "budget.tokens=-3"),
        (["method=oracle"], "needs a budget"),
        (["budget.ratio=0.1"], "invalid override"),
        (["task.depths=[2]"], "task.depths"),
        (["method=oracle", "budget.tokens=5000", "task.lengths=[600]"], "larger than the context"),
        (["model.max_length=500", "task.lengths=[600]"], "exceeds model tiny_llama's maximum"),
    ],
)
def test_bad_input_is_one_line_with_a_fix(tmp_path, args, needle):
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "e.txt").write_text("A sentence about startups. " * 400)
    out_dir = tmp_path / "runs"
    base = ["model=tiny_llama", f"output_dir={out_dir}", "progress=false", f"task.data_dir={essays}"]
    base += ["task.lengths=[600]", "task.depths=[0]"]
    given = {arg.split("=", 1)[0] for arg in args}
    result = kvbench("run", *[arg for arg in base if arg.split("=", 1)[0] not in given], *args)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvbench: error: ") and needle in lines[0] and "fix:" in lines[0]
    assert "Traceback" not in result.stderr
    assert not out_dir.exists() or not any(out_dir.iterdir()), "a failed run left files behind"


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = kvbench("run", "model=tiny_llama", f"output_dir={blocker}/runs")
    assert result.returncode == 2 and "output_dir" in result.stderr and "Traceback" not in result.stderr


def test_hf_model_needs_a_path():
    result = kvbench("run", "model=hf", "progress=false")
    assert result.returncode == 2 and "model.path" in result.stderr
