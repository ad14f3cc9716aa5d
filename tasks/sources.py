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
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvbench.errors import ConfigError


def data_dir(cfg: dict[str, Any]) -> Path | None:
    value = cfg.get("data_dir")
    if not value:
        return None
    path = Path(str(value)).expanduser()
    if not path.is_dir():
        raise ConfigError(f"task.data_dir={path} is not a folder", "point task.data_dir at the benchmark's data files")
    return path


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
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ConfigError(
                    f"{path}:{number}: not a valid JSON line ({exc})", "repair that line or download the file again"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{path}:{number}: a JSON {type(row).__name__}, not an object (one row per line)",
                    "repair that line or download the file again",
                )
            yield row


def check_jsonl(path: Path, limit: int | None = None) -> None:
    """Parse the first ``limit`` rows (all when None) of a JSONL file, raising as :func:`read_jsonl` does."""
    for index, _ in enumerate(read_jsonl(path), 1):
        if limit is not None and index >= limit:
            return


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
