"""No import cycles among kvbench's modules, and the faces apart from the mechanisms they use.

The walk reads every module of the installed package — ``kvbench/``, ``methods/`` (``kvbench.methods``)
and ``tasks/`` (``kvbench.tasks``) — and follows its module-level imports (also those under ``try`` and
``if``, but not under ``if TYPE_CHECKING``, which never run). An import inside a function is left out:
it is the deliberate way to break a cycle, run only when the function is called. Importing ``a.b.c``
also runs the packages ``a`` and ``a.b``; those edges count too, except a module's own packages, which
are always imported first (``kvbench.render`` imports its submodules and each submodule is inside it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvbench": ROOT / "kvbench", "kvbench.methods": ROOT / "methods", "kvbench.tasks": ROOT / "tasks"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(tree: ast.Module, *, everywhere: bool = False) -> list[str]:
    """The modules (and ``module.name`` candidates) a module imports: at module level, or ``everywhere``."""
    found: list[str] = []

    def add(node: ast.stmt) -> None:
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            add(node)
            if isinstance(node, ast.If) and not _is_type_checking(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    if everywhere:
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt):
                add(node)
    else:
        visit(tree.body)
    return found


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Module name → file, for every ``.py`` file under the packages' folders."""
    out = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def graph(known: dict[str, Path], *, everywhere: bool = False) -> dict[str, set[str]]:
    """Module → the known modules importing it runs (see the module doc). ``everywhere``: the modules it
    names in any import, inside functions too, without the packages around them (a design dependency,
    not what runs at import time: by the time a function runs, the packages are loaded)."""
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        own = {name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)}  # its packages
        targets: set[str] = set()
        for imported in imported_names(ast.parse(path.read_text(encoding="utf-8")), everywhere=everywhere):
            while imported and imported not in known:  # `from pkg import name`: the name is not a module
                imported = imported.rpartition(".")[0]
            parts = imported.split(".")
            targets |= {imported} if everywhere else {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
        targets &= set(known)
        edges[name] = targets - own - {name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_module_level_import_cycle():
    known = modules(PACKAGES)
    assert {"kvbench.cli", "kvbench.sweep", "kvbench.render.table", "kvbench.methods.full"} <= set(known)
    found = cycles(graph(known))
    assert found == [], "module-level import cycles (break one with an import inside the function):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_the_faces_import_no_cycle_even_inside_functions():
    """cli / reproduce / html / sweep, papers / render / report, and runner / results / metrics: no cycle
    among them even counting the imports inside functions (reproduce runs sweeps through kvbench.sweep, not
    the CLI's functions; results recomputes metrics through kvbench.metrics, not the runner)."""
    faces = {
        name: path
        for name, path in modules({"kvbench": PACKAGES["kvbench"]}).items()
        if name in ("kvbench.cli", "kvbench.reproduce", "kvbench.html", "kvbench.sweep", "kvbench.papers")
        or name in ("kvbench.report", "kvbench.agreement", "kvbench.runner", "kvbench.results", "kvbench.metrics")
        or name == "kvbench.compare"
        or name.startswith(("kvbench.render", "kvbench.figures"))
    }
    assert cycles(graph(faces, everywhere=True)) == []
    below_the_cli = ("kvbench.reproduce", "kvbench.sweep", "kvbench.html")
    assert not [name for name in below_the_cli if "kvbench.cli" in graph(faces, everywhere=True)[name]]


def test_the_walk_finds_a_cycle_and_skips_function_and_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("import pkg.c\n")
    (package / "c.py").write_text("from pkg.a import x\n")
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\ndef f():\n    from pkg import e\n"
    )
    (package / "e.py").write_text("from pkg import d\n")
    edges = graph(modules({"pkg": package}))
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.d"] == set()
    assert cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert cycles(graph(modules({"pkg": package}), everywhere=True)) == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.d", "pkg.e"],
    ]
