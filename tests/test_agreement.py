"""Agreement with a baseline run's answers (kvbench.agreement): the per-sample scorers on hand-computed
pairs, and the ``agreement`` render item from run folders on disk (synthetic ones and the committed
CacheBlend Fig. 12 records), which it reads without writing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvbench.agreement import PLAIN, agreement, answer_form, exact_match, jaccard, rouge_l_f1, summarise
from kvbench.errors import ConfigError
from kvbench.render import check_render, render_agreement
from kvbench.reproduce import our_runs
from kvbench.stats import bootstrap_diff, bootstrap_mean

ROOT = Path(__file__).resolve().parents[1]
FIG12 = ROOT / "benchmarks/records/cacheblend-fig12"
RAG_QA = answer_form("rag", "musique")


# ---------------------------------------------------------------------- per-sample scorers
def test_identical_answers_agree_fully():
    for form in (PLAIN, RAG_QA):
        assert agreement("Exeter College, Oxford", "Exeter College, Oxford", form) == agreement("x", "x", form)
        assert agreement("x", "x", form).exact == 1.0
        assert agreement("x", "x", form).rouge_l == 1.0 and agreement("x", "x", form).jaccard == 1.0


def test_empty_answers():
    both = agreement("", "", RAG_QA)
    assert (both.exact, both.rouge_l, both.jaccard) == (1.0, 1.0, 1.0)  # two empty answers say the same
    for a, b in (("", "Missouri"), ("Missouri", "")):
        one = agreement(a, b, RAG_QA)
        assert (one.exact, one.rouge_l, one.jaccard) == (0.0, 0.0, 0.0)
    # punctuation only normalises to empty under SQuAD normalisation: equal to an empty answer
    assert exact_match("...", "", RAG_QA) == 1.0 and exact_match("...", "", PLAIN) == 0.0


def test_disjoint_answers_score_zero():
    result = agreement("red apple", "green pear", PLAIN)
    assert (result.exact, result.rouge_l, result.jaccard) == (0.0, 0.0, 0.0)


def test_partial_overlap_by_hand():
    # tokens a b c d vs b d e: LCS "b d" = 2, P = 2/4, R = 2/3, F = 4/7; sets share {b, d} of 5
    assert exact_match("a b c d", "b d e") == 0.0
    assert rouge_l_f1("a b c d", "b d e") == pytest.approx(4 / 7)
    assert jaccard("a b c d", "b d e") == pytest.approx(2 / 5)
    # symmetric
    assert rouge_l_f1("b d e", "a b c d") == pytest.approx(4 / 7)
    assert jaccard("b d e", "a b c d") == pytest.approx(2 / 5)


def test_rag_qa_answers_compare_as_the_f1_scorer_sees_them():
    # first line, SQuAD normalisation (case, punctuation, articles): "cat sat on mat" vs "cat on mat"
    a, b = "The cat sat on the mat.\nAnd then some more text", "cat on a mat"
    assert exact_match(a, b, RAG_QA) == 0.0
    assert rouge_l_f1(a, b, RAG_QA) == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))  # LCS 3 of 4 and 3 words
    assert jaccard(a, b, RAG_QA) == pytest.approx(3 / 4)
    assert exact_match("charles county, maryland", "Charles County, Maryland", RAG_QA) == 1.0
    assert exact_match("charles county, maryland", "Charles County, Maryland", PLAIN) == 0.0
    assert exact_match("Yes, he did.", "yes", RAG_QA) == 1.0  # CacheBlend's Yes/No collapse
    # the same answer text agrees whatever a method generates after its first line
    assert exact_match("Missouri\nQuestion: where", "Missouri", RAG_QA) == 1.0


def test_answer_forms_follow_the_tasks_scorers():
    assert answer_form("rag", "multi_news") is PLAIN  # a summary: no QA normalisation
    assert answer_form("niah", None) is PLAIN
    trec = answer_form("longbench", "trec")
    assert trec.normalise("Location\nmore") == "Location"
    hotpot = answer_form("longbench", "hotpotqa_e")
    assert hotpot.normalise("The Eiffel Tower!") == "eiffel tower"
    zh = answer_form("longbench", "multifieldqa_zh")
    assert zh.zh and exact_match("今天， 天气好。", "今天天气好", zh) == 1.0


def test_summary_means_and_bootstrap_intervals():
    pairs = [agreement(a, b) for a, b in (("x", "x"), ("a b c d", "b d e"), ("", "y"), ("p q", "p q"))]
    result = summarise(pairs)
    assert result.n == 4
    assert result.exact_pct == pytest.approx(50.0)
    assert result.rouge_l == pytest.approx((1 + 4 / 7 + 0 + 1) / 4)
    assert result.jaccard == pytest.approx((1 + 2 / 5 + 0 + 1) / 4)
    assert result.exact_ci == bootstrap_mean([100.0, 0.0, 0.0, 100.0])
    assert result.rouge_l_ci == bootstrap_mean([1.0, 4 / 7, 0.0, 1.0])
    assert summarise([agreement("x", "y")]).exact_ci is None  # one pair: no interval


def test_bootstrap_diff_is_the_bootstrap_of_the_differences():
    a, b = [3.0, 1.0, 4.0, 1.0, 5.0], [2.0, 7.0, 1.0, 8.0, 2.0]
    assert bootstrap_diff(a, b) == bootstrap_mean(np.subtract(a, b))
    assert bootstrap_mean([2.0, 2.0, 2.0]) == (2.0, 2.0)


# ---------------------------------------------------------------------- the render item
def _run(folder: Path, method: str, predictions: dict[str, str], dataset: str = "musique") -> Path:
    run = folder / f"rag-{method}-{dataset}"
    run.mkdir()
    config = {
        "model": {"name": "smollm2_135m"},
        "method": {"name": method},
        "task": {"name": "rag", "dataset": dataset, "limit": len(predictions)},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with open(run / "samples.jsonl", "w") as handle:
        for sample_id, text in predictions.items():
            record = {"id": sample_id, "prediction": text, "score": 0.0, "subset": dataset, "meta": {}, "telemetry": {}}
            handle.write(json.dumps(record) + "\n")
    (run / "metrics.json").write_text(json.dumps({"n": len(predictions), "score": 0.0}))
    (run / "status.json").write_text(json.dumps({"state": "finished", "total": len(predictions)}))
    return run


FULL = {"q0": "Exeter College", "q1": "Charles County, Maryland", "q2": "Missouri", "q3": "drums\nand more"}
BLEND = {
    "q0": "exeter college.",  # the same after normalisation: 1, 1, 1
    "q1": "Charles County",  # 2 of full's 3 words: ROUGE-L 2·1·(2/3)/(1 + 2/3) = 0.8, Jaccard 2/3
    "q2": "",  # nothing: 0, 0, 0
    "q3": "guitar",  # disjoint: 0, 0, 0
    "q9": "an id full did not answer",  # not paired
}


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    paths = [folder, *folder.rglob("*")]
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"") for p in paths}


def test_agreement_table_from_run_folders_by_hand(tmp_path):
    dirs = [_run(tmp_path, "full", FULL), _run(tmp_path, "cacheblend", BLEND), _run(tmp_path, "prefix_cache", FULL)]
    before = _snapshot(tmp_path)
    runs, samples = our_runs(dirs), our_runs(dirs, samples=True)
    assert list(runs["state"]) == ["finished"] * 3
    spec = {"baseline": {"method": "full"}, "by": ["method"], "split": ["model", "config.task.dataset"]}
    check_render({"agreement": spec})
    (section,) = render_agreement(None, spec, runs, samples)
    assert _snapshot(tmp_path) == before  # reading wrote nothing

    rows = {row["method"]: row for row in pd.read_csv(pd.io.common.StringIO(section.csv)).to_dict("records")}
    assert set(rows) == {"cacheblend", "prefix_cache"}  # the baseline is not compared with itself
    blend = rows["cacheblend"]
    assert blend["n"] == 4
    assert blend["exact_pct"] == pytest.approx(25.0)
    assert blend["rouge_l_f1"] == pytest.approx((1 + 0.8 + 0 + 0) / 4)
    assert blend["jaccard"] == pytest.approx((1 + 2 / 3 + 0 + 0) / 4)
    low, high = bootstrap_mean([100.0, 0.0, 0.0, 0.0])
    assert (blend["exact_pct_ci_low"], blend["exact_pct_ci_high"]) == pytest.approx((low, high))
    low, high = bootstrap_mean([1.0, 2 / 3, 0.0, 0.0])
    assert (blend["jaccard_ci_low"], blend["jaccard_ci_high"]) == pytest.approx((low, high))

    same = rows["prefix_cache"]  # a method that answers as the baseline does
    assert same["n"] == 4
    assert same["exact_pct"] == 100.0 and same["rouge_l_f1"] == 1.0 and same["jaccard"] == 1.0
    assert (same["exact_pct_ci_low"], same["exact_pct_ci_high"]) == (100.0, 100.0)

    shown = section.frame.set_index("method")
    assert shown.loc["prefix_cache", "exact %"] == "100.0 [100.0, 100.0]"
    assert shown.loc["cacheblend", "ROUGE-L F1"].startswith("0.450 [")
    assert shown.loc["cacheblend", "split"] == "smollm2_135m · musique"
    assert "| cacheblend | 4 | 25.0 [" in section.markdown
    assert "first line, Yes/No collapse, SQuAD normalisation" in section.note


def test_each_dataset_pairs_with_its_own_baseline(tmp_path):
    dirs = [
        _run(tmp_path, "full", {"q0": "a"}, "musique"),
        _run(tmp_path, "full", {"q0": "b"}, "wikimqa"),
        _run(tmp_path, "cacheblend", {"q0": "a"}, "musique"),
        _run(tmp_path, "cacheblend", {"q0": "a"}, "wikimqa"),
    ]
    spec = {"baseline": {"method": "full"}, "by": ["method"], "split": ["config.task.dataset"]}
    (section,) = render_agreement(None, spec, our_runs(dirs), our_runs(dirs, samples=True))
    table = pd.read_csv(pd.io.common.StringIO(section.csv))
    assert list(zip(table["split"], table["exact_pct"])) == [("musique", 100.0), ("wikimqa", 0.0)]


def test_no_pairs_and_bad_items_say_so(tmp_path):
    dirs = [_run(tmp_path, "cacheblend", {"q0": "a"})]
    spec = {"baseline": {"method": "full"}, "by": ["method"]}
    (section,) = render_agreement(None, spec, our_runs(dirs), our_runs(dirs, samples=True))
    assert "no pairs" in section.markdown
    with pytest.raises(ConfigError, match="baseline"):
        check_render({"agreement": {"by": ["method"]}})
    with pytest.raises(ConfigError, match="unknown options"):
        check_render({"agreement": {"baseline": {"method": "full"}, "value": "score"}})


@pytest.mark.parametrize("name", ["cacheblend/fig12", "cacheblend/fig16", "cacheblend/fig17"])
def test_the_cacheblend_experiments_render_agreement_with_full(name):
    from kvbench.experiments import load_experiment

    items = [spec for item in load_experiment(name).render for kind, spec in item.items() if kind == "agreement"]
    assert items and items[0]["baseline"] == {"method": "full"}


def test_committed_fig12_records_agreement_without_writing():
    """The committed CacheBlend Fig. 12 records (n = 20 per data set): prefix caching gives full's answers
    exactly (as RESULTS.md says); the reuse methods agree on some. Reading leaves the records untouched."""
    dirs = sorted(p for p in FIG12.iterdir() if (p / "config.yaml").exists())
    before = _snapshot(FIG12)
    spec = {"baseline": {"method": "full"}, "by": ["method"], "split": ["model", "config.task.dataset"]}
    (section,) = render_agreement(None, spec, our_runs(dirs), our_runs(dirs, samples=True))
    assert _snapshot(FIG12) == before
    table = pd.read_csv(pd.io.common.StringIO(section.csv))
    got = {(s.split(" · ")[1], m): (n, e) for s, m, n, e in table[["split", "method", "n", "exact_pct"]].values}
    assert got[("musique", "prefix_cache")] == (20, 100.0) and got[("wikimqa", "prefix_cache")] == (20, 100.0)
    assert got[("musique", "full_reuse")] == (20, 20.0) and got[("musique", "cacheblend")] == (20, 35.0)
    assert got[("wikimqa", "full_reuse")] == (20, 55.0) and got[("wikimqa", "cacheblend")] == (20, 50.0)


def test_versus_gives_the_paired_difference_of_two_runs_agreement(tmp_path):
    """``versus``: per run, its per-sample agreement with the baseline minus the versus run's, on the ids
    all three answered, with the bootstrap interval of the differences (worked out by hand)."""
    reuse = {"q0": "Oxford", "q1": "Charles County, Maryland", "q2": "Missouri", "q3": "guitar"}  # ROUGE 0, 1, 1, 0
    dirs = [
        _run(tmp_path, "full", FULL),
        _run(tmp_path, "cacheblend", BLEND),  # ROUGE 1, 0.8, 0, 0 (q9 unpaired)
        _run(tmp_path, "prefix_cache", FULL),  # ROUGE 1, 1, 1, 1
        _run(tmp_path, "full_reuse", reuse),
    ]
    spec = {"baseline": {"method": "full"}, "versus": {"method": "full_reuse"}, "by": ["method"]}
    check_render({"agreement": spec})
    first, second = render_agreement(None, spec, our_runs(dirs), our_runs(dirs, samples=True))
    assert "full_reuse" in set(pd.read_csv(pd.io.common.StringIO(first.csv))["method"])  # the plain table has it
    rows = {row["method"]: row for row in pd.read_csv(pd.io.common.StringIO(second.csv)).to_dict("records")}
    assert set(rows) == {"cacheblend", "prefix_cache"}  # neither the baseline nor the versus run itself
    blend, same = rows["cacheblend"], rows["prefix_cache"]
    assert blend["n"] == 4 and blend["d_rouge_l_f1"] == pytest.approx((1 - 0.2 - 1 + 0) / 4)
    assert blend["d_exact_pct"] == pytest.approx((100 - 100 - 100 + 0) / 4)
    low, high = bootstrap_diff([1, 0.8, 0, 0], [0, 1, 1, 0])
    assert (blend["d_rouge_l_f1_ci_low"], blend["d_rouge_l_f1_ci_high"]) == pytest.approx((low, high))
    assert same["d_rouge_l_f1"] == pytest.approx(0.5) and same["d_exact_pct"] == pytest.approx(50.0)
    assert "minus method=full_reuse" in second.title and "+0.500 [" in second.markdown
    with pytest.raises(ConfigError, match="versus"):
        check_render({"agreement": {"baseline": {"method": "full"}, "versus": "full_reuse"}})
