"""Multi-query in the tasks: NIAH with several needles, RULER's per-key questions, the records and
metrics of a multi-query run, run ids of existing runs, the figures."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.cli import conf_dir
from kvbench.compose import task_node
from kvbench.errors import ConfigError
from kvbench.results import run_id_for
from kvbench.tasks import create_task
from kvbench.tasks.base import followup_frame, multi_query_metrics
from kvbench.tasks.niah import EXTRA_NEEDLES, _insert_all
from kvbench.tasks.ruler_protocol import score as ruler_score
from tests.conftest import niah_run_config


def niah(essays, **cfg):
    return create_task(
        {"name": "niah", "data_dir": str(essays), "lengths": [700], "depths": [0.0, 0.25, 0.5, 0.75], **cfg}
    )


# ------------------------------------------------------------------------------------------------ NIAH
def test_one_needle_prompts_and_run_ids_are_unchanged(tiny_llama, essays, tmp_path):
    """Golden: the one-needle prompts are byte for byte those kvbench built before multi-query existed
    (digests taken from that version on the ``essays`` fixture), and the new options, at their
    defaults, leave existing runs' ids alone."""
    task = create_task({"name": "niah", "data_dir": str(essays), "lengths": [600, 700], "depths": [0.0, 1.0]})
    digests = {
        s.id: hashlib.sha256(json.dumps(s.input_ids).encode()).hexdigest()[:16] for s in task.samples(tiny_llama)
    }
    assert digests == {
        "len600_depth0": "244be3ae71c3a4ad",
        "len600_depth1": "6bc9df611ac31f09",
        "len700_depth0": "fd1c5f6b5c8d6fd7",
        "len700_depth1": "99a8efc0f71116c2",
    }
    from kvbench.runner import plan

    cfg = niah_run_config(tmp_path / "runs", essays, "snapkv", budget__token_ratio=0.1)
    new_keys = ("needles", "queries_per_context", "compression", "keep_answers")
    assert all(key in cfg["task"] for key in new_keys)
    old = {**cfg, "task": {k: v for k, v in cfg["task"].items() if k not in new_keys}}
    assert plan(cfg).run_dir.path.name == run_id_for(old)
    changed = niah_run_config(
        tmp_path / "runs", essays, "snapkv", budget__token_ratio=0.1, task__compression="question_agnostic"
    )
    assert plan(changed).run_dir.path.name != run_id_for(old)


def test_several_needles_at_their_depths_and_questions_in_rotated_order(tiny_llama, essays):
    task = niah(essays, needles=4)
    cities = ["San Francisco"] + [city for city, _, _ in EXTRA_NEEDLES[:3]]
    decode = tiny_llama.tokenizer.decode
    firsts = []
    for k, sample in enumerate(task.samples(tiny_llama)):
        assert len(sample.input_ids) <= 700 and sample.meta["prompt_tokens"] == len(sample.input_ids)
        text = decode(sample.input_ids)
        places = [text.index(f"The best thing to do in {city} is") for city in cities]
        assert places == sorted(places), "needle i sits deeper than needle i-1"
        assert all(text.count(f"in {city} is") == 1 for city in cities)
        depth = sample.meta["depth"]
        assert sample.meta["needle_depths"] == pytest.approx([depth + i * (1 - depth) / 4 for i in range(4)], abs=1e-4)
        order = [(k + j) % 4 for j in range(4)]
        assert sample.meta["order"] == order
        assert [q.text for q in sample.queries] == [f"What is the best thing to do in {cities[i]}?" for i in order]
        assert sample.reference == sample.queries[0].reference
        # the one-question prompt is the context followed by the first question's direct form
        context = [i for segment in sample.context for i in segment.ids]
        assert sample.input_ids == context + sample.queries[0].ids
        assert text.rstrip().endswith("<|im_start|>assistant") and cities[order[0]] in decode(sample.queries[0].ids)
        firsts.append(order[0])
    assert sorted(firsts) == [0, 1, 2, 3], "every needle is asked first once over the depth grid"


