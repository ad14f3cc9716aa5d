"""Where task data comes from: a local folder in the original format, or the hub by name.

Every task reads its data one of two ways: ``task.data_dir=<folder>`` holding the benchmark's
original files (what the official repositories distribute), or — when ``data_dir`` is unset — the
Hugging Face hub through ``datasets.load_dataset`` (needs network). A missing data set is one error
that says where to get it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

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
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def hub_rows(name: str, config: str | None, split: str, where: str) -> Iterator[dict[str, Any]]:
    """Rows of a hub data set; a clear error when the hub is unreachable."""
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
