import yaml

from kvbench.check import compare, run_checks


def test_compare():
    assert compare({"score": 50.0}, {"score": 50.2}, 0.5) == []
    assert compare({"score": 50.0}, {"score": 51}, 0.5) == ["score: got 50.0, expected 51 ± 0.5"]
    assert compare({}, {"recall": 1.0}, 0.0)


def test_checks_pass_and_fail(tmp_path, capsys):
    essays = tmp_path / "essays"
    essays.mkdir()
    (essays / "e.txt").write_text("Some essay text about work. " * 300)
    common = ["model=tiny_llama", "task=niah", "task.lengths=[600]", "task.depths=[0.5]", "task.max_new_tokens=4",
              f"task.data_dir={essays}"]
    golden = tmp_path / "checks.yaml"
    golden.write_text(yaml.safe_dump([
        {"name": "counts", "overrides": common, "expect": {"n": 1}},
        {"name": "impossible", "overrides": common, "expect": {"score": 123.0}, "tolerance": 0.1},
    ]))
    assert run_checks(str(golden), names=["counts"], output_dir=str(tmp_path / "runs")) == 0
    assert run_checks(str(golden), output_dir=str(tmp_path / "runs")) == 1
    out = capsys.readouterr().out
    assert "FAIL impossible" in out and "1 passed, 1 failed" in out
