"""Run directories stay trustworthy: readers never write, one writer per directory, the recorded config
is the truth."""

import json
import threading
import time

import pytest
import yaml

from kvbench.errors import ConfigError
from kvbench.results import RunDir, RunLock, RunLocked, load
from kvbench.runner import run


def lines_of(path):
    return path.read_bytes().split(b"\n")


def test_reading_a_damaged_middle_line_changes_nothing_and_names_the_line(tmp_path, niah_config, capsys):
    run_dir = run(niah_config()).run_dir
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    lines[1] = lines[1][:40] + "\n"  # damaged in the middle (and a torn tail after the last line)
    samples.write_text("".join(lines) + lines[3][:25])
    before = samples.read_bytes()
    capsys.readouterr()

    records = RunDir(run_dir).records()
    frame = load(run_dir.parent, samples=True)
    table = load(run_dir.parent)

    assert samples.read_bytes() == before, "a reader modified samples.jsonl"
    ids = [json.loads(line)["id"] for i, line in enumerate(lines) if i != 1]
    assert [r["id"] for r in records] == ids and sorted(frame["id"]) == sorted(ids)
    err = capsys.readouterr().err
    assert f"{samples}:2: damaged line skipped" in err and err.count("damaged line") == 1  # once, and no tail noise
    assert table["status"].iloc[0] == "unfinished 3/4"  # the damaged sample runs again on resume


def test_the_writer_drops_only_a_torn_last_line(tmp_path, niah_config, capsys):
    cfg = niah_config()
    run_dir = run(cfg).run_dir
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    damaged = lines[0][:30] + "\n"
    samples.write_text(damaged + "".join(lines[1:3]) + lines[3][:50])  # damaged first line, torn last line

    resumed = run(cfg)

    assert resumed.ran == 2  # the two unreadable samples ran again
    after = samples.read_text().splitlines(keepends=True)
    assert after[:3] == [damaged, lines[1], lines[2]], "the writer touched more than the torn tail"
    ids = [json.loads(line)["id"] for line in after[3:]]
    assert sorted(ids) == sorted(json.loads(lines[i])["id"] for i in (0, 3))
    assert resumed.metrics["n"] == 4
    assert "dropped a torn last line" in (run_dir / "run.log").read_text()


def test_a_sample_recorded_twice_counts_once_first_record_wins(tmp_path, niah_config):
    run_dir = run(niah_config()).run_dir
    samples = run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    later = json.loads(lines[0])
    later["score"] = -1.0
    samples.write_text("".join(lines) + json.dumps(later) + "\n")
    records = RunDir(run_dir).records()
    assert len(records) == 4 and records[0]["score"] != -1.0
    again = run(niah_config())
    assert again.ran == 0 and again.metrics["n"] == 4


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path, niah_config):
    cfg = niah_config()
    first = run(cfg)
    samples = first.run_dir / "samples.jsonl"
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines[:2]))
    before = samples.read_bytes()
    holder = RunDir(first.run_dir)
    with holder.lock(command="kvbench run test-holder"):
        with pytest.raises(RunLocked) as refused:
            run(cfg)
        assert samples.read_bytes() == before, "the refused run wrote samples"
        message = str(refused.value)
        assert str(first.run_dir) in message and "test-holder" in message and "pid " in message and "--wait" in message
        assert load(tmp_path / "runs")["status"].iloc[0] == "running 2/4"
    resumed = run(cfg)
    ids = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert resumed.ran == 2 and len(ids) == len(set(ids)) == 4
    assert not RunLock(first.run_dir).path.exists(), "the lock file outlived the run"


def test_wait_queues_behind_the_holder(tmp_path, niah_config, capsys):
    cfg = niah_config()
    run_dir = run(cfg).run_dir
    lock = RunLock(run_dir)
    lock.acquire(wait=False)
    released = []

    def release_later():
        time.sleep(1.0)
        released.append(time.perf_counter())
        lock.release()

    thread = threading.Thread(target=release_later)
    thread.start()
    summary = run(cfg, wait=True)
    thread.join()
    assert released and time.perf_counter() >= released[0] and summary.metrics["n"] == 4
    assert "kvbench: waiting for pid" in capsys.readouterr().err


def test_an_edited_config_is_refused_before_the_model_loads(tmp_path, niah_config, monkeypatch):
    cfg = niah_config()
    run_dir = run(cfg).run_dir
    samples = run_dir / "samples.jsonl"
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:2]))  # work left to do
    config = run_dir / "config.yaml"
    edited = yaml.safe_load(config.read_text())
    edited["task"]["max_new_tokens"] = 9
    config.write_text(yaml.safe_dump(edited))
    loads = []
    monkeypatch.setattr("kvbench.models.loading.load_model", lambda *a, **k: loads.append(1))
    before = samples.read_bytes()
    with pytest.raises(
        ConfigError, match=r"records task.max_new_tokens=9 but this run has task.max_new_tokens=4"
    ) as err:
        run(cfg)
    assert "restore" in err.value.fix and str(run_dir) in err.value.fix
    assert not loads and samples.read_bytes() == before


def test_moving_a_run_folder_elsewhere_still_resumes(tmp_path, niah_config):
    """output_dir and progress are not part of a run's identity: they may differ from the record."""
    first = run(niah_config())
    moved = tmp_path / "elsewhere" / first.run_dir.name
    moved.parent.mkdir()
    first.run_dir.rename(moved)
    cfg = niah_config()
    cfg["output_dir"], cfg["progress"] = str(moved.parent), True  # neither is part of the run's identity
    assert run(cfg).ran == 0


def test_status_keeps_total_and_drops_the_keys_of_an_earlier_state(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    run_dir.set_status("running", total=4)
    run_dir.set_status("failed", error="CUDA out of memory")
    assert run_dir.status()["error"] == "CUDA out of memory" and run_dir.status()["total"] == 4
    run_dir.set_status("running")
    run_dir.set_status("finished", total=4)
    status = run_dir.status()
    assert status["state"] == "finished" and status["total"] == 4 and "error" not in status, status
    before = (run_dir.path / "status.json").read_bytes()
    run_dir.set_status("finished", total=4)  # a revisit: nothing changes, nothing is rewritten
    assert (run_dir.path / "status.json").read_bytes() == before
