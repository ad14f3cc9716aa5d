from pathlib import Path

import pytest
import torch
import yaml

from kvbench.check import compare, run_checks
from kvbench.errors import ConfigError


def test_compare():
    assert compare({"score": 50.0}, {"score": 50.2}, 0.5) == []
    assert compare({"score": 50.0}, {"score": 51}, 0.5) == ["score: got 50.0, expected 51 ± 0.5"]
    assert compare({}, {"recall": 1.0}, 0.0)
    # last-bit float noise across CPUs passes (1e-4 of the value), a real change does not
    assert compare({"recall": 0.607133059}, {"recall": 0.6071322017}, 0.0) == []
    assert compare({"recall": 0.6072}, {"recall": 0.6071322017}, 0.0)


def test_predictions_digest_ignores_float_noise_not_text():
    from kvbench.check import predictions_digest

    ppl = [{"id": "a", "prediction": {"ppl": 87.4536, "nll": [3.32461, 10.12236], "tokens": 2}}]
    noisy = [{"id": "a", "prediction": {"ppl": 87.4541, "nll": [3.32462, 10.12236], "tokens": 2}}]
    assert predictions_digest(ppl) == predictions_digest(noisy)
    assert predictions_digest([{"id": "a", "prediction": "eat a sandwich"}]) != predictions_digest(
        [{"id": "a", "prediction": "eat a sandwich."}]
    )


def test_checks_pass_and_fail(tmp_path, capsys):
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "e.txt").write_text("Some essay text about work. " * 300)
    common = [
        "model=tiny_llama",
        "task=niah",
        "task.lengths=[600]",
        "task.depths=[0.5]",
        "task.max_new_tokens=4",
        f"task.data_dir={essays}",
    ]
    golden = tmp_path / "checks.yaml"
    golden.write_text(
        yaml.safe_dump(
            [
                {"name": "counts", "overrides": common, "expect": {"n": 1}},
                {"name": "impossible", "overrides": common, "expect": {"score": 123.0}, "tolerance": 0.1},
            ]
        )
    )
    assert run_checks(str(golden), names=["counts"], output_dir=str(tmp_path / "runs")) == 0
    assert run_checks(str(golden), output_dir=str(tmp_path / "runs")) == 1
    out = capsys.readouterr().out
    assert "FAIL impossible" in out and "1 passed, 1 failed" in out


def _golden_choices(group: str) -> set[str]:
    """The ``<group>=`` choices the shipped golden file runs (a check without ``task=`` runs niah)."""
    from kvbench.check import DEFAULT_GOLDEN, load_checks

    root = Path(__file__).resolve().parents[1]
    chosen = set()
    for check in load_checks(root / DEFAULT_GOLDEN):
        values = [o.split("=", 1)[1] for o in check["overrides"] if o.startswith(f"{group}=")]
        chosen.update(values or (["niah"] if group == "task" else []))
    return chosen


def test_every_registered_method_and_task_has_a_golden_check():
    """CI's regression guard covers the whole registry: a new method or task needs its golden check
    (add the entry to results/golden/checks.yaml and record it with `kvbench check --update <name>`)."""
    from kvbench.methods import available_methods
    from kvbench.tasks import available_tasks

    assert set(available_methods()) - _golden_choices("method") == set()
    assert set(available_tasks()) - _golden_choices("task") == set()


def test_shipped_goldens_all_have_expected_values():
    from kvbench.check import DEFAULT_GOLDEN, GOLDEN_KEYS, load_checks

    for check in load_checks(Path(__file__).resolve().parents[1] / DEFAULT_GOLDEN):
        assert check.get("expect"), check["name"]
        assert {"score", "n", "predictions"} <= set(check["expect"]) <= set(GOLDEN_KEYS), check["name"]


def test_compare_strings_and_digest():
    from kvbench.check import predictions_digest

    records = [{"id": "a", "prediction": "x"}, {"id": "b", "prediction": "y"}]
    digest = predictions_digest(records)
    assert digest == predictions_digest(records[::-1])  # order-independent
    assert digest != predictions_digest([{"id": "a", "prediction": "x"}, {"id": "b", "prediction": "y "}])
    assert compare({"predictions": digest}, {"predictions": digest}, 0.0) == []
    assert compare({"predictions": "0"}, {"predictions": digest}, 1.0) == [f"predictions: got '0', expected {digest!r}"]


