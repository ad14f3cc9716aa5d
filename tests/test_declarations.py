"""kvbench.declarations: a method's parameters read from its module's source, without running it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from kvbench.declarations import DeclarationError, read_declaration


def _package(tmp_path, monkeypatch, files: dict[str, str]) -> str:
    package = tmp_path / "declfix"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name == "declfix" or name.startswith("declfix.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    read_declaration.cache_clear()
    return "declfix"


HEAD = textwrap.dedent(
    """
    from __future__ import annotations
    from dataclasses import dataclass
    from typing import Literal
    import torch  # never imported by the reader: the module would fail here under it
    from kvbench.methods.params import MethodParams
    from kvbench.params import param
    """
)


def test_reads_the_registered_params_and_skips_the_policy(tmp_path, monkeypatch):
    package = _package(
        tmp_path,
        monkeypatch,
        {
            "toy": HEAD
            + textwrap.dedent(
                """
    Mode = Literal["a", "b"]
    HEAVY = torch.zeros(3)  # skipped: torch is not bound

    @dataclass(frozen=True)
    class ToyParams(MethodParams):
        seed: int = param(7, "a seed", min=0)
        mode: Mode = param("a", "a choice")

    @register
    class Toy(Base):
        name = "toy"
        Params = ToyParams
    """
            )
        },
    )
    declared = read_declaration(f"{package}.toy")
    assert declared.name == "toy" and declared.params is not None
    defaults = declared.params()
    assert (defaults.seed, defaults.mode, defaults.sink) == (7, "a", 32)
    hints = __import__("typing").get_type_hints(declared.params)
    assert str(hints["mode"]) == "typing.Literal['a', 'b']"
    assert "HEAVY" not in declared.namespace and "torch" not in declared.namespace


def test_a_params_class_that_needs_torch_is_one_clear_error(tmp_path, monkeypatch):
    package = _package(
        tmp_path,
        monkeypatch,
        {
            "bad": HEAD
            + textwrap.dedent(
                """
    @dataclass(frozen=True)
    class BadParams(MethodParams):
        dtype: str = param(str(torch.float32), "heavy")

    @register
    class Bad(Base):
        name = "bad"
        Params = BadParams
    """
            )
        },
    )
    with pytest.raises(DeclarationError, match=r"bad.py:\d+: class BadParams uses 'torch'"):
        read_declaration(f"{package}.bad")


def test_one_method_per_module_and_a_name(tmp_path, monkeypatch):
    package = _package(
        tmp_path,
        monkeypatch,
        {
            "two": HEAD + "\n@register\nclass A:\n    name = 'a'\n\n@register\nclass B:\n    name = 'b'\n",
            "anon": HEAD + "\n@register\nclass A:\n    pass\n",
            "helper": HEAD + "\ndef f():\n    return torch.ones(1)\n",
        },
    )
    with pytest.raises(DeclarationError, match="one method per module"):
        read_declaration(f"{package}.two")
    with pytest.raises(DeclarationError, match="sets no name"):
        read_declaration(f"{package}.anon")
    assert read_declaration(f"{package}.helper").name is None  # a helper module registers nothing


def test_a_sibling_methods_params_are_read_the_same_way():
    """PyramidKV's parameters derive from SnapKV's, imported from methods/snapkv.py (which imports torch)."""
    read_declaration.cache_clear()
    snap, pyramid = read_declaration("kvbench.methods.snapkv"), read_declaration("kvbench.methods.pyramidkv")
    assert pyramid.params is not None and snap.params is not None
    assert issubclass(pyramid.params, snap.params) and pyramid.params().window == 8 and snap.params().window == 32


def test_reading_every_method_imports_no_torch():
    script = (
        "import sys; from kvbench.methods import PARAMS; names = sorted(PARAMS);"
        "print(len(names), 'torch' in sys.modules, 'kvbench.engine' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) >= 19 and out[1:] == ["False", "False"]


def test_an_installation_without_sources_imports_the_module(tmp_path, monkeypatch):
    """A module installed as bytecode only (no .py to read): its declaration comes from importing it."""
    import py_compile

    from kvbench.methods import REGISTRY

    package = _package(
        tmp_path,
        monkeypatch,
        {
            "compiled": textwrap.dedent(
                """
                from dataclasses import dataclass
                from kvbench.engine.protocol import KVMethod
                from kvbench.methods import register
                from kvbench.methods.params import MethodParams
                from kvbench.params import param

                @dataclass(frozen=True)
                class CompiledParams(MethodParams):
                    seed: int = param(3, "a seed")

                @register
                class Compiled(KVMethod):
                    name = "declfix_compiled"
                    Params = CompiledParams
                """
            )
        },
    )
    source = tmp_path / "declfix" / "compiled.py"
    py_compile.compile(str(source), cfile=str(source.with_suffix(".pyc")), doraise=True)
    source.unlink()
    try:
        declared = read_declaration(f"{package}.compiled")
        assert declared.name == "declfix_compiled" and declared.params is not None and declared.params().seed == 3
    finally:
        REGISTRY.entries.pop("declfix_compiled", None)
