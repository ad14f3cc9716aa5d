"""The analysis notebooks run, cell by cell, over real (tiny-model) runs."""

import json
from pathlib import Path

import pytest

from kvbench.runner import run

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def execute(notebook: Path) -> dict:
    """Run every code cell in one namespace, as a kernel would; return that namespace."""
    cells = json.loads(notebook.read_text())["cells"]
    namespace: dict = {"__name__": "__main__"}
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{notebook.name}[{index}]", "exec"), namespace)
    return namespace


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_over_results(notebook, tmp_path, niah_config, monkeypatch):
    runs = tmp_path / "runs"
    run(niah_config())
    run(niah_config(task__question_position="start"))
    run(niah_config(method="streamingllm", budget__token_ratio=0.1))
    monkeypatch.setenv("KVBENCH_RESULTS", str(runs))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = execute(notebook)
    if notebook.stem == "compare_methods":
        table = namespace["table"]
        assert set(table.columns) == {"end", "start"}
        assert len(namespace["samples"]) == 12
        assert set(namespace["by_length"].index) == {600, 700}
