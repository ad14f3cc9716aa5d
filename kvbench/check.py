"""``kvbench check``: score regression guards.

A golden file (``results/golden/checks.yaml``) lists configs, as ``kvbench run`` overrides, with the
values they must reproduce. There is one smoke-scale check for every registered method and every
task (``tests/test_check.py`` fails when one is missing), so a change of behaviour anywhere shows up
as a failed check in CI, which runs ``kvbench check`` after the tests.

What a check compares (:data:`GOLDEN_KEYS`): the score and sample count, the recall, the attended
tokens, the KV bytes kept and moved, the hit rate, the prompt and generated token counts (from
``metrics.json``), the tokens a reuse method took from its chunk caches and the share it recomputed
(the prefill plan's telemetry), a digest of every sample's prediction (``predictions``: any changed token
changes it) and a digest of the positions every layer keeps after prefill and attends at every decode
step (``selection``, :mod:`kvbench.profile`'s ``selection_digest``, which the checks turn on): a smoke
prompt's few generated tokens can survive a changed method default, the tokens it keeps cannot.
Numbers are compared within the check's ``tolerance`` (absolute, default 0) or :data:`REL_TOL` of the
expected value, whichever is larger: the same code on two CPUs differs in the last bits of a float
(recall 0.6071322 on one machine, 0.6071331 on another; the selection digest still pins down every
kept and attended position exactly). The digests are compared exactly; floats inside a prediction (the
per-token NLLs of a perplexity task) are left out of its digest for the same reason (the score
carries them). Timings are never compared.

Some selections differ across CPUs: the float kernels round differently (AVX2 against AVX-512), and a
top-k over near-equal scores (SparQ's, PQCache's, the oracle's, K-norm's) can then keep another
position. A check may keep the values another CPU reproduces as ``also``: a list of partial
expectations, each laid over ``expect`` (``cpu`` names the machine, for the reader; it is not
compared). The check passes when ``expect`` or one of those overlays matches entirely, so every
recorded CPU is pinned down exactly, key for key. ``kvbench check --add-cpu [names]`` records this
machine's values as one more overlay (only the keys that ``expect`` does not accept) without
touching ``expect``; ``--update`` records a change of behaviour and drops the overlays (they were the
old behaviour on other CPUs: re-record them there).

``kvbench check --update`` re-runs the selected checks and rewrites their expected values with what
they produce now, printing each change: the deliberate way to accept a change of behaviour (say why
in the commit). A check whose data folder (``needs``) is absent is reported as skipped, not passed.

Checks run in a fresh temporary folder (deleted when they pass) unless ``--output-dir`` is given:
an earlier run of the same config must not answer for the code as it is now. They run as the points
of one sweep, so the methods of the same prompt share its dense prefill
(:mod:`kvbench.engine.prefill_cache`); the checks compare no timings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

DEFAULT_GOLDEN = Path("results/golden/checks.yaml")
#: what ``--update`` records for a check (those its run reports; timings never)
GOLDEN_KEYS = (
    "score",
    "n",
    "recall",
    "attended_tokens",
    "kv_bytes_ratio",
    "bytes_h2d",
    "hit_rate",
    "prompt_tokens",
    "new_tokens",
    "reused_tokens",
    "recompute_ratio",
    "predictions",
    "selection",
)
#: relative tolerance on every number (float noise across CPUs is ~1e-5 of the value)
REL_TOL = 1e-4
#: what every check adds to its overrides (the selection digest; progress bars off)
CHECK_OVERRIDES = ("progress=false", "+profile.selection_digest=true")
#: the per-layer prefill plan's counts (reuse methods), averaged over samples like metrics.json's means
PLAN_KEYS = ("reused_tokens", "recompute_ratio")
#: a golden file's entry: required and optional keys
REQUIRED = {"name", "overrides"}
OPTIONAL = {"expect", "tolerance", "needs", "note", "also"}


def load_checks(path: Path) -> list[dict[str, Any]]:
    """The checks of ``path``; a malformed entry is a :class:`ConfigError` naming it."""
    import yaml

    if not path.exists():
        raise ConfigError(f"no golden file at {path}", "run from the repository root or pass --golden <file>")
    checks = yaml.safe_load(path.read_text()) or []
    names: set[str] = set()
    for check in checks:
        name = check.get("name", "?")
        missing = REQUIRED - set(check)
        if missing:
            raise ConfigError(f"golden check {name} lacks {', '.join(sorted(missing))}", f"fix {path}")
        unknown = set(check) - REQUIRED - OPTIONAL
        if unknown:
            raise ConfigError(
                f"golden check {name} has unknown key(s) {', '.join(sorted(unknown))}",
                f"use only {', '.join(sorted(REQUIRED | OPTIONAL))} in {path}",
            )
        if name in names:
            raise ConfigError(f"golden check {name} appears twice in {path}", "give every check its own name")
        also = check.get("also", [])
        if not isinstance(also, list) or not all(isinstance(each, dict) and "cpu" in each for each in also):
            raise ConfigError(
                f"golden check {name}'s also is not a list of expectations each naming its cpu",
                f"write also: [{{cpu: <machine>, <key>: <value>, ...}}] in {path} "
                "(or record this CPU's with kvbench check --add-cpu)",
            )
        names.add(name)
    return checks


def predictions_digest(records: list[dict[str, Any]]) -> str:
    """A short digest of every sample's id and prediction (order-independent): any changed token of
    any answer changes it."""
    pairs = sorted((str(r["id"]), json.dumps(_without_floats(r.get("prediction")), sort_keys=True)) for r in records)
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16]


def _without_floats(value: Any) -> Any:
    """``value`` with every float replaced by ``None`` (the structure, strings and ints kept)."""
    if isinstance(value, float):
        return None
    if isinstance(value, dict):
        return {key: _without_floats(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_floats(item) for item in value]
    return value


def selection_digest(records: list[dict[str, Any]]) -> str | None:
    """A short digest of every sample's ``selection_digest`` (order-independent); ``None`` when the
    run recorded none."""
    pairs = sorted(
        (str(r["id"]), str((r.get("telemetry") or {}).get("selection_digest")))
        for r in records
        if (r.get("telemetry") or {}).get("selection_digest") is not None
    )
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()[:16] if pairs else None


def observed(metrics: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The golden values of a finished run: :data:`GOLDEN_KEYS` its metrics report (nulls left out)."""
    values = {key: metrics.get(key) for key in GOLDEN_KEYS if key not in ("predictions", "selection", *PLAN_KEYS)}
    for key in PLAN_KEYS:  # which tokens a reuse method took from its caches and how many it recomputed
        plan = [(r.get("telemetry") or {}).get("prefill", {}).get(key) for r in records]
        plan = [float(v) for v in plan if v is not None]
        values[key] = sum(plan) / len(plan) if plan else None
    values["predictions"] = predictions_digest(records)
    values["selection"] = selection_digest(records)
    return {key: _plain(value) for key, value in values.items() if value is not None}


