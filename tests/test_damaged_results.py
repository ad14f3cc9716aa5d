"""Damaged results never stop reading, and faults never leave a wrong state behind.

Readers (``kvbench report``, :func:`kvbench.results.load`) list a damaged run as a row whose status
names what is wrong, keep every other run, and write nothing. The writer, stopped by a full disk, a
read-only folder or SIGTERM, records why in ``status.json`` with the command that resumes, leaves no
temporary file, and that command then finishes the run. Samples are computed by a stand-in (no model
forward pass), so the whole file runs in seconds.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench import cli
from kvbench.results import RunLock, load
from kvbench.runfiles import write_atomic

ROOT = os.geteuid() == 0
FULL_ARGS = ["task.lengths=[600,700]", "task.depths=[0,1]", "task.max_new_tokens=4"]
OTHER = ["method=streamingllm", "budget.token_ratio=0.1"]


class FakeResult:
    """What ``run_sample`` returns, without a forward pass: depth 0 scores 100, depth 1 scores 0."""

    def __init__(self, sample) -> None:
        self.sample = sample
        self.score = 100.0 if sample.meta.get("depth") == 0 else 0.0

    def to_record(self) -> dict:
        meta = dict(self.sample.meta)
        return {
            "id": self.sample.id,
            "prediction": "p",
            "reference": "r",
            "score": self.score,
            "subset": self.sample.subset,
            "meta": meta,
            "telemetry": {"ttft_s": 0.01},
            "budget": {},
        }


def kvbench(args: list[str]) -> int:
    """``kvbench <args>`` in this process: its exit status (a run's error leaves Hydra as SystemExit)."""
    try:
        return cli.main(args)
    except SystemExit as exit:
        return int(exit.code or 0)


def fake_sample(task, sample, *args, **kwargs):
    return FakeResult(sample)


def patch_runs(patch, model) -> None:
    patch.setattr("kvbench.models.loading.load_model", lambda *a, **k: model)
    patch.setattr("kvbench.runner.run_sample", fake_sample)


@pytest.fixture(scope="module")
def essays(tmp_path_factory):
    folder = tmp_path_factory.mktemp("essays")
    (folder / "e.txt").write_text(" ".join(f"Essay sentence {i} is about hackers." for i in range(600)))
    return folder


def run_args(out: Path, essays: Path, *extra: str) -> list[str]:
    return ["run", "model=tiny_llama", f"output_dir={out}", "progress=false", f"task.data_dir={essays}"] + [
        *FULL_ARGS,
        *extra,
    ]


@pytest.fixture(scope="module")
def template(tmp_path_factory, essays, tiny_llama):
    """Two finished 4-sample NIAH runs (full; streamingllm), made once and copied by each test."""
    out = tmp_path_factory.mktemp("template") / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch_runs(patch, tiny_llama)
        assert kvbench(run_args(out, essays)) == 0
        assert kvbench(run_args(out, essays, *OTHER)) == 0
    return out


@pytest.fixture
def runs(tmp_path, template):
    """A copy of the template's runs: ``runs.full`` and ``runs.other`` are the two run folders."""
    folder = tmp_path / "runs"
    shutil.copytree(template, folder)
    found = sorted(p for p in folder.iterdir() if p.is_dir())
    full = next(p for p in found if "-full-" in p.name)
    other = next(p for p in found if "-streamingllm-" in p.name)
    return folder, full, other


@pytest.fixture
def fakes(monkeypatch, tiny_llama):
    patch_runs(monkeypatch, tiny_llama)


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (hidden ones too): its bytes and modification time."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def report(folder: Path, capsys, *extra: str) -> tuple[int, dict[str, dict[str, str]], str]:
    """``kvbench report``: exit status, rows by run folder name (via the method column), stderr."""
    capsys.readouterr()
    code = cli.main(["report", str(folder), *extra])
    out, err = capsys.readouterr()
    lines = [line.strip("|").split(" | ") for line in out.strip().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0]] if lines else []
    rows = [dict(zip(header, (cell.strip() for cell in row))) for row in lines[2:]]
    assert "Traceback" not in out + err
    return code, {row.get("method", "?"): row for row in rows}, err


def read_report(folder: Path, capsys) -> tuple[dict[str, dict[str, str]], str]:
    """Report ``folder`` (exit 0, no traceback) and check that reading rewrote nothing."""
    before = snapshot(folder)
    code, rows, err = report(folder, capsys)
    assert code == 0, err
    assert snapshot(folder) == before, "reading modified a file"
    return rows, err


