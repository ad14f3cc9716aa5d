"""Bad input for the reuse family and the rag task (issue 12): one clear line, a non-zero exit, nothing
written, and no model loaded."""

import pytest

from kvbench import cli
from kvbench.compose import compose
from kvbench.config import RunConfig
from kvbench.errors import ConfigError
from kvbench.runner import run
from kvbench.tasks import REGISTRY
from kvbench.validate import check_reuse_task

from .conftest import SHARED_DATA

CB = SHARED_DATA / "cacheblend"


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every mistake here must be caught before."""
    import kvbench.models.loading

    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the bad input was reported")

    monkeypatch.setattr(kvbench.models.loading, "load_model", refuse)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["method=cacheblend", "task=rag", "task.dataset=nq", f"task.data_dir={CB}"], "unknown task.dataset 'nq'"),
        (["method=cacheblend", "task=rag", "task.dataset=musique"], "needs task.data_dir"),
        (["method=cacheblend", "task=rag", "task.dataset=musique", "task.data_dir=/no/such/folder"], "is not a folder"),
        (
            [
                "method=cacheblend",
                "task=rag",
                "task.dataset=musique",
                f"task.data_dir={CB}",
                "method.recompute_ratio=1.5",
            ],
            "method.recompute_ratio=1.5 is out of range",
        ),
        (
            [
                "method=cacheblend",
                "task=rag",
                "task.dataset=musique",
                f"task.data_dir={CB}",
                "method.recompute_ratio=-0.1",
            ],
            "method.recompute_ratio=-0.1 is out of range",
        ),
        (["method=cacheblend", "task=niah"], "task niah's prompts are not split into chunks"),
        (["method=prefix_cache", "task=longbench"], "task longbench's prompts are not split into chunks"),
        (
            ["-m", "method=full,full_reuse", "task=pg19", "task.source=shakespeare"],
            "(sweep point 2/2: method=full_reuse)",
        ),
    ],
)
def test_bad_reuse_input_is_one_line_before_any_model(overrides, needle, tmp_path, capsys, no_model):
    out = tmp_path / "runs"
    assert cli.main(["run", "model=smollm2_135m", f"output_dir={out}", *overrides]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "fix:" in lines[0], lines
    assert not out.exists()


def test_the_fix_names_the_chunked_tasks(tmp_path, no_model):
    chunked = sorted(name for name in REGISTRY.names() if REGISTRY.get(name).chunked)
    assert chunked == ["rag", "rag_stream", "ruler"]  # RULER's haystack is one chunk between its prefix and query
    config = compose(["method=full_reuse", "task=niah", "model=tiny_llama", f"output_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match="not split into chunks") as error:
        run(config)  # the Python API validates too
    assert "task=rag or task=rag_stream or task=ruler" in error.value.fix and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "method, task", [("cacheblend", "rag"), ("full_reuse", "ruler"), ("full", "niah"), ("snapkv", "longbench")]
)
def test_chunked_tasks_and_other_methods_pass(method, task):
    data = [f"task.data_dir={CB}"] if task == "rag" else []
    check_reuse_task(RunConfig.parse(compose([f"method={method}", f"task={task}", "model=tiny_llama", *data])))
