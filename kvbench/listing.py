"""``kvbench list``: the choices of every config group and the parameters of any of them.

One registry answers both ``kvbench list`` and ``kvbench run --help``: :func:`group_options` (the YAML
files of ``conf/<group>/``; for methods the declarations read from their modules
(:data:`kvbench.methods.PARAMS`) with their presets, for tasks those of :mod:`kvbench.tasks.params`).
Nothing here imports torch or a method module (a task module imports nothing heavy), so a listing
takes well under two seconds: a method's and a task's parameters come from their ``Params``
declarations, a model's and the shared groups' (``budget``, ``profile``, ``store``, ``engine``) from
their YAML and its comments.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the groups ``kvbench list <what>`` shows: the choices of a ``<group>=`` and the keys of conf/config.yaml
CHOICE_GROUPS = {"models": "model", "methods": "method", "tasks": "task", "experiments": "experiment"}
KEY_GROUPS = ("budget", "profile", "store", "engine")


def conf_dir() -> Path:
    import kvbench.conf

    return Path(kvbench.conf.__file__).parent


def group_options(group: str) -> list[str]:
    """The choices of a config group: YAML files, except methods and tasks (declared in
    in their modules: kvbench.methods.PARAMS, kvbench.tasks.params.TASK_PARAMS)."""
    if group == "method":
        from kvbench.methods import method_choices

        return method_choices()
    if group == "task":
        from kvbench.tasks.params import TASK_PARAMS

        return sorted(TASK_PARAMS)
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def listing(what: str | None) -> str:
    """``kvbench list [what]``: every group's names, or one group's names with their parameters."""
    from kvbench.assets import ASSETS

    if what == "methods":
        return method_table(group_options("method"))
    if what == "tasks":
        return task_table(group_options("task"))
    if what == "models":
        return model_table(group_options("model"))
    if what in KEY_GROUPS:
        return _blocks([(f"{what}.* (conf/config.yaml)", yaml_rows(conf_dir() / "config.yaml", what))])
    sections = {name: group_options(group) for name, group in CHOICE_GROUPS.items()}
    sections["assets"] = sorted(ASSETS)
    if what is not None:
        sections = {what: sections[what]}
    return "\n".join(f"{name}: {', '.join(items) if items else '(none)'}" for name, items in sections.items())


# ---------------------------------------------------------------------- methods
def method_table(names: Sequence[str]) -> str:
    """``kvbench list methods``: per method its family, then one row per parameter (``method.<name>``):
    name, type, default, help. A preset names the method and the values it sets."""
    from kvbench.methods import METHOD_PRESETS, PARAMS
    from kvbench.methods.params import family_of
    from kvbench.params import help_rows

    blocks: list[tuple[str, list[tuple[str, str, str, str]]]] = []
    for name in names:
        if name in METHOD_PRESETS:
            base, values = METHOD_PRESETS[name]
            settings = " ".join(f"method.{k}={v}" for k, v in values.items())
            blocks.append((f"{name} (preset: method={base} {settings})", []))
            continue
        rows = help_rows(PARAMS[name])
        blocks.append((f"{name} ({family_of(PARAMS[name])})" + ("" if rows else ": no parameters"), rows))
    return _blocks(blocks)


# ---------------------------------------------------------------------- tasks and models
def task_table(names: Sequence[str]) -> str:
    """``kvbench list tasks``: per task one row per ``task.<key>``: type, default and help, from its
    declared parameters (:mod:`kvbench.tasks.params`; nothing heavy is imported)."""
    from kvbench.params import help_rows
    from kvbench.tasks.params import TASK_PARAMS

    blocks = []
    for name in names:
        params = TASK_PARAMS[name]
        doc = (params.__doc__ or "").strip().splitlines()
        blocks.append((f"{name}" + (f": {doc[0]}" if doc else ""), help_rows(params)))
    return _blocks(blocks)


def model_table(names: Sequence[str]) -> str:
    """``kvbench list models``: per model its description (the file's first comment) and its settings."""
    import yaml

    blocks = []
    for name in names:
        path = conf_dir() / "model" / f"{name}.yaml"
        first = next((line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        data = yaml.safe_load(path.read_text()) or {}
        shape = data.get("config") or {}
        rows = [row for row in yaml_rows(path) if row[0] not in ("name", "config")]
        if shape:
            parts = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
            text = ", ".join(f"{k}={shape[k]}" for k in parts if k in shape)
            rows.insert(0, ("config", "dict", "...", text))
        blocks.append((f"{name}" + (f": {first}" if first else ""), rows))
    return _blocks(blocks)


# ---------------------------------------------------------------------- YAML with its comments
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")


def yaml_rows(path: Path, group: str | None = None) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, help)`` for the top-level keys of ``path`` (or of its ``group``), the help
    from the key's trailing comment and the comment lines indented below it."""
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    values: dict[str, Any] = (data.get(group) if group else data) or {}
    rows: list[list[str]] = []
    depth = None
    inside = group is None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _KEY.match(line)
        if group is not None and match and not match.group(1):
            inside = match.group(2) == group
            depth = None
            continue
        if not inside:
            continue
        if match and (depth is None or len(match.group(1)) == depth):
            depth = len(match.group(1))
            key = match.group(2)
            if key in values and key != "defaults":
                value = values[key]
                rows.append([key, _type_of(value), _text(value), _comment(match.group(3))])
            continue
        stripped = line.strip()
        if rows and stripped.startswith("#") and len(line) - len(line.lstrip()) > (depth or 0):
            rows[-1][3] = f"{rows[-1][3]} {stripped.lstrip('#').strip()}".strip()
    return [(k, t, d, h) for k, t, d, h in rows]


def _comment(rest: str) -> str:
    """The comment after a YAML value (a ``#`` outside quotes, after a space)."""
    quote = None
    for index, char in enumerate(rest):
        if char in "\"'" and quote in (None, char):
            quote = None if quote == char else char
        elif char == "#" and quote is None and (index == 0 or rest[index - 1].isspace()):
            return rest[index + 1 :].strip()
    return ""


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return f"list[{_type_of(value[0])}]" if value else "list"
    return type(value).__name__


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= 40 else text[:37] + "..."


def _blocks(blocks: Sequence[tuple[str, Sequence[tuple[str, str, str, str]]]]) -> str:
    """Titled blocks of ``(key, type, default, help)`` rows, the columns aligned across blocks."""
    rows = [row for _, table in blocks for row in table]
    widths = [min(max((len(row[i]) for row in rows), default=0), 40) for i in range(3)]
    lines = []
    for title, table in blocks:
        lines.append(title)
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in table]
    return "\n".join(line.rstrip() for line in lines)