def test_update_records_then_detects_a_change(tmp_path, capsys):
    """--update writes what the run produces and prints it; repeating it changes nothing; a change of
    behaviour (here the sink count StreamingLLM keeps) makes the check fail and keeps the runs."""
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "e.txt").write_text("Some essay text about work and life. " * 200)
    golden = tmp_path / "checks.yaml"
    golden.write_text(
        "# header kept\n"
        + yaml.safe_dump(
            [
                {
                    "name": "stream",
                    "overrides": [
                        "model=tiny_llama",
                        "method=streamingllm",
                        "task=niah",
                        "task.lengths=[400]",
                        "task.depths=[0.5]",
                        "task.max_new_tokens=6",
                        f"task.data_dir={essays}",
                        "budget.tokens=64",
                        "budget.sink=4",
                    ],
                }
            ]
        )
    )
    with pytest.raises(ConfigError, match="no expected values"):
        run_checks(str(golden))
    assert run_checks(str(golden), update=True) == 0
    out = capsys.readouterr().out
    assert "new  stream" in out and "predictions: (new)" in out
    text = golden.read_text()
    assert text.startswith("# header kept\n")
    expect = yaml.safe_load(text)[0]["expect"]
    assert expect["n"] == 1 and expect["prompt_tokens"] == 400.0 and len(expect["predictions"]) == 16
    assert run_checks(str(golden)) == 0
    assert run_checks(str(golden), update=True) == 0 and "same stream" in capsys.readouterr().out
    # a different budget is a different behaviour: the check fails and names what moved
    golden.write_text(text.replace("budget.sink=4", "budget.sink=16"))
    assert run_checks(str(golden)) == 1
    out = capsys.readouterr().out
    assert "FAIL stream" in out and "the failed runs are in" in out


def test_needs_skips_and_bad_entries(tmp_path, capsys):
    golden = tmp_path / "checks.yaml"
    golden.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "x",
                    "needs": [str(tmp_path / "absent")],
                    "expect": {"n": 1},
                    "overrides": ["model=tiny_llama", "task=niah"],
                }
            ]
        )
    )
    assert run_checks(str(golden)) == 0
    assert "skip x" in capsys.readouterr().out
    golden.write_text(yaml.safe_dump([{"name": "x", "overides": []}]))
    with pytest.raises(ConfigError, match="lacks overrides"):
        run_checks(str(golden))
    golden.write_text(yaml.safe_dump([{"name": "x", "overrides": [], "expected": {}}]))
    with pytest.raises(ConfigError, match="unknown key"):
        run_checks(str(golden))


def _snapkv_check(tmp_path: Path) -> list[str]:
    """A smoke SnapKV config on the tiny model and an essay in ``tmp_path`` (its selection is recorded)."""
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "e.txt").write_text("Some essay text about work and life. " * 200)
    return [
        "model=tiny_llama",
        "method=snapkv",
        "task=niah",
        "task.lengths=[400]",
        "task.depths=[0.5]",
        "task.max_new_tokens=4",
        f"task.data_dir={essays}",
        "budget.tokens=64",
    ]


def test_selection_digest_catches_a_changed_selection(tmp_path, capsys):
    """The checks record which positions every layer keeps and attends: SnapKV's observation window
    16 instead of 32 keeps other tokens, and the check names ``selection`` among what moved."""
    overrides = _snapkv_check(tmp_path)
    golden = tmp_path / "checks.yaml"
    golden.write_text(yaml.safe_dump([{"name": "snap", "overrides": overrides}]))
    assert run_checks(str(golden), update=True) == 0
    expect = yaml.safe_load(golden.read_text())[0]["expect"]
    assert len(expect["selection"]) == 16
    assert run_checks(str(golden)) == 0
    capsys.readouterr()
    golden.write_text(golden.read_text().replace("budget.tokens=64", "budget.tokens=64, method.window=16"))
    assert run_checks(str(golden)) == 1
    assert "selection: got" in capsys.readouterr().out