def _plain(value: Any) -> Any:
    """Numbers as YAML writes them back unchanged (ints stay ints, floats rounded to 10 significant digits)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return float(value)
    return float(f"{value:.10g}") if isinstance(value, float) else int(value)


def compare(metrics: dict[str, Any], expect: dict[str, Any], tolerance: float) -> list[str]:
    """Failure messages (empty when every expected value matches: numbers within ``tolerance``,
    anything else exactly)."""
    failures = []
    for key, want in expect.items():
        got = metrics.get(key)
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            allowed = max(tolerance, REL_TOL * abs(float(want)))
            bad = got is None or not isinstance(got, (int, float)) or abs(float(got) - float(want)) > allowed
            if bad:
                failures.append(f"{key}: got {got}, expected {want} ± {allowed:.3g}")
        elif got != want:
            failures.append(f"{key}: got {got!r}, expected {want!r}")
    return failures


def expectations(check: dict[str, Any]) -> list[dict[str, Any]]:
    """What a check accepts: ``expect``, then ``expect`` with each of ``also``'s overlays (other CPUs)."""
    base = check["expect"]
    return [base] + [{**base, **{k: v for k, v in each.items() if k != "cpu"}} for each in check.get("also", [])]


def compare_any(got: dict[str, Any], check: dict[str, Any]) -> list[str]:
    """No failures when any of :func:`expectations` matches; else ``expect``'s failures (the reference)."""
    tolerance = float(check.get("tolerance", 0.0))
    failures = [compare(got, want, tolerance) for want in expectations(check)]
    return [] if any(not f for f in failures) else failures[0]


def cpu_label() -> str:
    """This machine's CPU as a golden overlay names it: torch's kernel capability and the model name."""
    import torch

    from kvbench.runner import device_name

    return f"{torch.backends.cpu.get_cpu_capability()} {device_name('cpu')}"


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What ``--update`` changes in one check's expected values, one line per key."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            lines.append(f"{key}: {old[key]!r} -> (removed)")
        elif key not in old:
            lines.append(f"{key}: (new) {new[key]!r}")
        elif old[key] != new[key]:
            lines.append(f"{key}: {old[key]!r} -> {new[key]!r}")
    return lines