def other_is_intact(rows) -> None:
    row = rows["streamingllm"]
    assert (row["status"], row["n"], row["score"]) == ("finished", "4", "50"), row


# ---------------------------------------------------------------------- reading damaged runs
@pytest.mark.parametrize(
    "content, what",
    [
        (b'{"score": 50, "n": ', "metrics.json is not JSON"),
        (b"", "metrics.json is empty"),
        (b"[1, 2]", "metrics.json is not a JSON object"),
        (b"\xff\xfe\x00garbage", "metrics.json is not JSON"),
    ],
    ids=["truncated", "empty", "not-an-object", "binary"],
)
def test_a_damaged_metrics_file_is_a_row_with_metrics_recomputed(runs, capsys, content, what):
    folder, full, _ = runs
    (full / "metrics.json").write_bytes(content)
    rows, _ = read_report(folder, capsys)
    row = rows["full"]
    assert row["status"] == f"damaged: {what}; metrics recomputed from samples.jsonl"
    assert (row["n"], row["score"]) == ("4", "50")  # recomputed from the four samples
    other_is_intact(rows)


@pytest.mark.parametrize(
    "content, what",
    [
        (b"\x00\x01not json", "status.json is not JSON"),
        (b'"finished"', "status.json is not a JSON object"),
        (b'{"state": "finished", "total": "four"}', "status.json total 'four' is not a count"),
    ],
    ids=["garbage", "a-string", "bad-total"],
)
def test_a_damaged_status_file_is_a_row_naming_it(runs, capsys, content, what):
    folder, full, _ = runs
    (full / "status.json").write_bytes(content)
    rows, _ = read_report(folder, capsys)
    assert rows["full"]["status"] == f"damaged: {what}"
    other_is_intact(rows)


def test_a_folder_without_config_is_listed_as_damaged_not_dropped(runs, capsys):
    folder, full, other = runs
    (full / "config.yaml").unlink()
    rows, _ = read_report(folder, capsys)
    assert rows["–"]["status"] == f"damaged: config.yaml missing ({full.name})"  # no method known: "–"
    other_is_intact(rows)
    shutil.rmtree(other)  # alone, it is still a run: not "no runs found"
    rows, _ = read_report(folder, capsys)
    assert list(rows) == ["–"] and rows["–"]["status"] == f"damaged: config.yaml missing ({full.name})"


def test_a_config_that_is_not_yaml_is_damaged(runs, capsys):
    folder, full, _ = runs
    (full / "config.yaml").write_text("model: {name: [unclosed\n")
    rows, _ = read_report(folder, capsys)
    assert rows["–"]["status"] == f"damaged: config.yaml is not YAML ({full.name})"
    other_is_intact(rows)


def test_metrics_that_cannot_be_recomputed_are_left_out(runs, capsys):
    folder, full, _ = runs
    (full / "config.yaml").unlink()
    (full / "metrics.json").write_text("{")
    rows, _ = read_report(folder, capsys)
    assert rows["–"]["status"] == f"damaged: config.yaml missing ({full.name})" and rows["–"]["score"] == "–"
    other_is_intact(rows)


def test_a_torn_samples_file_shows_metrics_of_the_samples_it_holds(runs, capsys):
    """A torn last line with the metrics of all 4 samples: the row counts 3, scores the 3 (not n=4)."""
    folder, full, _ = runs
    samples = full / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:3]) + lines[3][:30])
    kept = [json.loads(line)["score"] for line in lines[:3]]
    rows, _ = read_report(folder, capsys)
    row = rows["full"]
    assert (row["status"], row["n"]) == ("unfinished 3/4", "3")
    assert float(row["score"]) == pytest.approx(sum(kept) / 3, abs=0.01) and sum(kept) / 3 != 50
    other_is_intact(rows)


def test_samples_added_by_hand_make_the_run_stale_and_recounted(runs, capsys):
    folder, full, _ = runs
    samples = full / "samples.jsonl"
    extra = {**json.loads(samples.read_text().splitlines()[0]), "id": "extra", "score": 0.0}
    with open(samples, "a") as handle:
        handle.write(json.dumps(extra) + "\n")
    rows, _ = read_report(folder, capsys)
    assert (rows["full"]["status"], rows["full"]["n"], rows["full"]["score"]) == ("stale", "5", "40")
    other_is_intact(rows)


@pytest.mark.skipif(ROOT, reason="root reads files whatever their permissions")
def test_an_unreadable_samples_file_is_damaged(runs, capsys):
    folder, full, _ = runs
    (full / "samples.jsonl").chmod(0)
    try:
        rows, _ = read_report(folder, capsys)
    finally:
        (full / "samples.jsonl").chmod(0o644)
    assert rows["full"]["status"] == "damaged: samples.jsonl unreadable (Permission denied)"
    other_is_intact(rows)


