"""kvbench reproduce: experiment files, scales, rendering beside the published numbers, paired statistics."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench.errors import ConfigError
from kvbench.experiments import experiment_names, load_experiment, sweeps
from kvbench.papers import get_artifact

from .conftest import kvbench_in_process

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
needs_data = pytest.mark.skipif(not (SHARED_DATA / "longbench" / "full").is_dir(), reason="../shared/data not present")


def kvbench(*args, cwd=REPO):
    """``kvbench <args>`` in this process (see ``kvbench_in_process``); the unknown-artifact test runs a
    real ``python -m kvbench`` for its exit status."""
    return kvbench_in_process(*args, cwd=cwd)


# ---------------------------------------------------------------------- experiment files
def test_at_least_twelve_artifacts_across_the_four_papers():
    names = experiment_names()
    assert len(names) >= 12
    assert {load_experiment(n).paper for n in names} == {"pqcache", "clusterkv", "cacheblend", "cachecraft"}


@pytest.mark.parametrize("name", experiment_names())
def test_experiment_names_a_published_artifact_and_every_scale(name):
    exp = load_experiment(name)
    art = get_artifact(exp.compare)  # raises when results/papers has no such artifact
    assert art.paper == exp.paper
    assert exp.render, "an experiment says how to render it"
    if exp.cannot:
        assert not exp.sweep and not exp.also and sweeps(exp, "paper") == []
        assert all(exp.scale(s).skip == exp.cannot for s in ("smoke", "cpu", "paper"))
    elif exp.bench:
        assert {"smoke", "cpu", "paper"} <= set(exp.scales), "a bench experiment gives options per scale"
    else:
        assert exp.sweep, "hydra.sweeper.params holds the sweep"
        assert all(s[0] == f"+experiment={name}" for s in sweeps(exp, "smoke"))


def test_paper_scale_of_pqcache_table4_runs_the_papers_nine_tasks():
    """Table 4 reports Zh.QA (longbook_qa_chn) and no Code.Debug: the paper scale runs exactly its rows."""
    from kvbench.tasks.infinitebench_protocol import PQCACHE

    paper = load_experiment("pqcache_table4").scale("paper").overrides
    (subsets,) = [o for o in paper if o.startswith("task.subsets=")]
    ran = set(subsets.partition("=")[2].strip("[]").split(","))
    published = {r["dataset"] for r in get_artifact("pqcache/table4").values} - {"average"}
    assert ran == published == set(PQCACHE)
    assert "longbook_qa_chn" in ran and "code_debug" not in ran


def test_list_prints_every_artifact_with_a_description():
    out = kvbench("reproduce", "--list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(experiment_names())
    assert any(line.startswith("pqcache/table3 ") and "question" in line for line in lines)


def test_list_says_why_the_artifacts_nothing_runs_cannot_run(tmp_path):
    """PQCache Tables 5 and 6 and ClusterKV Fig. 13a have published numbers and no kvbench run: the list
    says why beside each, and reproducing one prints the paper's numbers alone with the reason."""
    out = kvbench("reproduce", "--list")
    lines = {line.split()[0]: line for line in out.stdout.strip().splitlines()}
    for ref, why in (("pqcache/table5", "MInference"), ("pqcache/table6", "70B"), ("clusterkv/fig13a", "InfiniGen")):
        assert "cannot run in kvbench" in lines[ref] and why in lines[ref].split("cannot run in kvbench")[1]
        assert lines[ref].endswith("[cannot run]")  # (not tagged as runs)
    done = kvbench("reproduce", "pqcache/table5", f"output_dir={tmp_path / 'runs'}", "--out", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr
    assert "does not run at scale cpu: MInference" in done.stderr
    assert "– / 47.31" in done.stdout and not (tmp_path / "runs").exists()


def test_an_experiment_that_cannot_run_has_no_sweep(tmp_path):
    from kvbench.experiments import _experiment

    body = {"reproduce": {"description": "d", "cannot": "no such system", "render": []}}
    exp = _experiment("pqcache_table5", tmp_path / "pqcache_table5.yaml", body)
    assert exp.description == "d — cannot run in kvbench: no such system" and sweeps(exp, "cpu") == []
    with pytest.raises(ConfigError, match="has no sweep"):
        _experiment(
            "pqcache_table5",
            tmp_path / "pqcache_table5.yaml",
            {**body, "hydra": {"sweeper": {"params": {"method": "full"}}}},
        )
    with pytest.raises(ConfigError, match="must say why"):
        _experiment("pqcache_table5", tmp_path / "x.yaml", {"reproduce": {"description": "d", "cannot": " "}})


def test_unknown_artifact_is_one_line_with_a_suggestion():
    out = subprocess.run(
        [sys.executable, "-m", "kvbench", "reproduce", "pqcache/tabel3"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode != 0
    assert "no experiment 'pqcache/tabel3'" in out.stderr and "pqcache/table3" in out.stderr


@needs_data
@pytest.mark.parametrize("scale", ["smoke", "paper"])
def test_every_experiment_validates(scale, tmp_path, capsys):
    """Every point of every experiment composes and passes `kvbench run`'s checks (paper scale: on
    hub ids and the hub's data, validated only)."""
    import json
    import os

    from kvbench.reproduce import reproduce

    runs = {}
    for name in experiment_names():
        reproduce(name, scale, [f"output_dir={tmp_path}"], dry_run=True)
        # "   missing  <output_dir>/<run id>  <label>": the run ids each experiment plans
        lines = [line.split() for line in capsys.readouterr().out.splitlines()]
        runs[name] = sorted(Path(p[1]).name for p in lines if len(p) > 1 and p[1].startswith(str(tmp_path)))
    assert any(runs.values())
    # an experiment plans the same runs as when the golden was recorded (a new key that renamed them fails;
    # a deliberate change of an experiment: KVBENCH_UPDATE_GOLDEN=1 rewrites the file, say why in the commit)
    golden = REPO / "results" / "golden" / f"experiment_runs-{scale}.json"
    if os.environ.get("KVBENCH_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
    expected = json.loads(golden.read_text())
    changed = {name: (expected.get(name), ids) for name, ids in runs.items() if expected.get(name) != ids}
    assert not changed, f"experiments plan other runs than {golden.name} records: {changed}"


def test_run_with_an_experiment_sweeps_its_params(tmp_path):
    """`kvbench run -m +experiment=X` runs the file's sweep; command-line values replace an axis."""
    base = ["run", "--dry-run", "+experiment=pqcache_table3", "model=tiny_llama", f"output_dir={tmp_path}"]
    if not (SHARED_DATA / "longbench" / "full").is_dir():
        base.append("task.data_dir=null")
    out = kvbench(*base)
    assert out.returncode != 0 and "is a sweep" in out.stderr and "add -m" in out.stderr
    out = kvbench(*base, "-m")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("# run directory:") == 4
    assert "reproduce" not in out.stdout, "the reproduce: block is not part of a run's config"
    out = kvbench(*base, "-m", "method=pqcache,snapkv")
    assert out.stdout.count("# run directory:") == 2


# ---------------------------------------------------------------------- the acceptance path
@pytest.fixture(scope="module")
def table3_smoke(tmp_path_factory):
    """``kvbench reproduce pqcache/table3 scale=smoke`` once for the tests of this module: (folder, result)."""
    tmp_path = tmp_path_factory.mktemp("table3")
    out = kvbench(
        "reproduce",
        "pqcache/table3",
        "scale=smoke",
        f"output_dir={tmp_path / 'runs'}",
        "--out",
        str(tmp_path / "report"),
    )
    return tmp_path, out


@needs_data
def test_table3_smoke_renders_ours_beside_the_paper(table3_smoke):
    tmp_path, out = table3_smoke
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "Runs: 4 of 4 finished" in text
    # the paper's Table 3 numbers beside ours, with the stand-in named
    assert "multifieldqa_zh → multifieldqa_en" in text and "/ 47.99 (" in text
    assert "## protocol differences (scale smoke)" in text and "| model | Llama-3.1-8B | tiny_llama |" in text
    assert "paired against method=full" in text
    assert "## our runs" in text and "| model | method | task |" in text  # only the method varies: no setting
    report = tmp_path / "report"
    assert (report / "report.md").read_text().startswith("# pqcache/table3")
    assert r"\begin{tabular}" in (report / "report.tex").read_text()
    table = pd.read_csv(report / "section-1.csv")
    mine = table[(table["dataset"] == "multifieldqa_zh → multifieldqa_en") & (table["method"] == "pqcache")].iloc[0]
    assert mine["paper"] == pytest.approx(47.99) and mine["delta"] == pytest.approx(mine["ours"] - 47.99)
    # our average is over the one staged set, the paper's over six: both shown, no Δ between them
    row = table[(table["dataset"] == "average") & (table["method"] == "pqcache")].iloc[0]
    assert row["paper"] == pytest.approx(32.44) and math.isnan(row["delta"])
    assert "/ 32.44 (means of 1 and 6 sets)" in text
    # resumable: a second call computes nothing
    again = kvbench(
        "reproduce",
        "pqcache/table3",
        "scale=smoke",
        f"output_dir={tmp_path / 'runs'}",
        "--out",
        str(tmp_path / "report"),
    )
    assert again.returncode == 0 and "[1/" not in again.stdout


# ---------------------------------------------------------------------- rendering pieces
def test_paper_text_and_holds():
    from kvbench.render import holds, paper_text

    assert paper_text({"value": 0.02, "relation": "<="}) == "≤ 0.02"
    assert paper_text({"low": 2.2, "high": 3.3, "relation": "="}) == "2.20–3.30"
    assert holds(2.5, {"low": 2.2, "high": 3.3, "relation": "="}) == "yes"
    assert holds(3.4, {"low": 2.2, "high": 3.3, "relation": "="}) == "no"
    assert holds(0.6, {"value": 0.5, "relation": "<="}) == "no"
    assert holds(2.1, {"value": 2, "relation": ">"}) == "yes"
    assert holds(0.6, {"value": 0.5, "relation": "~"}) == "–"
    assert holds(None, {"value": 0.5, "relation": "<"}) == "–"


# (ours, row, grade): every side's every outcome, and the edges
SIDED_CASES = [
    # at_least over a range ("reduces TTFT by 2.2-3.3x"): below no, inside yes, above exceeds
    (2.0, {"low": 2.2, "high": 3.3, "sided": "at_least"}, "no"),
    (2.2, {"low": 2.2, "high": 3.3, "sided": "at_least"}, "yes"),
    (3.3, {"low": 2.2, "high": 3.3, "sided": "at_least"}, "yes"),
    (4.1, {"low": 2.2, "high": 3.3, "sided": "at_least"}, "exceeds"),
    # inferred at_least from > / >=: a single floor has nothing above it to exceed
    (2.0, {"value": 2, "relation": ">"}, "no"),
    (2.0, {"value": 2, "relation": ">="}, "yes"),
    (9.0, {"value": 2, "relation": ">"}, "yes"),
    # at_most over a range ("no more than 0.01-0.03"): above no, inside yes, below exceeds
    (0.04, {"low": 0.01, "high": 0.03, "relation": "<="}, "no"),
    (0.02, {"low": 0.01, "high": 0.03, "relation": "<="}, "yes"),
    (0.0, {"low": 0.01, "high": 0.03, "relation": "<="}, "exceeds"),
    (0.5, {"value": 0.5, "relation": "<"}, "no"),
    (0.5, {"value": 0.5, "relation": "<="}, "yes"),
    (9.0, {"low": 6, "high": 8, "sided": "at_most"}, "no"),
    (3.0, {"low": 6, "high": 8, "sided": "at_most"}, "exceeds"),
    # up_to ("by up to 2.5x", the best case over the paper's settings): at or below yes, above exceeds
    (1.7, {"value": 2.5, "relation": "<=", "sided": "up_to"}, "yes"),
    (2.5, {"value": 2.5, "relation": "<=", "sided": "up_to"}, "yes"),
    (3.0, {"value": 2.5, "relation": "<=", "sided": "up_to"}, "exceeds"),
    # range: two-sided, even when stated as "about"
    (9.0, {"low": 10, "high": 15, "relation": "~"}, "no"),
    (12.0, {"low": 10, "high": 15, "relation": "~"}, "yes"),
    (16.0, {"low": 10, "high": 15, "relation": "~"}, "no"),
    (4.1, {"low": 2.2, "high": 3.3, "sided": "range"}, "no"),
    # nothing to grade
    (3.0, {"value": 3.0}, "–"),
    (float("nan"), {"low": 2.2, "high": 3.3, "sided": "at_least"}, "–"),
    (3.0, None, "–"),
]


@pytest.mark.parametrize(("ours", "row", "grade"), SIDED_CASES)
def test_holds_grades_a_claim_as_it_is_worded(ours, row, grade):
    from kvbench.render import holds

    assert holds(ours, row) == grade


def test_cacheblends_ttft_range_is_graded_one_sided():
    """4.1x against "reduces TTFT by 2.2-3.3x" exceeds the claim; a two-sided band said "no"."""
    from kvbench.papers import values_frame
    from kvbench.render import holds

    paper = values_frame("cacheblend", "fig12")
    row = paper[(paper.quantity == "ttft_speedup") & (paper.baseline == "full")].iloc[0].to_dict()
    assert row["sided"] == "at_least"
    assert holds(4.1, row) == "exceeds" and holds(2.5, row) == "yes" and holds(1.9, row) == "no"
    assert holds(4.1, {**row, "sided": None}) == "no"  # the band it was graded as before
    up_to = get_artifact("clusterkv/fig12").values
    gain = next(r for r in up_to if r["quantity"] == "decode_throughput_gain")
    assert gain["sided"] == "up_to" and holds(3.0, gain) == "exceeds" and holds(1.5, gain) == "yes"


def test_a_claim_row_may_grade_otherwise_and_the_table_says_how(monkeypatch):
    """An experiment's claim row sets `sided` over the paper's; the claims table shows the side and the grade."""
    from kvbench import render

    exp = load_experiment("cacheblend_fig12")
    runs = pd.DataFrame({"config.model.name": ["m", "m"], "config.method.name": ["full", "cacheblend"]})
    frame = pd.DataFrame(
        {"config.model.name": ["m", "m"], "config.method.name": ["full", "cacheblend"], "ttft_s": [4.1, 1.0]}
    )
    monkeypatch.setattr(render.claims, "long_frame", lambda _runs: frame)
    row = {"quantity": "ttft_speedup", "baseline": "full"}
    ours = {"op": "ratio", "metric": "ttft_s", "a": {"method": "full"}, "b": {"method": "cacheblend"}}
    (section,) = render.render_claims(exp, {"rows": [{**row, "ours": ours}]}, runs)
    shown = section.frame.iloc[0]
    assert (shown["ours"], shown["sided"], shown["holds"]) == ("4.100", "at least", "exceeds")
    (section,) = render.render_claims(exp, {"rows": [{**row, "sided": "range", "ours": ours}]}, runs)
    assert (section.frame.iloc[0]["sided"], section.frame.iloc[0]["holds"]) == ("range", "no")
    assert "sided" not in section.frame.columns[:3].tolist()  # not a key that picks the paper's row
    with pytest.raises(ConfigError, match="sided"):
        render.check_render({"claims": {"rows": [{**row, "sided": "sometimes", "ours": ours}]}})


def test_a_paper_row_with_an_unknown_side_is_refused(tmp_path):
    from kvbench.papers import PaperDataError, load_file

    text = (REPO / "results" / "papers" / "clusterkv.yaml").read_text(encoding="utf-8")
    bad = tmp_path / "clusterkv.yaml"
    bad.write_text(text.replace("sided: up_to", "sided: mostly", 1), encoding="utf-8")
    with pytest.raises(PaperDataError, match="sided must be one of"):
        load_file(bad)


def test_claim_ops_against_hand_computed_values():
    from kvbench.render import claim_value

    frame = pd.DataFrame(
        {
            "config.method.name": ["full", "snapkv", "pyramidkv", "pqcache", "full", "pqcache"],
            "dataset": ["average"] * 4 + ["1024", "1024"],
            "score": [50.0, 40.0, 44.0, 46.2, 10.0, 10.4],
            "ttft_s": [3.0, 1.0, 1.0, 1.2, None, None],
        }
    )
    avg = {"dataset": "average"}
    assert claim_value(
        frame, {"op": "ratio", "metric": "ttft_s", "a": {"method": "full"}, "b": {"method": "pqcache"}}
    ) == pytest.approx(2.5)
    assert claim_value(
        frame,
        {
            "op": "rel_gain_over_best",
            "a": {"method": "pqcache", **avg},
            "among": {"method": ["snapkv", "pyramidkv"], **avg},
        },
    ) == pytest.approx(5.0)
    assert claim_value(
        frame, {"op": "rel_gap", "a": {"method": "pqcache", **avg}, "b": {"method": "full", **avg}}
    ) == pytest.approx(7.6)
    # ClusterKV Fig. 13b's "latency deviations up to 5%": a above b, in % of b (negative when a is below)
    assert claim_value(
        frame, {"op": "rel_diff", "a": {"method": "pqcache", **avg}, "b": {"method": "full", **avg}}
    ) == pytest.approx(-7.6)
    assert claim_value(
        frame, {"op": "rel_diff", "metric": "ttft_s", "a": {"method": "pqcache"}, "b": {"method": "snapkv"}}
    ) == pytest.approx(20.0)
    assert claim_value(
        frame, {"op": "max_diff", "over": "dataset", "a": {"method": "pqcache"}, "b": {"method": "full"}}
    ) == pytest.approx(0.4)
    assert claim_value(frame, {"op": "value", "a": {"method": "snapkv"}, "scale": 0.5}) == pytest.approx(20.0)
    # PQCache's "This difference is 6.36 times smaller than that of other baselines": (a - best) / (a - b)
    gap = {"op": "gap_ratio", "a": {"method": "full", **avg}, "b": {"method": "pqcache", **avg}}
    gap["among"] = {"method": ["snapkv", "pyramidkv"], **avg}
    assert claim_value(frame, gap) == pytest.approx((50.0 - 44.0) / (50.0 - 46.2))
    assert claim_value(frame, {**gap, "b": {"method": "full", **avg}}) is None  # no gap: unbounded, not shown
    # CacheBlend Fig. 16's quality drop: full recompute (no ratio, one run) against every recompute ratio
    ratios = pd.DataFrame(
        {
            "config.method.name": ["full", "cacheblend", "cacheblend"],
            "config.method.recompute_ratio": [None, 0.05, 0.15],
            "score": [21.0, 20.5, 19.0],
        }
    )
    drop = {"op": "max_diff", "over": "recompute_ratio", "a": {"method": "full"}, "b": {"method": "cacheblend"}}
    assert claim_value(ratios, drop) == pytest.approx(2.0)
    assert claim_value(ratios, {**drop, "a": drop["b"], "b": drop["a"]}) == pytest.approx(-0.5)
    assert (
        claim_value(frame, {"op": "ratio", "metric": "ttft_s", "a": {"method": "nope"}, "b": {"method": "full"}})
        is None
    )


def test_a_claim_metric_that_names_no_column_is_refused_with_the_likely_one():
    """A claim reading a column its rows lack printed "–" for ours, as if nothing were measured
    (clusterkv/cache_hit_rate read telemetry.cluster_hit_rate; the samples hold
    telemetry.method.cluster_hit_rate): now it is a config error naming the column that fits."""
    from kvbench.render import check_metric

    samples = pd.DataFrame({"telemetry.method.cluster_hit_rate": [0.8], "telemetry.hit_rate": [0.7], "score": [1.0]})
    check_metric(samples, "telemetry.method.cluster_hit_rate")
    check_metric(samples, "score")
    with pytest.raises(ConfigError, match="telemetry.method.cluster_hit_rate") as refused:
        check_metric(samples, "telemetry.cluster_hit_rate")
    assert "is not a column" in str(refused.value)
    with pytest.raises(ConfigError, match="^curve: metric 'telemetry.hit'"):
        check_metric(samples, "telemetry.hit", "curve")


def test_a_curve_per_column_turns_request_totals_into_per_step_times(tmp_path):
    """``per: telemetry.decode_steps`` divides every y by the sample's decode steps (PQCache Fig. 12b:
    select/fetch/compute/decode_s are request totals over a number of steps that differs by sample), so
    the parts add up to the mean step time; a zero divisor drops the point instead of plotting inf."""
    from kvbench.experiments import load_experiment
    from kvbench.render import check_render, render_curve

    spec = {
        "source": "samples",
        "x": "meta.length",
        "y": ["telemetry.select_s", "telemetry.decode_s"],
        "per": "telemetry.decode_steps",
        "split": [],
    }
    check_render({"curve": spec})
    samples = pd.DataFrame(
        {
            "meta.length": [1024, 1024, 2048, 4096],
            "telemetry.select_s": [1.0, 3.0, 2.0, 5.0],
            "telemetry.decode_s": [4.0, 8.0, 6.0, 9.0],
            "telemetry.decode_steps": [10, 20, 30, 0],
        }
    )
    exp = load_experiment("pqcache/fig12b")
    [section] = render_curve(exp, spec, pd.DataFrame(), samples, None, tmp_path, "t")
    rows = {line.split("|")[1].strip(): line for line in section.markdown.splitlines() if line.startswith("| tele")}
    # 1024: the mean over the samples of 1/10 and 3/20 = 0.125; 2048: 2/30; 4096: no steps, no point
    assert "0.125" in rows["telemetry.select_s"] and "0.067" in rows["telemetry.select_s"]
    assert "0.400" in rows["telemetry.decode_s"] and "0.200" in rows["telemetry.decode_s"]
    assert "inf" not in section.markdown


def test_bad_render_item_is_refused():
    from kvbench.render import check_render

    with pytest.raises(ConfigError, match="unknown render kind"):
        check_render({"pie": {}})
    with pytest.raises(ConfigError, match="unknown options"):
        check_render({"table": {"rows": ["method"], "colour": "red"}})
    with pytest.raises(ConfigError, match="op"):
        check_render({"claims": {"rows": [{"quantity": "x", "ours": {"op": "median"}}]}})


# ---------------------------------------------------------------------- paired statistics
def test_paired_rows_name_each_runs_budget():
    """ClusterKV Table I's paired table printed "–" for every budget: the samples carry no budget
    label, so four quest rows looked alike. The row's keys come from its run."""
    from kvbench.render import render_paired

    runs = pd.DataFrame(
        {
            "run_id": ["f", "q256", "q512"],
            "budget.label": ["full cache", "256 tokens", "512 tokens"],
            "config.method.name": ["full", "quest", "quest"],
            "config.model.name": ["m"] * 3,
        }
    )
    samples = pd.DataFrame(
        {
            "run_id": [r for r in ("f", "q256", "q512") for _ in range(3)],
            "id": ["a", "b", "c"] * 3,
            "score": [50.0, 40.0, 30.0, 50.0, 30.0, 30.0, 40.0, 40.0, 30.0],
            "config.method.name": [m for m in ("full", "quest", "quest") for _ in range(3)],
            "config.model.name": ["m"] * 9,
        }
    )
    (section,) = render_paired(None, {"baseline": {"method": "full"}}, runs, samples)
    assert list(section.frame["budget"]) == ["256 tokens", "512 tokens"]
    assert list(section.frame["Δ"]) == ["-3.33", "-3.33"]
    assert list(section.frame["baseline"]) == ["40.00", "40.00"]  # a whole mean keeps its places


def test_mcnemar_exact_matches_the_binomial_tail():
    from kvbench.stats import mcnemar_exact, paired

    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(1, 6) == pytest.approx(2 * (1 + 7) / 128)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0
    result = paired([100, 100, 100, 0, 100, 100, 100], [0, 0, 0, 0, 0, 0, 100])
    assert result.test == "mcnemar" and (result.a_only, result.b_only) == (5, 0)
    assert result.p == pytest.approx(2 / 32) and result.diff == pytest.approx(500 / 7)


def test_permutation_p_enumerates_small_samples_exactly():
    from kvbench.stats import paired, permutation_p

    # differences 1, 2, 3: of the 8 sign patterns only all-plus and all-minus reach |mean| = 2
    assert permutation_p([11.0, 12.0, 13.0], [10.0, 10.0, 10.0]) == pytest.approx(0.25)
    assert permutation_p([5.0, 5.0], [5.0, 5.0]) == 1.0
    result = paired([50.0, 60.0, 70.0, 80.0], [50.0, 50.0, 50.0, 50.0])
    assert result.test == "permutation" and result.diff == pytest.approx(15.0)
    assert result.ci_low <= 15.0 <= result.ci_high
    large = permutation_p(list(range(40)), [x - 3 for x in range(40)])
    assert large < 0.001  # every difference +3: no flip reaches it but the identity


def test_bootstrap_interval_of_a_constant_difference_is_a_point():
    from kvbench.stats import bootstrap_diff

    low, high = bootstrap_diff([3.0, 4.0, 5.0], [1.0, 2.0, 3.0])
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)
    assert bootstrap_diff([1.0], [0.0]) is None
    assert not math.isnan(bootstrap_diff([1.0, 9.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0])[0])


def test_tables_and_curves_follow_the_sweep_and_sort_numbers(tmp_path):
    """Runs are found in their folders' (hash) order; the report shows them in the experiment's sweep
    order (here full_reuse before full, as swept) with numeric axes ascending (2, 4, 8, 16 chunks),
    in the tables and in the curve's table alike."""
    import yaml

    from kvbench.reproduce import our_runs, render
    from kvbench.results import RunDir

    swept = [(m, k) for m in ("full_reuse", "full") for k in (16, 2, 8, 4)]
    run_dirs = []
    for index, (method, top_k) in enumerate(swept):
        run_dir = RunDir(tmp_path / f"rag-{method}-{'zyxwvuts'[index]}")  # sorted names: the reverse order
        config = {"model": {"name": "m"}, "method": {"name": method}, "task": {"name": "rag", "top_k": top_k}}
        run_dir.create(yaml.safe_dump(config), {}, total=1)
        run_dir.append({"id": "a", "score": float(top_k), "meta": {}})
        run_dir.write_metrics({"n": 1, "score": float(top_k), "per_subset": {"musique": float(top_k)}})
        run_dir.set_status("finished")
        run_dirs.append(run_dir.path)
    runs = our_runs(run_dirs)
    assert list(zip(runs["config.method.name"], runs["config.task.top_k"])) == swept
    sections = render(load_experiment("cacheblend/fig2"), "cpu", run_dirs, None, tmp_path / "out")
    grids = [s.markdown for s in sections if s.title.startswith("F1")]
    assert len(grids) == 2  # the curve's table and the table
    for grid in grids:
        lines = grid.splitlines()
        header, _, first, second = ([c.strip() for c in line.strip("|").split("|")] for line in lines[:4])
        assert header[-4:] == ["2", "4", "8", "16"] and [float(c) for c in first[-4:]] == [2, 4, 8, 16]
        assert "full_reuse" in first and "full" in second


def test_a_table_meets_the_papers_numbers_only_in_the_column_they_measure(tmp_path):
    """Fig. 11d's values are hit rates (``column: hit_rate``): its hit-rate table shows the paper's too.
    Fig. 11c's are TPOT reductions in %: a hit-rate table there shows ours alone (it used to read
    ``0.89 / 26.30``), and the reductions stay in the claims."""
    import yaml

    from kvbench.reproduce import render
    from kvbench.results import RunDir

    run_dirs = []
    for index, (policy, blocks, cache_tokens) in enumerate([("lru", 8, 4096), ("lfu", 8, 8192)]):
        run_dir = RunDir(tmp_path / f"niah-pqcache-{index}")
        method = {"name": "pqcache", "cache_policy": policy, "cache_blocks": blocks, "cache_tokens": cache_tokens}
        config = {"model": {"name": "m"}, "method": method, "task": {"name": "niah"}}
        run_dir.create(yaml.safe_dump(config), {}, total=1)
        run_dir.append({"id": "a", "score": 0.0, "meta": {}})
        run_dir.write_metrics({"n": 1, "score": 0.0, "hit_rate": 0.891, "tpot_s": 0.1})
        run_dir.set_status("finished")
        run_dirs.append(run_dir.path)

    def table(name, title):
        sections = render(load_experiment(name), "cpu", run_dirs, None, tmp_path / name.replace("/", "_"))
        return next(s.markdown for s in sections if s.title.startswith(title))

    fig11d = table("pqcache/fig11d", "hit rate: ours / paper")
    assert "0.891" in fig11d and "/ ~0.500" in fig11d  # the paper's "around 0.5 across the block counts"
    fig11c = table("pqcache/fig11c", "block-cache hit rate")
    assert "0.89" in fig11c and "26.30" not in fig11c and "32.80" not in fig11c


def test_a_measured_value_keeps_its_places_when_whole():
    """A score column reads 75.00 beside 90.83 (PQCache Fig. 10b's 8x4 cell read "75"); counts and
    budgets stay bare integers; a measured 0.0 is 0.000, not 0."""
    import numpy as np

    from kvbench.render import fmt

    assert fmt(75.0, 2, measured=True) == "75.00" and fmt(np.float64(75.0), 2, measured=True) == "75.00"
    assert fmt(90.833, 2, measured=True) == "90.83" and fmt(0.0, 3, measured=True) == "0.000"
    assert fmt(75, 2, measured=True) == "75" and fmt(1024.0) == "1024"


def test_a_table_keeps_the_sweeps_method_order_when_full_has_no_budget():
    """PQCache Fig. 9 listed `full` last: the outer join with the paper's rows sorted by the join key,
    and `full`'s unset ratio "–" sorts after "0.1". Our rows keep the sweep's order."""
    from kvbench.render.table import _axis_order, _merge

    ours = pd.DataFrame(
        {"method": ["full", "oracle", "h2o"], "_join_token_ratio": ["–", "0.1", "0.1"], "ours": [90.0, 90.0, 20.0]}
    )
    paper = pd.DataFrame({"_join_token_ratio": ["0.1"], "method": ["oracle"], "_row": [0]})
    merged = _merge(ours, paper, ["_join_token_ratio"], ["method"])
    assert list(merged["method"]) == ["full", "oracle", "h2o"]
    assert _axis_order(merged, "method")[0] == "oracle" and set(_axis_order(merged, "method")) == {
        "full",
        "oracle",
        "h2o",
    }
    merged = _merge(ours, paper.iloc[0:0], ["_join_token_ratio"], ["method"])
    assert _axis_order(merged, "method") == ["full", "oracle", "h2o"]


def test_axis_order_puts_numbers_in_order_after_runs_without_the_key():
    """A ratio column of `full` (no ratio: "–") and CacheBlend at 0.15, 0.05, 0.3 (the sweep's order)
    reads –, 0.05, 0.15, 0.3; text keeps the sweep's order. Numbers stay in order when the paper states
    one of them (PQCache Fig. 11d's one stated block count, 32, among our 8-64 read 32, 8, 16, 64
    before); the paper's text values come first."""
    from kvbench.render.table import _axis_order

    frame = pd.DataFrame({"r": ["–", "0.15", "0.05", "0.3"], "m": ["full", "cb", "cb", "cb"], "_row": [None] * 4})
    assert _axis_order(frame, "r") == ["–", "0.05", "0.15", "0.3"]
    assert _axis_order(frame, "m") == ["full", "cb"]
    frame["_row"] = [None, None, None, 0.0]
    assert _axis_order(frame, "r") == ["–", "0.05", "0.15", "0.3"]
    assert _axis_order(frame, "m") == ["cb", "full"]


# ---------------------------------------------------------------------- the HTML report
@needs_data
def test_html_report_is_self_contained(tmp_path, table3_smoke):
    """One page per artifact plus an index; tables and embedded figures; no external resource."""
    import html.parser
    import shutil

    assert table3_smoke[1].returncode == 0, table3_smoke[1].stderr[-2000:]
    runs = tmp_path / "runs"
    shutil.copytree(table3_smoke[0] / "runs", runs)  # table3's runs, plus fig11c's
    out = kvbench("reproduce", "pqcache/fig11c", "scale=smoke", f"output_dir={runs}", "--out", str(tmp_path / "md"))
    assert out.returncode == 0, out.stderr[-2000:]
    out = kvbench("report", str(runs), "--html", str(tmp_path / "site"), "--scale", "smoke")
    assert out.returncode == 0, out.stderr[-2000:]

    class Page(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags, self.sources, self.links, self.headings, self.in_h = [], [], [], [], False

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            self.tags.append(tag)
            self.in_h = tag in ("h1", "h2")
            if "src" in attrs:
                self.sources.append(attrs["src"])
            if tag == "link" or "href" in attrs:
                self.links.append(attrs.get("href"))

        def handle_data(self, data):
            if self.in_h:
                self.headings.append(data)

        def handle_endtag(self, tag):
            self.in_h = False

    site = tmp_path / "site"
    index = Page()
    index.feed((site / "index.html").read_text())
    assert sorted(index.links) == sorted(f"{n}.html" for n in experiment_names())
    assert all((site / link).exists() for link in index.links)
    table3 = Page()
    table3.feed((site / "pqcache_table3.html").read_text())
    assert table3.tags.count("table") >= 3 and "protocol differences (scale smoke)" in table3.headings
    assert "47.99" in (site / "pqcache_table3.html").read_text()
    fig = Page()
    fig.feed((site / "pqcache_fig11c.html").read_text())
    assert fig.sources and all(src.startswith("data:image/png;base64,") for src in fig.sources)
    for page in site.glob("*.html"):
        parsed = Page()
        parsed.feed(page.read_text())
        assert all(src.startswith("data:") for src in parsed.sources), page
        assert all(link and not link.startswith(("http", "//", "/")) for link in parsed.links), page


def test_a_log_axis_over_a_few_swept_values_labels_those_values(tmp_path, monkeypatch):
    """Communication ratios 1/128-1/16 on a log axis read as 1/128 ... 1/16, not as powers of ten."""
    from kvbench import plots

    assert [plots._tick_label(x) for x in (1 / 128, 0.2, 0.4, 2048.0, 0.05)] == ["1/128", "1/5", "0.4", "2048", "1/20"]
    drawn = {}

    def keep(fig, path):
        drawn["labels"] = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        return path

    monkeypatch.setattr(plots, "_save", keep)
    xs = [1 / 128, 1 / 64, 1 / 32, 1 / 16]
    points = pd.DataFrame({"x": xs, "y": [1.0, 2.0, 3.0, 4.0], "series": "pqcache", "split": "m"})
    plots.curves_figure(points, tmp_path / "c.png", logx=True)
    assert drawn["labels"] == ["1/128", "1/64", "1/32", "1/16"]


def test_averages_over_different_sets_are_not_differenced():
    """Our mean over the sets we ran and the paper's over its own are shown, with no Δ, unless the sets
    agree; a paper that publishes only its average keeps the Δ (nothing to check it against)."""
    from kvbench.render.table import _unlike_averages

    merged = pd.DataFrame(
        {
            "dataset": ["a", "b", "average", "a", "b", "average", "average"],
            "method": ["m", "m", "m", "n", "n", "n", "o"],
            "ours": [1.0, None, 1.0, 1.0, 2.0, 1.5, 3.0],
            "_row": [0, 1, 2, 3, 4, 5, 6],
        }
    )
    assert _unlike_averages(merged, ["dataset", "method"]) == {2: (1, 2)}
    assert _unlike_averages(merged, ["method"]) == {}  # no dataset axis: nothing to compare


def test_bench_columns_may_be_labelled_and_fig15c_labels_its_computed_columns():
    from kvbench.render import render_bench

    rows = pd.DataFrame({"batch": [1, 2], "full_one_by_one_s": [7.0, 14.0], "decode_s": [2.0, 3.0]})
    (section,) = render_bench({"columns": {"batch": "B", "full_one_by_one_s": "one at a time, computed"}}, rows, [])
    assert list(section.frame.columns) == ["B", "one at a time, computed"]
    assert section.frame.iloc[1].tolist() == ["2", "14"]
    (plain,) = render_bench({"columns": ["decode_s"]}, rows, [])
    assert list(plain.frame.columns) == ["decode_s"]
    exp = load_experiment("cacheblend_fig15c")
    (bench,) = [item["bench"] for item in exp.render if "bench" in item]
    for column in ("full_one_by_one_s", "cacheblend_prefill_s"):  # B x the batch-1 time, never measured at B
        assert "computed" in bench["columns"][column]
    assert "measured" in bench["columns"]["full_prefill_s"]


def test_an_interval_that_holds_the_papers_bound_is_undecided():
    """A claim from samples with ``paired``: the interval decides, never the point alone."""
    from kvbench.render.paper import holds

    at_least = {"value": 51, "sided": "at_least"}
    assert holds(50.7, at_least) == "no"  # the point alone
    assert holds(50.7, at_least, [40.7, 61.1]) == "undecided"  # 51 lies inside our interval
    assert holds(58.2, {"value": 75, "sided": "at_least"}, [47.9, 68.3]) == "no"  # the whole interval below
    assert holds(80.0, {"value": 75, "sided": "at_least"}, [76.0, 84.0]) == "yes"
    assert holds(0.02, {"value": 0.03, "relation": "<="}, [0.01, 0.04]) == "undecided"  # at_most's ceiling inside
    assert holds(12.0, {"low": 10, "high": 15, "relation": "~"}, [9.0, 16.0]) == "yes"  # a range: the point


def test_a_paired_claim_interval_resamples_shared_ids():
    import pandas as pd

    from kvbench.render.claims import claim_interval, claim_value

    ids = [f"q{i}" for i in range(40)]
    frame = pd.DataFrame(
        [{"id": i, "config.method.name": "a", "compute_ratio": 0.4 + 0.01 * (k % 5)} for k, i in enumerate(ids)]
        + [{"id": i, "config.method.name": "b", "compute_ratio": 0.8 + 0.01 * (k % 5)} for k, i in enumerate(ids)]
        + [{"id": "extra", "config.method.name": "b", "compute_ratio": 5.0}]  # no pair: left out of the interval
    )
    spec = {"op": "rel_gap", "metric": "compute_ratio", "paired": "id", "a": {"method": "a"}, "b": {"method": "b"}}
    low, high = claim_interval(frame, spec)
    paired_point = 100 * (1 - 0.42 / 0.82)
    assert low < paired_point < high and high - low < 5  # the pairs move together: a narrow interval
    assert claim_interval(frame, {**spec, "paired": None}) is None
    low, high = claim_interval(frame, {**spec, "op": "rel_diff"})  # a's deviation above b: the same, negated
    assert low < -paired_point < high and high - low < 5
    assert claim_value(frame, spec) is not None


def test_a_paired_max_diff_resamples_the_ids_every_ratio_shares():
    """CacheBlend Fig. 16's "quality drop at most ...": the largest drop of CacheBlend below full over the
    recompute ratios, from samples; full (no ratio) meets every ratio; the interval resamples shared ids."""
    import pandas as pd

    from kvbench.render.claims import claim_interval, claim_value

    ids = [f"q{i}" for i in range(30)]
    rows = [{"id": i, "config.method.name": "full", "score": 50.0 + (k % 3)} for k, i in enumerate(ids)]
    for ratio, drop in ((0.05, 4.0), (0.15, 1.0)):
        rows += [
            {"id": i, "config.method.name": "cacheblend", "config.method.recompute_ratio": ratio, "score": s - drop}
            for i, s in ((r["id"], r["score"]) for r in rows[:30])
        ]
    frame = pd.DataFrame(rows)
    spec = {"op": "max_diff", "over": "recompute_ratio", "paired": "id", "a": {"method": "full"}}
    spec["b"] = {"method": "cacheblend"}
    assert claim_value(frame, spec) == pytest.approx(4.0)  # the 0.05 row's drop, not the last row's value
    low, high = claim_interval(frame, spec)
    assert low == pytest.approx(4.0) and high == pytest.approx(4.0)  # every pair moves alike: no spread
    noisy = frame.assign(score=frame["score"] + [(-1) ** k * (k % 7) for k in range(len(frame))])
    low, high = claim_interval(noisy, spec)
    assert low < claim_value(noisy, spec) < high


def test_what_reproduce_writes_is_not_tracked():
    """`kvbench reproduce` writes its reports under results/reproduce/<scale>/: running the README's
    commands leaves the working tree clean at every scale."""
    import shutil

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for scale in ("smoke", "cpu", "paper"):
        path = f"results/reproduce/{scale}/pqcache_table3/report.md"
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert out.returncode == 0, f"{path} would be tracked"
    tracked = subprocess.run(["git", "ls-files", "results/reproduce"], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout.strip() == ""