def write_checks(path: Path, checks: list[dict[str, Any]]) -> None:
    """Rewrite ``path`` with ``checks``, keeping its leading comment block (atomically)."""
    import yaml

    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    order = ("name", "note", "needs", "overrides", "tolerance", "expect", "also")
    body = [{key: check[key] for key in order if key in check} for check in checks]
    text = "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=120)
    from kvbench.results import write_atomic

    write_atomic(path, text)  # a failed write leaves the old file and no temporary one


def run_checks(
    golden: str | None,
    *,
    names: Sequence[str] = (),
    output_dir: str | None = None,
    update: bool = False,
    add_cpu: bool = False,
) -> int:
    """Run the checks ``names`` (default: all) of ``golden``; print one line per check and a total.
    Returns 1 when any check failed (with ``update`` or ``add_cpu``: never; the file is rewritten
    instead: ``update`` replaces ``expect``, ``add_cpu`` adds this CPU's differing values to ``also``)."""
    if update and add_cpu:
        raise ConfigError(
            "--update and --add-cpu do not go together", "record a change with --update, a CPU with --add-cpu"
        )
    record = update or add_cpu
    from kvbench.compose import compose
    from kvbench.results import RunDir
    from kvbench.runner import run
    from kvbench.shared import Sweep

    path = Path(golden) if golden else DEFAULT_GOLDEN
    checks = load_checks(path)
    unknown = set(names) - {c["name"] for c in checks}
    if unknown:
        raise ConfigError(
            f"unknown check(s) {', '.join(sorted(unknown))}",
            f"choose from: {', '.join(c['name'] for c in checks)} (in {path})",
        )
    selected = [c for c in checks if not names or c["name"] in names]
    missing = [c["name"] for c in selected if "expect" not in c]
    if missing and add_cpu:
        raise ConfigError(
            f"golden check(s) {', '.join(missing)} have no expected values to add a CPU to",
            f"record them first with kvbench check --update {' '.join(missing)}",
        )
    if missing and not update:
        raise ConfigError(
            f"golden check(s) {', '.join(missing)} have no expected values yet",
            f"record them with kvbench check --update {' '.join(missing)}",
        )
    configs = [compose(list(c["overrides"]) + list(CHECK_OVERRIDES)) for c in selected]  # every one valid first
    scratch = None if output_dir else Path(tempfile.mkdtemp(prefix="kvbench-check-"))
    out = str(output_dir or scratch)
    failed = skipped = updated = 0
    with Sweep.of(configs) as sweep:
        for check, resolved in zip(selected, configs):
            need = [p for p in check.get("needs", []) if not Path(p).exists()]
            if need:
                print(f"skip {check['name']}  (needs {', '.join(need)})")
                skipped += 1
                continue
            summary = run({**resolved, "output_dir": out}, sweep=sweep)
            got = observed(summary.metrics, RunDir(summary.run_dir).records())
            if record:
                updated += _record(check, got, add_cpu=add_cpu)
                continue
            problems = compare_any(got, check)
            print(
                f"{'FAIL' if problems else 'ok':4} {check['name']}  ({summary.run_dir})"
                + "".join(f"\n     {p}" for p in problems)
            )
            failed += bool(problems)
    if record:
        write_checks(path, checks)
        print(
            f"{updated} check(s) changed, {len(selected) - skipped - updated} unchanged, {skipped} skipped; "
            f"wrote {path}"
        )
    else:
        print(f"{len(selected) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    if scratch is not None and not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    elif scratch is not None:
        print(f"the failed runs are in {scratch}")
    return 1 if failed else 0


def _record(check: dict[str, Any], got: dict[str, Any], *, add_cpu: bool) -> bool:
    """Record ``got`` in ``check`` and print what changed; whether anything did. ``add_cpu``: as one
    more overlay of ``also`` (nothing when an accepted expectation already matches); else as ``expect``,
    dropping ``also``'s overlays when the values change (they recorded the old behaviour)."""
    name = check["name"]
    if add_cpu:
        if not compare_any(got, check):
            print(f"same {name}")
            return False
        tolerance = float(check.get("tolerance", 0.0))
        expect = check["expect"]
        moved = {k: v for k, v in got.items() if k not in expect or compare({k: v}, {k: expect[k]}, tolerance)}
        overlay = {"cpu": cpu_label(), **moved}
        check["also"] = [*check.get("also", []), overlay]
        print(f"cpu  {name}" + "".join(f"\n     {k}: {v!r}" for k, v in overlay.items()))
        return True
    diff = changes(check.get("expect", {}), got)
    check["expect"] = got
    if diff and check.pop("also", None):
        diff.append("also: dropped the other CPUs' values (re-record them there with kvbench check --add-cpu)")
    print(f"{'new ' if diff else 'same'} {name}" + "".join(f"\n     {d}" for d in diff))
    return bool(diff)
