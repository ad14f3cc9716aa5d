"""The engine's boundary: imports run methods → engine, never engine → methods.

The engine (``kvbench/engine/``) owns the model, the store (``kvbench/kv/``), the decode step and the
mechanisms (the reuse prefill, the recall kernels); a method (``methods/``) keeps only its policy and
imports what it needs from the engine. This test reads every engine and store module's imports — at
module level, inside functions and under ``TYPE_CHECKING`` alike — and fails on one that reaches into
the methods or the tasks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER = ["kvbench/engine", "kvbench/kv"]
FORBIDDEN = ("kvbench.methods", "kvbench.tasks", "methods", "tasks")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _modules() -> list[Path]:
    return sorted(path for folder in LOWER for path in (ROOT / folder).rglob("*.py"))


def test_the_engine_and_the_store_import_no_method_and_no_task():
    assert len(_modules()) > 10  # (the walk found the engine)
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _modules()
        for line, name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert wrong == [], "the engine imports a method or a task:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", ["protocol", "reuse", "recall", "ranking", "decode"])
def test_the_protocol_and_the_mechanisms_live_in_the_engine(name):
    assert (ROOT / "kvbench" / "engine" / f"{name}.py").is_file()


def test_the_walk_catches_a_reverse_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvbench.methods import create_method\n", encoding="utf-8")
    assert _imports(bad) == [(2, "kvbench.methods")]