def test_load_keeps_every_run_and_marks_the_damaged_one(runs):
    folder, full, other = runs
    (full / "status.json").write_text("{oops")
    before = snapshot(folder)
    frame = load(folder).set_index("run_id")
    assert frame.loc[full.name, "state"] == "damaged"
    assert frame.loc[full.name, "status"] == "damaged: status.json is not JSON"
    assert frame.loc[other.name, "state"] == "finished" and frame.loc[other.name, "score"] == 50
    samples = load(folder, samples=True)
    assert sorted(samples["run_id"].value_counts().items()) == sorted([(full.name, 4), (other.name, 4)])
    assert snapshot(folder) == before


def test_a_pivot_leaves_a_damaged_run_out_and_says_so(runs, capsys):
    folder, full, _ = runs
    (full / "metrics.json").write_text("not json")
    before = snapshot(folder)
    code, rows, err = report(folder, capsys, "--pivot", "method", "")
    assert code == 0 and list(rows) == ["streamingllm"]
    assert "left out 1 run(s) that are not finished (damaged: metrics.json is not JSON" in err
    assert snapshot(folder) == before


def test_diff_reads_a_damaged_run(runs, capsys):
    folder, full, other = runs
    (full / "metrics.json").write_text("{")
    before = snapshot(folder)
    capsys.readouterr()
    assert cli.main(["report", "--diff", str(full), str(other)]) == 0
    out = capsys.readouterr().out
    assert "| config.method.name | full | streamingllm |" in out
    assert snapshot(folder) == before


# ---------------------------------------------------------------------- locks
def write_lock(run: Path, pid: int, host: str) -> Path:
    lock = RunLock(run).path
    lock.write_text(json.dumps({"pid": pid, "host": host, "started": "2024-01-01T00:00:00+00:00", "command": "x"}))
    return lock


def test_a_lock_from_another_host_is_stale_and_said_once(runs, capsys):
    folder, full, _ = runs
    lock = write_lock(full, 12345, "some-other-node")
    rows, err = read_report(folder, capsys)
    assert rows["full"]["status"] == "finished"  # not "running" forever
    notes = [line for line in err.splitlines() if "stale lock" in line]
    assert notes == [
        f"kvbench: warning: stale lock {lock}: written by pid 12345 on some-other-node since "
        "2024-01-01T00:00:00+00:00 (another host), held by no process; the next run replaces it"
    ]
    other_is_intact(rows)


def test_a_lock_of_a_dead_pid_is_stale(runs, capsys):
    folder, full, _ = runs
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    import socket

    write_lock(full, child.pid, socket.gethostname())
    rows, err = read_report(folder, capsys)
    assert rows["full"]["status"] == "finished"
    assert f"written by pid {child.pid} on {socket.gethostname()}" in err and "(exited)" in err


def test_a_held_lock_reads_as_running_whatever_it_records(runs, capsys):
    folder, full, _ = runs
    lock = RunLock(full)
    lock.acquire(wait=False)
    try:
        lock.path.write_text(json.dumps({"pid": 1, "host": "some-other-node"}))  # the kernel's lock decides
        rows, err = read_report(folder, capsys)
    finally:
        lock.release()
    assert rows["full"]["status"] == "running 4/4" and "stale" not in err


def test_a_foreign_stale_lock_does_not_stop_a_resume(runs, essays, fakes, capsys):
    folder, full, _ = runs
    lock = write_lock(full, 12345, "some-other-node")
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "stale lock" in line] == [
        f"kvbench: warning: stale lock {lock}: written by pid 12345 on some-other-node since "
        "2024-01-01T00:00:00+00:00 (another host), held by no process; replaced"
    ]
    assert not lock.exists()


# ---------------------------------------------------------------------- faults while writing
def unfinish(run: Path, keep: int) -> None:
    samples = run / "samples.jsonl"
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:keep]))
    (run / "metrics.json").unlink()
    (run / "status.json").write_text(json.dumps({"state": "interrupted", "total": 4}))


def tmp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.tmp")]