def test_needles_inserted_at_their_points_in_order():
    context = [1, 2, 9, 3, 4, 9, 5, 6, 7, 8]  # 9 ends a sentence
    a, b, c = [100], [200], [300]
    # depths 0 / 0.5 / 0.5: points 0, 3, 3 -> b before c at the same point
    assert _insert_all(context, [a, b, c], [0.0, 0.5, 0.5], frozenset({9})) == [
        100,
        1,
        2,
        9,
        200,
        300,
        3,
        4,
        9,
        5,
        6,
        7,
        8,
    ]
    assert _insert_all(context, [a, b], [0.7, 1.0], frozenset({9})) == [1, 2, 9, 3, 4, 9, 100, 5, 6, 7, 8, 200]


def test_follow_up_forms_are_new_turns(tiny_llama, essays):
    task = niah(essays, needles=2, queries_per_context=2)
    sample = next(iter(task.samples(tiny_llama)))
    before, after = followup_frame(tiny_llama.chat)
    assert (before, after) == ("<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    decode = tiny_llama.tokenizer.decode
    for query in sample.queries:
        followup = decode(query.followup_ids)
        assert followup.startswith(before) and followup.endswith(after) and query.text in followup
        assert decode(query.ids).startswith("\n\n" + query.text)


def test_substring_scorer_finds_each_needles_key():
    from kvbench.tasks.base import Sample

    task = create_task({"name": "niah", "needles": 3, "scorer": "substring"})
    sample = Sample(id="s", reference=EXTRA_NEEDLES[0][1])
    assert task.score(sample, "Ride the Yamanote line!") == 100.0
    assert task.score(sample, "Sit in Dolores Park.") == 0.0
    assert task.score_answer(sample, task.needles[0].answer, "sit in dolores park") == 100.0
    rouge = create_task({"name": "niah", "needles": 3})
    assert (
        rouge.score_answer(sample, EXTRA_NEEDLES[1][1], "rent a bicycle and have a picnic by the Canal Saint-Martin")
        == 100.0
    )


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"needles": 0}, "needles"),
        ({"needles": 9}, "needles"),
        ({"needles": 2, "queries_per_context": 3}, "queries_per_context"),
        ({"needles": 2, "queries_per_context": 2, "question_position": "start"}, "question_position"),
        ({"compression": "question_agnostic", "question_position": "start"}, "question_position"),
        ({"compression": "sometimes"}, "compression"),
        ({"keep_answers": "yes"}, "keep_answers"),
        ({"queries_per_context": 0}, "queries_per_context"),
    ],
)
def test_bad_multi_query_options(cfg, match):
    with pytest.raises(ConfigError, match=match):
        create_task({"name": "niah", **cfg})


def test_a_multi_query_run_scores_each_question_and_reports_first_and_later(tiny_llama, tmp_path, essays):
    from kvbench.runner import run

    cfg = niah_run_config(
        tmp_path / "runs",
        essays,
        "full",
        task__needles=3,
        task__queries_per_context=3,
        task__compression="question_agnostic",
        task__lengths=[600],
        task__depths=[0.0, 0.5],
    )
    summary = run(cfg)
    records = [json.loads(line) for line in (summary.run_dir / "samples.jsonl").read_text().splitlines()]
    task = create_task(cfg["task"])
    for record in records:
        queries = record["queries"]
        assert [q["index"] for q in queries] == [0, 1, 2]
        assert record["prediction"] == [q["prediction"] for q in queries]
        for query in queries:  # each answer scored against its own needle
            sample = type("S", (), {"reference": query["reference"]})()
            assert query["score"] == task.score(sample, query["prediction"])
            assert query["telemetry"]["question_tokens"] > 0
        assert record["score"] == pytest.approx(sum(q["score"] for q in queries) / 3)
        assert record["meta"]["compression"] == "question_agnostic" and record["telemetry"]["queries"] == 3
    metrics = summary.metrics
    assert metrics["protocol"]["queries_per_context"] == 3 and metrics["queries_asked"] == 6
    assert metrics["score_by_query"] == multi_query_metrics(records)["score_by_query"]
    assert set(metrics["score_by_query"]) == {"0", "1", "2"}


def test_multi_query_metrics_on_hand_written_records():
    records = [
        {"queries": [{"index": 0, "score": 100.0}, {"index": 1, "score": 0.0}, {"index": 2, "score": 50.0}]},
        {"queries": [{"index": 0, "score": 50.0}, {"index": 1, "score": 100.0}]},
        {"score": 7.0},
    ]
    assert multi_query_metrics(records) == {
        "score_first": 75.0,
        "score_followup": 50.0,
        "score_by_query": {"0": 75.0, "1": 50.0, "2": 50.0},
        "queries_asked": 5,
    }
    assert multi_query_metrics([{"score": 1.0}]) == {}