def test_selection_digest_counts_sets_not_slot_order():
    from kvbench.telemetry import Clock, Telemetry

    def digest(rows):
        t = Telemetry(1, Clock(torch.device("cpu")))
        t.digest_positions("kept", 0, torch.tensor(rows))
        return t.summary()["selection_digest"]

    assert digest([[3, 1, 2], [5, 4, 0]]) == digest([[1, 2, 3], [0, 4, 5]])
    assert digest([[3, 1, 2], [5, 4, 0]]) != digest([[3, 1, 2], [5, 4, 6]])
    assert digest([[3, 1, 2], [5, 4, 0]]) != digest([[5, 4, 0], [3, 1, 2]])  # heads stay apart


def test_other_cpus_values_are_accepted_key_for_key():
    """``also`` lays each CPU's values over ``expect``: a check passes on one recorded CPU's whole set,
    never on a mix of two CPUs' values."""
    from kvbench.check import compare_any

    check = {
        "expect": {"n": 1, "recall": 0.5, "selection": "a" * 16},
        "also": [{"cpu": "AVX512 x", "recall": 0.4, "selection": "b" * 16}],
    }
    assert compare_any({"n": 1, "recall": 0.5, "selection": "a" * 16}, check) == []
    assert compare_any({"n": 1, "recall": 0.4, "selection": "b" * 16}, check) == []
    mixed = compare_any({"n": 1, "recall": 0.5, "selection": "b" * 16}, check)
    assert mixed == [f"selection: got {'b' * 16!r}, expected {'a' * 16!r}"]  # expect's failures reported
    assert compare_any({"n": 2, "recall": 0.4, "selection": "b" * 16}, check)  # the overlay keeps expect's n


def test_add_cpu_records_an_overlay_and_update_drops_it(tmp_path, capsys):
    """A check recorded on another CPU (here: a selection digest this machine does not reproduce) fails;
    --add-cpu keeps ``expect`` and adds this machine's differing values under its CPU's name, after which
    the check passes; --add-cpu again changes nothing; --update of a changed behaviour drops the overlay."""
    overrides = _snapkv_check(tmp_path)
    golden = tmp_path / "checks.yaml"
    golden.write_text(yaml.safe_dump([{"name": "snap", "overrides": overrides}]))
    with pytest.raises(ConfigError, match="record them first"):
        run_checks(str(golden), add_cpu=True)
    assert run_checks(str(golden), update=True) == 0
    here = yaml.safe_load(golden.read_text())[0]["expect"]
    elsewhere = {**here, "selection": "0123456789abcdef"}
    golden.write_text(yaml.safe_dump([{"name": "snap", "overrides": overrides, "expect": elsewhere}]))
    assert run_checks(str(golden)) == 1
    capsys.readouterr()
    assert run_checks(str(golden), add_cpu=True) == 0
    assert "cpu  snap" in capsys.readouterr().out
    entry = yaml.safe_load(golden.read_text())[0]
    assert entry["expect"] == elsewhere  # the other CPU's values stay
    assert set(entry["also"][0]) == {"cpu", "selection"} and entry["also"][0]["selection"] == here["selection"]
    assert run_checks(str(golden)) == 0
    assert run_checks(str(golden), add_cpu=True) == 0 and "same snap" in capsys.readouterr().out
    assert len(yaml.safe_load(golden.read_text())[0]["also"]) == 1
    golden.write_text(golden.read_text().replace("budget.tokens=64", "budget.tokens=64, method.window=16"))
    assert run_checks(str(golden)) == 1
    assert run_checks(str(golden), update=True) == 0
    assert "dropped the other CPUs' values" in capsys.readouterr().out
    assert "also" not in yaml.safe_load(golden.read_text())[0]
    with pytest.raises(ConfigError, match="do not go together"):
        run_checks(str(golden), update=True, add_cpu=True)
    golden.write_text(yaml.safe_dump([{"name": "snap", "overrides": overrides, "expect": here, "also": [{"x": 1}]}]))
    with pytest.raises(ConfigError, match="naming its cpu"):
        run_checks(str(golden))
