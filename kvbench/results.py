"""Run directories on disk, and loading many of them into one DataFrame.

A run directory ``<output_dir>/<run-id>/`` holds:

* ``config.yaml`` — the fully resolved config (the run id is a hash of it);
* ``samples.jsonl`` — one JSON object per finished sample, appended, flushed and fsynced one by one,
  so a killed run loses no finished sample and a re-run resumes after the last one;
* ``metrics.json`` — aggregates derived from ``samples.jsonl`` (rewritten atomically);
* ``env.json`` — versions, git sha, device; plus task artifacts such as ``heatmap.png``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

from kvbench.errors import ConfigError

SAMPLES = "samples.jsonl"
METRICS = "metrics.json"
CONFIG = "config.yaml"
ENV = "env.json"


def config_hash(resolved: dict[str, Any], ignore: Iterable[str] = ("output_dir", "progress")) -> str:
    """Stable hash of a resolved config, without keys that do not change results."""
    data = {key: value for key, value in resolved.items() if key not in set(ignore)}
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def run_id_for(resolved: dict[str, Any]) -> str:
    """``<task>-<method>-<model>-<hash>``: readable, and unique per resolved config."""
    names = [str((resolved.get(group) or {}).get("name", group)) for group in ("task", "method", "model")]
    return "-".join(names + [config_hash(resolved)])


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class RunDir:
    """One run's directory: created when the first sample finishes, appended sample by sample."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @property
    def samples_path(self) -> Path:
        return self.path / SAMPLES

    def exists(self) -> bool:
        return self.samples_path.exists()

    def records(self) -> list[dict[str, Any]]:
        """Finished samples; a torn last line (a run killed mid-write) is dropped from the file."""
        if not self.samples_path.exists():
            return []
        raw = self.samples_path.read_bytes()
        records: list[dict[str, Any]] = []
        good = 0
        for line in raw.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
            good += len(line)
        if good < len(raw):
            with open(self.samples_path, "r+b") as handle:
                handle.truncate(good)
        return records

    def finished_ids(self) -> set[str]:
        return {str(r["id"]) for r in self.records()}

    def create(self, config_yaml: str, env: dict[str, Any]) -> None:
        """Make the directory with its config and environment (idempotent)."""
        self.path.mkdir(parents=True, exist_ok=True)
        config = self.path / CONFIG
        if config.exists() and config.read_text() != config_yaml:
            raise ConfigError(
                f"{config} belongs to a different config than this run's",
                f"move {self.path} away or choose another output_dir",
            )
        if not config.exists():
            write_atomic(config, config_yaml)
        write_atomic(self.path / ENV, json.dumps(env, indent=2, sort_keys=True) + "\n")

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=_jsonable) + "\n"
        with open(self.samples_path, "a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        write_atomic(self.path / METRICS, json.dumps(metrics, indent=2, sort_keys=True, default=_jsonable) + "\n")

    def metrics(self) -> dict[str, Any]:
        path = self.path / METRICS
        return json.loads(path.read_text()) if path.exists() else {}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def find_runs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories at or below ``paths`` (directories holding a ``metrics.json``)."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if (path / METRICS).exists():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p.parent for p in path.glob(f"**/{METRICS}")))
    return found


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value


def load(paths: Iterable[str | Path] | str | Path = "results/runs", *, samples: bool = False) -> Any:
    """A pandas DataFrame of runs (one row per run: config and metrics flattened with dots), or of
    samples (``samples=True``: one row per sample, with its run's config columns)."""
    import pandas as pd
    import yaml

    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    for run in find_runs(paths):
        config = yaml.safe_load((run / CONFIG).read_text()) if (run / CONFIG).exists() else {}
        base: dict[str, Any] = {"run_id": run.name, "run_dir": str(run)}
        _flatten("config", config, base)
        if samples:
            for record in RunDir(run).records():
                row = dict(base)
                _flatten("", {k: v for k, v in record.items() if k not in ("meta", "telemetry", "budget")}, row)
                _flatten("meta", record.get("meta", {}), row)
                _flatten("telemetry", record.get("telemetry", {}), row)
                rows.append(row)
        else:
            row = dict(base)
            _flatten("", RunDir(run).metrics(), row)
            rows.append(row)
    return pd.DataFrame(rows)