# ----------------------------------------------------------------------------------------------- RULER
@pytest.fixture(scope="module")
def ruler_essays(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ruler_essays")
    (folder / "e.txt").write_text(" ".join(f"Essay sentence {i} is about startups and hackers." for i in range(3000)))
    return folder


NEEDLE_RE = re.compile(r"One of the special magic numbers? for (.+?) is: (\d+)\.")


def test_ruler_asks_a_contexts_keys_one_by_one(tiny_llama, ruler_essays):
    cfg = {
        "name": "ruler",
        "haystack": str(ruler_essays),
        "num_samples": 1,
        "lengths": [1536],
        "subsets": ["niah_multiquery", "niah_multikey_1", "niah_single_1"],
        "queries_per_context": 4,
    }
    task = create_task(cfg)
    single = create_task({**cfg, "queries_per_context": 1})
    decode = tiny_llama.tokenizer.decode
    for sample in task.samples(tiny_llama):
        one = single.make_sample(sample.subset, 1536, 0, tiny_llama)
        context = [i for segment in sample.context for i in segment.ids]
        text = decode(context)
        needles = dict(NEEDLE_RE.findall(text))
        expected = 1 if sample.subset == "niah_single_1" else 4
        assert len(sample.queries) == expected
        keys = [q.text for q in sample.queries]
        assert len(set(keys)) == expected and all(key in needles for key in keys)
        for query in sample.queries:  # one key each, its value the reference, worded as RULER's one-key question
            assert query.reference == [needles[query.text]]
            asked = decode(query.ids)
            assert f"What is the special magic number for {query.text} mentioned" in asked
            assert asked.endswith(f"The special magic number for {query.text} mentioned in the provided text is")
            assert len(context) + len(query.ids) + sample.max_new_tokens <= 1536
        # RULER's own question comes first: its (first) asked key
        assert one.meta["query"].startswith(keys[0])
        if sample.subset == "niah_multiquery":
            assert set(one.reference) == {needles[k] for k in keys}
        assert (
            ruler_score(
                sample.subset,
                f"it is {sample.queries[1 % expected].reference[0]}",
                sample.queries[1 % expected].reference,
            )
            == 100.0
        )


def test_ruler_multi_query_run_reports_per_task_by_question(tiny_llama, ruler_essays, tmp_path):
    from kvbench.runner import run

    base = OmegaConf.load(conf_dir() / "config.yaml")
    task = task_node("ruler")
    task.update(
        subsets=["niah_multikey_1", "fwe"],
        lengths=[1024],
        num_samples=1,
        haystack=str(ruler_essays),
        queries_per_context=2,
        compression="question_agnostic",
    )
    from kvbench.methods import method_node

    cfg = {
        "model": OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "tiny_llama.yaml")),
        "method": method_node("snapkv"),
        "task": task,
        "budget": {**OmegaConf.to_container(base.budget), "token_ratio": 0.2},
        "profile": OmegaConf.to_container(base.profile),
        "output_dir": str(tmp_path / "runs"),
        "progress": False,
    }
    metrics = run(cfg).metrics
    assert metrics["queries_asked"] == 3  # two keys of niah_multikey_1, fwe's one question
    assert set(metrics["task_query"]["niah_multikey_1"]) == {"0", "1"} and set(metrics["task_query"]["fwe"]) == {"0"}
    assert metrics["protocol"]["compression"] == "question_agnostic"


# ---------------------------------------------------------------------------------------------- figures
def fake_records(scores, compression):
    return [
        {
            "score": sum(s) / len(s),
            "meta": {"compression": compression, "task": "niah_single_1", "length": 1024},
            "queries": [{"index": i, "score": v} for i, v in enumerate(s)],
        }
        for s in scores
    ]


