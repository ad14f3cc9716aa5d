"""``kvbench check``: score regression guards.

A golden file lists configs (as ``kvbench run`` overrides) with the metrics they must reproduce.
Each check runs through the normal runner — resumable, so repeating a passing check is instant —
and compares ``metrics.json`` values within a tolerance. Exit status 1 when any check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

DEFAULT_GOLDEN = Path("results/golden/checks.yaml")


def load_checks(path: Path) -> list[dict[str, Any]]:
    import yaml

    if not path.exists():
        raise ConfigError(f"no golden file at {path}", "run from the repository root or pass --golden <file>")
    checks = yaml.safe_load(path.read_text()) or []
    for check in checks:
        missing = {"name", "overrides", "expect"} - set(check)
        if missing:
            raise ConfigError(
                f"golden check {check.get('name', '?')} lacks {', '.join(sorted(missing))}", f"fix {path}"
            )
    return checks


def compare(metrics: dict[str, Any], expect: dict[str, Any], tolerance: float) -> list[str]:
    """Failure messages (empty when every expected metric is within ``tolerance``)."""
    failures = []
    for key, want in expect.items():
        got = metrics.get(key)
        if got is None or abs(float(got) - float(want)) > tolerance:
            failures.append(f"{key}: got {got}, expected {want} ± {tolerance}")
    return failures


def run_checks(golden: str | None, *, names: Sequence[str] = (), output_dir: str | None = None) -> int:
    from kvbench.compose import compose
    from kvbench.runner import run

    checks = load_checks(Path(golden) if golden else DEFAULT_GOLDEN)
    selected = [c for c in checks if not names or c["name"] in names]
    unknown = set(names) - {c["name"] for c in checks}
    if unknown:
        raise ConfigError(f"unknown check(s) {', '.join(sorted(unknown))}",
                          f"choose from: {', '.join(c['name'] for c in checks)} (in {golden or DEFAULT_GOLDEN})")
    failed = 0
    for check in selected:
        overrides = list(check["overrides"]) + ["progress=false"]
        if output_dir:
            overrides.append(f"output_dir={output_dir}")
        summary = run(compose(overrides))
        problems = compare(summary.metrics, check["expect"], float(check.get("tolerance", 0.0)))
        status = "FAIL" if problems else "ok"
        print(f"{status:4} {check['name']}  ({summary.run_dir})" + "".join(f"\n     {p}" for p in problems))
        failed += bool(problems)
    print(f"{len(selected) - failed} passed, {failed} failed")
    return 1 if failed else 0