def resume_finishes(folder: Path, run: Path, essays: Path, capsys, *extra: str) -> None:
    """The recorded resume command finishes the run: exit 0, four samples, each once, state finished."""
    capsys.readouterr()
    code = kvbench(run_args(folder, essays, *extra))
    assert code == 0, capsys.readouterr().err
    ids = [json.loads(line)["id"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 4
    assert json.loads((run / "status.json").read_text())["state"] == "finished"


def full_disk(names: tuple[str, ...]):
    """A stand-in for ``_write_file`` on a full disk: the new file is created, its bytes are not."""

    def write(path: Path, text: str) -> None:
        if any(name in path.name for name in names):
            path.touch()  # what open() leaves before the write fails
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, text)

    from kvbench import runfiles

    real = runfiles._write_file
    return write


def test_a_full_disk_at_the_metrics_stops_with_every_sample_saved(runs, essays, fakes, monkeypatch, capsys):
    folder, full, other = runs
    unfinish(full, keep=2)
    untouched = snapshot(other)
    monkeypatch.setattr("kvbench.runfiles._write_file", full_disk(("metrics",)))
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    command = "kvbench run " + shlex.join(run_args(folder, essays)[1:])
    assert err[-1] == (
        f"kvbench: error: cannot write {full / '.metrics.json.tmp'}: No space left on device; 4 of 4 samples are "
        f"saved in {full} (fix: free space on that disk, then run `{command}` again: it resumes after them)"
    )
    status = json.loads((full / "status.json").read_text())
    assert (status["state"], status["reason"], status["resume"]) == ("stopped", "disk full", command)
    assert tmp_files(folder) == [], "a zero-byte temporary file was left behind"
    rows, _ = read_report(folder, capsys)
    assert rows["full"]["status"] == "stopped 4/4 (disk full)"
    assert snapshot(other) == untouched
    monkeypatch.undo()
    patch_runs(monkeypatch, None)  # nothing to compute: the resume needs no model
    resume_finishes(folder, full, essays, capsys)


def test_a_full_disk_for_every_new_file_still_records_the_stop(runs, essays, fakes, monkeypatch, capsys):
    """No new file can be written: status.json is rewritten in place (its blocks exist already)."""
    folder, full, _ = runs
    unfinish(full, keep=4)
    monkeypatch.setattr("kvbench.runfiles._write_file", full_disk((".tmp",)))
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 2
    assert "No space left on device; 4 of 4 samples are saved" in capsys.readouterr().err
    status = json.loads((full / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("stopped", "disk full")
    assert tmp_files(folder) == []
    monkeypatch.undo()
    resume_finishes(folder, full, essays, capsys)


def test_a_full_disk_mid_append_keeps_the_saved_samples(runs, essays, fakes, monkeypatch, capsys):
    folder, full, _ = runs
    unfinish(full, keep=1)
    from kvbench import results

    real, calls = results._append_line, []

    def append(path: Path, line: str) -> None:
        calls.append(line)
        if len(calls) == 2:
            with open(path, "a") as handle:
                handle.write(line[:20])  # the part a full disk took
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, line)

    monkeypatch.setattr("kvbench.results._append_line", append)
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 2
    assert f"No space left on device; 2 of 4 samples are saved in {full} (fix:" in capsys.readouterr().err
    rows, _ = read_report(folder, capsys)
    assert rows["full"]["status"] == "stopped 2/4 (disk full)"
    monkeypatch.setattr("kvbench.results._append_line", real)
    resume_finishes(folder, full, essays, capsys)


@pytest.mark.skipif(ROOT, reason="root writes to read-only folders")
def test_a_read_only_run_folder_stops_with_the_resume_command(runs, essays, fakes, capsys):
    folder, full, _ = runs
    unfinish(full, keep=2)
    (full / "samples.jsonl").chmod(0o444)
    full.chmod(0o555)
    try:
        capsys.readouterr()
        assert kvbench(run_args(folder, essays)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "\n".join(err)
        assert err[-1].startswith(f"kvbench: error: cannot write {full}") and "Permission denied; 2 of 4" in err[-1]
        assert "(fix: make " in err[-1] and "writable, then run `kvbench run " in err[-1]
        assert tmp_files(folder) == []
    finally:
        full.chmod(0o755)
        (full / "samples.jsonl").chmod(0o644)
    resume_finishes(folder, full, essays, capsys)


@pytest.mark.skipif(ROOT, reason="root writes to read-only folders")
def test_a_read_only_output_folder_is_refused_before_any_work(runs, essays, fakes, capsys):
    folder, full, _ = runs
    unfinish(full, keep=2)
    before = snapshot(folder)
    folder.chmod(0o555)
    try:
        capsys.readouterr()
        assert kvbench(run_args(folder, essays)) == 2
        err = capsys.readouterr().err.strip()
    finally:
        folder.chmod(0o755)
    assert err.startswith(f"kvbench: error: cannot write results under {folder}") and len(err.splitlines()) == 1
    assert snapshot(folder) == before


def sigterm_at(count: int):
    """``run_sample`` that sends this process SIGTERM while computing sample ``count``."""
    calls = []

    def run_sample(task, sample, *args, **kwargs):
        calls.append(sample.id)
        if len(calls) == count:
            os.kill(os.getpid(), signal.SIGTERM)
        return FakeResult(sample)

    return run_sample


def test_sigterm_records_stopped_with_the_resume_command(runs, essays, fakes, monkeypatch, capsys):
    folder, full, other = runs
    unfinish(full, keep=1)
    untouched = snapshot(other)
    monkeypatch.setattr("kvbench.runner.run_sample", sigterm_at(2))
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    command = "kvbench run " + shlex.join(run_args(folder, essays)[1:])
    assert err[-1] == f"kvbench: stopped by SIGTERM: 2 of 4 samples saved in {full}; resume with: {command}"
    status = json.loads((full / "status.json").read_text())
    assert (status["state"], status["reason"], status["resume"]) == ("stopped", "SIGTERM", command)
    assert not RunLock(full).path.exists() and snapshot(other) == untouched
    rows, _ = read_report(folder, capsys)
    assert rows["full"]["status"] == "stopped 2/4 (SIGTERM)"
    monkeypatch.setattr("kvbench.runner.run_sample", fake_sample)
    resume_finishes(folder, full, essays, capsys)


def test_sigterm_during_an_append_waits_for_the_line(runs, essays, fakes, monkeypatch, capsys):
    folder, full, _ = runs
    unfinish(full, keep=1)
    from kvbench import results

    real = results._append_line

    def append(path: Path, line: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-append: held back until the line is whole
        real(path, line)

    monkeypatch.setattr("kvbench.results._append_line", append)
    assert kvbench(run_args(folder, essays)) == 128 + signal.SIGTERM
    lines = (full / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["id"] for line in lines)  # the second line complete
    assert json.loads((full / "status.json").read_text())["state"] == "stopped"


# ---------------------------------------------------------------------- a corrupt status.json never stops the writer
@pytest.mark.parametrize("keep", [2, 4], ids=["samples-left", "all-done"])
def test_a_corrupt_status_never_stops_a_resume(runs, essays, fakes, capsys, keep):
    folder, full, _ = runs
    unfinish(full, keep=keep)
    (full / "status.json").write_bytes(b"\xff[")
    resume_finishes(folder, full, essays, capsys)
    assert "status.json is not JSON: rewritten" in (full / "run.log").read_text()


def test_a_corrupt_status_never_stops_check(tmp_path, essays, fakes, capsys):
    golden = tmp_path / "checks.yaml"
    overrides = ["model=tiny_llama", f"task.data_dir={essays}", *FULL_ARGS]
    golden.write_text(json.dumps([{"name": "tiny", "overrides": overrides, "expect": {"n": 4, "score": 50.0}}]))
    out = tmp_path / "checks"
    args = ["check", "--golden", str(golden), "--output-dir", str(out)]
    assert kvbench(args) == 0
    (status,) = out.glob("*/status.json")
    status.write_bytes(b"\x00 not json")
    capsys.readouterr()
    assert kvbench(args) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines()[-1] == "1 passed, 0 failed, 0 skipped" and "Traceback" not in printed.err
    assert json.loads(status.read_text())["state"] == "finished"


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    target.write_text('{"n": 4}\n')
    monkeypatch.setattr("kvbench.runfiles._write_file", full_disk(("metrics",)))
    with pytest.raises(OSError, match="No space left on device"):
        write_atomic(target, '{"n": 5}\n')
    assert target.read_text() == '{"n": 4}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_read_only_file_system_stops_with_the_resume_command(runs, essays, fakes, monkeypatch, capsys):
    """The read-only case as root sees it too (chmod does not stop root; a read-only mount does)."""
    folder, full, _ = runs
    unfinish(full, keep=2)
    from kvbench.results import _append_line as real_append

    def read_only(path: Path, *args) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr("kvbench.results._append_line", read_only)
    capsys.readouterr()
    assert kvbench(run_args(folder, essays)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"kvbench: error: cannot write {full / 'samples.jsonl'}: Read-only file system; 2 of 4 samples are saved"
    )
    assert f"(fix: make {full / 'samples.jsonl'} writable, then run `kvbench run " in err[-1]
    status = json.loads((full / "status.json").read_text())
    assert (status["state"], status["reason"]) == ("stopped", "read-only file system") and tmp_files(folder) == []
    monkeypatch.setattr("kvbench.results._append_line", real_append)
    resume_finishes(folder, full, essays, capsys)