def test_score_by_query_figure(tmp_path):
    from kvbench.plots import score_by_query

    runs = [
        ("snapkv\nratio 0.1  (50.0)", fake_records([[100, 0, 50]], "question_aware")),
        ("snapkv\nratio 0.1  (20.0)", fake_records([[20, 20, 20]], "question_agnostic")),
        ("full\nfull cache  (100.0)", fake_records([[100, 100, 100]], "question_agnostic")),
    ]
    path = score_by_query(runs, tmp_path / "q.png")
    assert path.stat().st_size > 5000
    with pytest.raises(ConfigError, match="queries_per_context"):
        score_by_query([("x", [{"score": 1.0, "meta": {}}])], tmp_path / "none.png")


def test_ruler_by_length_figure(tmp_path):
    from kvbench.plots import ruler_by_length

    records = [
        {"score": s, "meta": {"task": t, "length": n}}
        for t, n, s in [("vt", 4096, 100.0), ("cwe", 4096, 50.0), ("vt", 8192, 40.0), ("cwe", 8192, 0.0)]
    ]
    path = ruler_by_length([("full\nfull cache", records), ("snapkv\nratio 0.1", records[:2])], tmp_path / "r.png")
    assert path.stat().st_size > 5000


def write_ruler_run(root, name, method, length, scores, **task):
    """A finished synthetic RULER run at ``root/name``: one sample per (task, score) in ``scores``;
    ``task`` adds task config keys."""
    import yaml

    from kvbench.results import RunDir

    task_cfg = {"name": "ruler", "lengths": [length], **task}
    config = {"model": {"name": "m"}, "method": {"name": method}, "task": task_cfg}
    run_dir = RunDir(root / name)
    run_dir.create(yaml.safe_dump(config), {}, total=len(scores))
    for index, (task, score) in enumerate(scores.items()):
        run_dir.append({"id": f"{name}-{index}", "score": score, "meta": {"task": task, "length": length}})
    mean = sum(scores.values()) / len(scores)
    run_dir.write_metrics({"n": len(scores), "score": mean, "per_subset": {**scores, f"len{length}": mean}})
    run_dir.set_status("finished")


def test_report_joins_ruler_runs_split_by_length_into_one_curve(tmp_path, monkeypatch):
    """A RULER sweep run one length per run (benchmarks/multiquery.sh) draws one line per method:
    the runs that differ only in task.lengths (and task.num_samples: the longer length is often run with
    fewer draws) have their samples joined; other methods, and runs with another seed, stay apart."""
    from kvbench.report import comparison_figure
    from kvbench.tasks.ruler import Ruler

    write_ruler_run(tmp_path / "runs", "a", "full", 4096, {"vt": 100.0}, num_samples=5)
    write_ruler_run(tmp_path / "runs", "b", "full", 8192, {"vt": 60.0}, num_samples=2)
    write_ruler_run(tmp_path / "runs", "c", "snapkv", 4096, {"vt": 20.0}, num_samples=5)
    write_ruler_run(tmp_path / "runs", "d", "snapkv", 8192, {"vt": 10.0}, num_samples=2, seed=7)
    drawn = {}

    def capture(cls, runs, path):
        drawn["runs"] = runs
        return path

    monkeypatch.setattr(Ruler, "comparison_figure", classmethod(capture))
    comparison_figure([tmp_path / "runs"], tmp_path / "r.png")
    lines = {title: sorted(r["meta"]["length"] for r in records) for title, records in drawn["runs"]}
    assert lines == {"full": [4096, 8192], "snapkv\n(20.0)": [4096], "snapkv\n(10.0)": [8192]}, lines


def test_report_pivots_a_runs_subsets_by_method(tmp_path):
    """`kvbench report --pivot dataset method`: RULER's task-by-method table straight from the runs."""
    from kvbench.report import pivot_table

    write_ruler_run(tmp_path / "runs", "a", "full", 4096, {"vt": 100.0, "cwe": 50.0})
    write_ruler_run(tmp_path / "runs", "b", "snapkv", 4096, {"vt": 20.0, "cwe": 0.0})
    table = pivot_table([tmp_path / "runs"], ["dataset"], ["method"], fmt="csv").splitlines()
    assert table == ["dataset,full,snapkv", "average,75.0,10.0", "cwe,50.0,0.0", "len4096,75.0,10.0", "vt,100.0,20.0"]
    one = pivot_table([tmp_path / "runs"], ["dataset"], [], where={"method": "snapkv"}, fmt="csv").splitlines()
    assert one == ["dataset,score", "average,10.0", "cwe,0.0", "len4096,10.0", "vt,20.0"]
