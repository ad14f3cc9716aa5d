"""Where task data comes from: a local folder in the original format, or the hub by name.

Every task reads its data one of two ways: ``task.data_dir=<folder>`` holding the benchmark's
original files (what the official repositories distribute), or — when ``data_dir`` is unset — the
Hugging Face hub through ``datasets.load_dataset`` (needs network). A missing data set is one error
that says where to get it, and so is a malformed line of a data file (with the file and line number).

Offline, ``datasets`` retries the hub for about half a minute before it gives up. So unless the user
chose offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``: ``datasets`` then reads its cache
and fails fast by itself), :func:`hub_rows` first opens a TCP connection to the hub (or the HTTPS
proxy) with a short timeout and fails at once when that does not work.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbench.errors import ConfigError

#: where the experiment files look for the staged data: ``${oc.env:KVBENCH_DATA,../shared/data}``
DATA_VARIABLE = "KVBENCH_DATA"
STAGED_DATA = "../shared/data"


def data_dir(cfg: Mapping[str, Any], where: str | None = None) -> Path | None:
    """:func:`data_folder` of a task's raw config node (``cfg["data_dir"]``): for code that checks the folder
    before any task is built (:func:`kvbench.validate.check_data`); a task passes its typed value instead."""
    return data_folder(cfg.get("data_dir"), where)


def data_folder(value: str | None, where: str | None = None) -> Path | None:
    """``task.data_dir`` (``value``) as a folder (None when unset); a missing folder is one error that names
    the setting behind it (``where``: what the folder should hold)."""
    if not value:
        return None
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise missing_folder(path, where)
    return path


def missing_folder(path: Path, where: str | None = None) -> ConfigError:
    """The error for a ``task.data_dir`` that is not a folder. A relative path is shown with the folder it
    was looked for in; a path under the staged data (``../shared/data``, where the experiment files and
    the golden checks point unless ``$KVBENCH_DATA`` says otherwise) names that variable, since it, not
    the command line, usually chose the folder."""
    shown = f"{path} (from {Path.cwd()})" if not path.is_absolute() else str(path)
    what = "is a file, not a folder" if path.exists() else "is not a folder"
    staged = os.environ.get(DATA_VARIABLE)
    fix = f"point task.data_dir at {where}" if where else "point task.data_dir at the benchmark's data files"
    if STAGED_DATA in str(path) or (staged and str(path).startswith(staged)):
        now = f"now {staged}" if staged else f"unset, so {STAGED_DATA} relative to the working directory"
        fix = (
            f"set {DATA_VARIABLE}=<the folder holding the staged data> ({DATA_VARIABLE} is {now}; the experiment "
            f"files read ${{{DATA_VARIABLE}}}/<dataset>), run from the repository root, or pass task.data_dir=<folder>"
        )
    return ConfigError(f"task.data_dir={shown} {what}", fix)


def find_file(folder: Path, names: list[str], what: str, where: str) -> Path:
    """The first of ``names`` present in ``folder`` (searched recursively)."""
    for name in names:
        direct = folder / name
        if direct.exists():
            return direct
        found = sorted(folder.rglob(name))
        if found:
            return found[0]
    raise ConfigError(f"{what} not found in {folder} (looked for {', '.join(names)})", f"get it from {where}")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file; a line that is not a JSON object is an error naming file and line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if raw.strip():
                yield parse_line(path, number, raw)


def check_jsonl(
    path: Path, limit: int | None = None, fields: Callable[[dict[str, Any]], Sequence[str]] | None = None
) -> None:
    """Parse the first ``limit`` rows (all when None) of a JSONL file, raising as :func:`read_jsonl` does;
    a file without a row is an error, and so is a row without one of ``fields(row)`` (file and line named,
    with the fields a row must have)."""
    rows = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            row = parse_line(path, number, raw)
            rows += 1
            missing = [key for key in (fields(row) if fields else ()) if key not in row]
            if missing:
                wanted = ", ".join(fields(row)) if fields else ""
                raise ConfigError(
                    f"{path}:{number}: the row has no {', '.join(repr(k) for k in missing)} "
                    f"(each line must be a JSON object with {wanted})",
                    "repair that line or download the file again",
                )
            if limit is not None and rows >= limit:
                return
    if rows == 0:
        raise ConfigError(f"{path} holds no rows (an empty JSONL file)", "download the file again")


def parse_line(path: Path, number: int, raw: bytes) -> dict[str, Any]:
    """One JSONL line as an object, or the error naming file and line."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"{path}:{number}: not a valid JSON line ({exc})", "repair that line or download the file again"
        ) from None
    if not isinstance(row, dict):
        raise ConfigError(
            f"{path}:{number}: a JSON {json_kind(row)}, not an object (one row per line)",
            "repair that line or download the file again",
        )
    return row


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``object``, ``list``, ``string``, ...)."""
    kinds = {dict: "object", list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


def read_json(path: Path, shape: str) -> Any:
    """A whole JSON file (``shape`` says what it should hold, for the error); an empty, truncated or
    otherwise unparsable file is one error naming file and line."""
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"{path} is empty (expected {shape})", "download the file again")
    try:
        text = data.decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text, so not JSON (expected {shape})", "download the file again"
        ) from None
    except json.JSONDecodeError as exc:
        ends = " where the file ends: a truncated file" if exc.pos >= len(text.rstrip()) else ""
        raise ConfigError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}{ends}) (expected {shape})", "download the file again"
        ) from None


def read_json_rows(path: Path, shape: str) -> list[tuple[int, Any]]:
    """The items of a JSON file holding one list, each with the line it starts on, so that a bad item
    can be named by file and line; an empty, truncated or unparsable file, or one that is not a list,
    is one error naming file and line and the expected ``shape``."""
    data = path.read_bytes()
    if not data.strip():
        raise ConfigError(f"{path} is empty (expected {shape})", "download the file again")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text, so not JSON (expected {shape})", "download the file again"
        ) from None
    decoder = json.JSONDecoder()
    rows: list[tuple[int, Any]] = []
    try:
        position = _skip_space(text, 0)
        if text[position] != "[":
            value, _ = decoder.raw_decode(text, position)
            raise ConfigError(
                f"{path}:{text.count(chr(10), 0, position) + 1}: a JSON {json_kind(value)}, not a list "
                f"(expected {shape})",
                "point task.data_dir at the benchmark's original files",
            )
        position = _skip_space(text, position + 1)
        while text[position] != "]":
            value, end = decoder.raw_decode(text, position)
            rows.append((text.count("\n", 0, position) + 1, value))
            position = _skip_space(text, end)
            if text[position] == ",":
                position = _skip_space(text, position + 1)
            elif text[position] != "]":
                raise json.JSONDecodeError("expected ',' or ']'", text, position)
    except json.JSONDecodeError as exc:
        ends = " where the file ends: a truncated file" if exc.pos >= len(text.rstrip()) else ""
        raise ConfigError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg}{ends}) (expected {shape})", "download the file again"
        ) from None
    except IndexError:  # ran off the end: the list never closes
        line = text.count("\n") + 1
        raise ConfigError(
            f"{path}:{line}: the JSON ends before its list closes: a truncated file (expected {shape})",
            "download the file again",
        ) from None
    return rows


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


#: how much of a text file :func:`check_text` reads (a haystack or a book can be large; binary content
#: shows in its first bytes)
TEXT_PROBE_BYTES = 1 << 20


def check_text(path: Path, encoding: str = "utf-8") -> None:
    """A file read as prose (an essay, a book, a prompt file) is text: not empty, no NUL byte, and at most
    1% of its first megabyte bytes that ``encoding`` cannot decode or control characters (a stray byte
    in an essay passes, as the reader replaces it). A file that is not is refused with the line of its
    first such byte."""
    with open(path, "rb") as handle:
        data = handle.read(TEXT_PROBE_BYTES)
    fix = "remove it from the folder or replace it with text"
    if not data.strip():
        raise ConfigError(f"{path} is empty (expected text)", fix)
    if b"\x00" in data:
        line = data[: data.index(b"\x00")].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: a NUL byte: a binary file, not text", fix)
    text = data.decode(encoding, errors="replace")
    odd = [m.start() for m in _NOT_TEXT.finditer(text)]
    if len(odd) > len(text) / 100:
        line = text[: odd[0]].count("\n") + 1
        raise ConfigError(
            f"{path}:{line}: {len(odd)} of its first {len(text)} characters are not {encoding} text: "
            "a binary file, not text",
            fix,
        )


_NOT_TEXT = re.compile("[\x01-\x08\x0e-\x1f\ufffd]")


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_mode() -> bool:
    """Whether the user told the Hugging Face libraries to stay offline (they then read their cache only)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_VARIABLES)


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub (or the HTTPS proxy) cannot be reached; None when a TCP connection opens
    within ``timeout`` seconds."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"no connection to {host}:{port}: {exc.strerror or exc}"
    return None


def check_hub(name: str, where: str) -> None:
    """One clear error now when data set ``name`` must come from a hub that does not answer (skipped in
    offline mode, where ``datasets`` reads its cache); the runner calls it before any model loads."""
    offline = None if offline_mode() else hub_unreachable()
    if offline:
        raise ConfigError(
            f"{name} needs the Hugging Face hub, which is unreachable ({offline})",
            f"download the data and pass task.data_dir=<folder> ({where}); "
            "or set HF_HUB_OFFLINE=1 to use a copy in your Hugging Face cache",
        )


def hub_rows(name: str, config: str | None, split: str, where: str) -> Iterator[dict[str, Any]]:
    """Rows of a hub data set; a clear error at once when the hub is unreachable (in offline mode,
    ``datasets`` reads its cache and fails fast by itself)."""
    check_hub(f"{name}{f'/{config}' if config else ''}", where)
    try:
        from datasets import load_dataset

        rows = load_dataset(name, config, split=split) if config else load_dataset(name, split=split)
    except Exception as exc:  # network, auth or missing-config errors all end the same way for the user
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot load {name}{f'/{config}' if config else ''} from the Hugging Face hub ({first})",
            f"download the data and pass task.data_dir=<folder> ({where})",
        ) from None
    yield from rows
