"""A method's parameters, read from its module's source without running the module.

A method is one file: its ``Params`` dataclass and its policy class side by side. The policy imports
torch (2–5 s here), but ``kvbench run`` must reject a bad ``method.*`` key, and ``--dry-run`` plan a
sweep, in about a second (issue 14, item 10). So the CLI does not import a method module to learn its
parameters: :func:`read_declaration` parses the module's source and executes only its declarations —

* imports from light modules (:data:`LIGHT_MODULES`: ``dataclasses``, ``typing``, ``kvbench.params``,
  the shared bases in ``kvbench.methods.params``, ``kvbench.errors``), and the ``Params`` classes that
  other method modules declare (read the same way: ``from kvbench.methods.snapkv import SnapKVParams``);
* top-level assignments that use only names bound so far (``GqaRule = Literal[...]``);
* every ``@dataclass`` class;

and skips everything else (torch, the engine, the policy class). The registered class (the one
decorated with ``@register``) names the method (``name = "h2o"``) and its parameters (``Params =
H2OParams``). A ``Params`` class that needs anything heavy fails here with one line naming it: keep
parameter declarations to plain values and ``Literal`` choices.

``tests/test_params.py`` checks that every shipped method's declaration read here has the same fields,
types and defaults as the class its module defines when imported.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import functools
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.params import Params

#: modules whose imports a declaration may use (none of them imports torch)
LIGHT_MODULES = frozenset(
    {
        "__future__",
        "dataclasses",
        "typing",
        "collections.abc",
        "kvbench.params",
        "kvbench.errors",
        "kvbench.methods.params",
    }
)
METHODS_PACKAGE = "kvbench.methods"
_FUTURE = "__kvbench_future_flags__"  # (the namespace key of the module's __future__ features)


@dataclass(frozen=True)
class Declaration:
    """What a method module declares: the method's name, its parameters and the module's namespace of
    declarations (for modules that import a ``Params`` class from it)."""

    name: str | None
    params: type[Params] | None
    namespace: dict[str, Any]


class DeclarationError(RuntimeError):
    """A method module whose declarations cannot be read without running it (a developer's error)."""


@functools.cache
def read_declaration(module: str) -> Declaration:
    """The declarations of ``module`` (``kvbench.methods.h2o``), read from its source (see the module
    docstring). ``name`` and ``params`` are ``None`` for a module that registers no method."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise DeclarationError(f"no module {module}")
    path = Path(spec.origin)
    if path.suffix != ".py":  # an installation without sources (.pyc only): the module itself, torch and all
        return _imported(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    # the namespace lives in a module object of its own (never the real module's name in sys.modules), so
    # that typing.get_type_hints finds the names the string annotations use
    holder = types.ModuleType(f"{module}[declarations]")
    holder.__file__ = str(path)
    sys.modules[holder.__name__] = holder
    namespace = holder.__dict__
    for node in tree.body:
        _declare(node, namespace, module, path)
    name, params_name = _registered(tree, module)
    params = None
    if name is not None:
        if params_name is None:
            from kvbench.params import Params

            params = Params
        elif not isinstance(namespace.get(params_name), type):
            raise DeclarationError(
                f"{module}: method {name!r} sets Params = {params_name}, which is not a dataclass declared "
                "in the module or imported from a light module (kvbench.declarations)"
            )
        else:
            params = namespace[params_name]
    return Declaration(name=name, params=params, namespace=dict(namespace))


def _imported(module: str) -> Declaration:
    """The declaration of a module read by importing it: its registered method's name and ``Params``."""
    from kvbench.methods import REGISTRY

    loaded = importlib.import_module(module)
    namespace = dict(vars(loaded))
    registered = [cls for cls in REGISTRY.entries.values() if cls.__module__ == module]
    if not registered:
        return Declaration(name=None, params=None, namespace=namespace)
    return Declaration(name=registered[0].name, params=registered[0].Params, namespace=namespace)


def _declare(node: ast.stmt, namespace: dict[str, Any], module: str, path: Path) -> None:
    """Execute ``node`` in ``namespace`` when it is a declaration (module docstring), else skip it."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
        if node.module in LIGHT_MODULES:
            _run(node, namespace, path)
        elif node.module.startswith(f"{METHODS_PACKAGE}.") and node.module != module:
            sibling = read_declaration(node.module).namespace
            for alias in node.names:
                value = sibling.get(alias.name)
                if isinstance(value, type):  # a Params class (or a base) declared there
                    namespace[alias.asname or alias.name] = value
        return
    if isinstance(node, ast.Import):
        if all(alias.name in LIGHT_MODULES for alias in node.names):
            _run(node, namespace, path)
        return
    if isinstance(node, ast.ClassDef) and any(_is_dataclass(d) for d in node.decorator_list):
        try:
            _run(node, namespace, path)
        except NameError as error:
            raise DeclarationError(
                f"{path}:{node.lineno}: class {node.name} uses {error.name!r}, which is not importable "
                "without torch; declare parameters with plain values and Literal choices (kvbench.declarations)"
            ) from None
        return
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _bound(node.value, namespace):
        _run(node, namespace, path)


def _run(node: ast.stmt, namespace: dict[str, Any], path: Path) -> None:
    """Compile and execute one statement with the ``from __future__`` features the module asked for."""
    flags = namespace.get(_FUTURE, 0)
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
    exec(code, namespace)
    if isinstance(node, ast.ImportFrom) and node.module == "__future__":
        for alias in node.names:
            flags |= getattr(__future__, alias.name).compiler_flag
        namespace[_FUTURE] = flags


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


def _bound(value: ast.expr, namespace: dict[str, Any]) -> bool:
    """Every name ``value`` reads is bound in ``namespace`` or a builtin."""
    return all(
        node.id in namespace or hasattr(builtins, node.id)
        for node in ast.walk(value)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
    )


def _registered(tree: ast.Module, module: str) -> tuple[str | None, str | None]:
    """``(name, Params's name)`` of the class decorated with ``@register``; ``(None, None)`` without one."""
    classes = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list)
    ]
    if not classes:
        return None, None
    if len(classes) > 1:
        raise DeclarationError(f"{module}: one method per module ({', '.join(c.name for c in classes)} are registered)")
    name = params = None
    for node in classes[0].body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target == "name" and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                name = node.value.value
            elif target == "Params" and isinstance(node.value, ast.Name):
                params = node.value.id
    if name is None:
        raise DeclarationError(f'{module}: class {classes[0].name} sets no name = "..." in its body')
    return name, params
