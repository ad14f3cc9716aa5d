import json

import pytest

from kvbench.errors import ConfigError
from kvbench.tasks import create_task
from kvbench.tasks.longbench import middle_truncate, move_question_first
from kvbench.tasks.longbench_protocol import DATASETS, GROUPS

from .conftest import SHARED_DATA

LB = SHARED_DATA / "longbench"
needs_data = pytest.mark.skipif(not LB.exists(), reason="needs ../shared/data/longbench")


@needs_data
def test_builtin_prompts_and_lengths_are_the_official_files():
    prompts = json.loads((LB / "config" / "dataset2prompt.json").read_text())
    maxlen = json.loads((LB / "config" / "dataset2maxlen.json").read_text())
    assert set(prompts) == set(DATASETS)
    for name, dataset in DATASETS.items():
        assert dataset.prompt == prompts[name] and dataset.max_new_tokens == maxlen[name]
    assert "asconcisely" in DATASETS["narrativeqa"].prompt
    assert len(GROUPS["pqcache"]) == 14 and len(GROUPS["clusterkv"]) == 8


def test_middle_truncation_keeps_both_ends(tiny_llama):
    tok = tiny_llama.tokenizer
    text = "HEAD" + "x" * 500 + "TAIL"
    kept, cut = middle_truncate(tok, text, 100)
    assert cut and kept.startswith("HEAD") and kept.endswith("TAIL") and len(kept) == 100
    same, cut = middle_truncate(tok, "short", 100)
    assert same == "short" and not cut


def test_question_first_template():
    moved = move_question_first(DATASETS["hotpotqa"].prompt)
    assert moved.startswith("Question: {input}\n\nAnswer the question based on the given passages.")
    assert moved.endswith("do not output any other words.\n\nAnswer:") and moved.count("{input}") == 1
    assert move_question_first(DATASETS["multifieldqa_zh"].prompt).startswith("问题：{input}\n\n阅读以下文字")
    with pytest.raises(ConfigError):
        move_question_first(DATASETS["gov_report"].prompt)


@needs_data
def test_samples_follow_the_protocol(tiny_llama):
    task = create_task(
        {
            "name": "longbench",
            "subsets": ["multi_news", "passage_retrieval_zh"],
            "data_dir": str(LB / "full"),
            "limit": 2,
            "max_length": 1500,
        }
    )
    samples = list(task.samples(tiny_llama))
    assert [s.subset for s in samples] == ["multi_news"] * 2 + ["passage_retrieval_zh"] * 2
    first = samples[0]
    assert first.prompt.startswith("You are given several news passages.") and first.meta["truncated"]
    assert first.prompt.endswith("Now, write a one-page summary of all the news.\n\nSummary:")
    assert first.use_template and first.max_new_tokens == 512 and first.stop_tokens == ()
    assert len(tiny_llama.tokenizer(first.prompt).input_ids) <= 1500 + 4  # decode/re-encode may shift a little
    assert first.id.startswith("multi_news-") and first.reference["answers"]


def test_samsum_stops_at_newline_and_skips_the_template(tiny_llama, tmp_path):
    row = {
        "input": "Dialogue: A: hi\nSummary: ",
        "context": "Dialogue: x\nSummary: y",
        "answers": ["A greets."],
        "length": 9,
        "all_classes": None,
        "_id": "s1",
    }
    (tmp_path / "samsum.jsonl").write_text(json.dumps(row) + "\n")
    sample = next(
        iter(create_task({"name": "longbench", "subsets": ["samsum"], "data_dir": str(tmp_path)}).samples(tiny_llama))
    )
    assert not sample.use_template and sample.stop_tokens == ("\n",) and sample.min_new_tokens == 1
    assert sample.prompt == DATASETS["samsum"].prompt.format(**row)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"subsets": ["nope"]}, "unknown LongBench subset"),
        ({"subsets": ["gov_report"], "question_position": "start"}, "QA datasets only"),
        ({"subsets": ["musique"], "e": True}, "LongBench-E has no musique"),
        ({"protocol": "mine"}, "protocol"),
    ],
)
def test_bad_options(cfg, match):
    with pytest.raises(ConfigError, match=match):
        create_task({"name": "longbench", **cfg})


def test_scores_through_the_task(tiny_llama, tmp_path):
    row = {
        "input": "Which city?",
        "context": "Paris is nice.",
        "answers": ["Paris"],
        "length": 3,
        "all_classes": None,
        "_id": "q1",
    }
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    task = create_task({"name": "longbench", "subsets": ["hotpotqa"], "data_dir": str(tmp_path)})
    sample = next(iter(task.samples(tiny_llama)))
    # "The city of Paris" -> [city, of, paris]: P = 1/3, R = 1 -> F1 = 0.5
    assert task.score(sample, "Paris") == 100.0 and task.score(sample, "The city of Paris") == pytest.approx(50.0)
    records = [
        {"subset": "hotpotqa", "score": 100.0, "meta": {}},
        {"subset": "hotpotqa", "score": 0.0, "meta": {}},
        {"subset": "trec", "score": 50.0, "meta": {}},
    ]
    assert task.aggregate(records) == {
        "score": 50.0,
        "n": 3,
        "scored": 3,
        "per_subset": {"hotpotqa": 50.0, "trec": 50.0},
    }


def test_pqcache_protocol_formats_prompts_as_its_pred_script(tiny_llama, tmp_path):
    """PQCache's vq_pred.py: Llama-3(.1) gets the template with "You are a helpful assistant.", Mistral the
    raw "[INST]{prompt}[/INST]"; both rendered texts are tokenised with special tokens; models it has no
    rule for keep their own template; the no-chat datasets stay raw."""
    from types import SimpleNamespace

    from kvbench.tasks.longbench_protocol import pqcache_chat_style

    assert [
        pqcache_chat_style(n)
        for n in ("llama31_8b_instruct", "mistral7b_instruct_v02", "llama2-7b-chat-4k", "smollm2_135m")
    ] == ["system", "inst", "inst", None]
    row = {
        "input": "Which city?",
        "context": "Paris is nice.",
        "answers": ["Paris"],
        "length": 3,
        "all_classes": None,
        "_id": "q1",
    }
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "trec.jsonl").write_text(json.dumps({**row, "_id": "t1"}) + "\n")
    tok = tiny_llama.tokenizer

    def samples(name, protocol="pqcache"):
        model = SimpleNamespace(spec=SimpleNamespace(name=name, max_length=16384), tokenizer=tok, chat=tiny_llama.chat)
        task = create_task(
            {"name": "longbench", "subsets": ["hotpotqa", "trec"], "data_dir": str(tmp_path), "protocol": protocol}
        )
        return {s.subset: s for s in task.samples(model)}, task

    prompt = DATASETS["hotpotqa"].prompt.format(**row)
    llama, task = samples("llama31_8b_instruct")
    text = tok.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert llama["hotpotqa"].input_ids == tok(text, add_special_tokens=True).input_ids
    assert "You are a helpful assistant." in tok.decode(llama["hotpotqa"].input_ids)
    assert llama["hotpotqa"].meta["prompt_format"] == "pqcache_system"
    assert llama["trec"].input_ids is None and not llama["trec"].use_template  # raw, as in every protocol
    assert "vq_pred.py" in task.protocol()["chat_template"]
    mistral, _ = samples("mistral7b_instruct_v02")
    assert mistral["hotpotqa"].input_ids == tok(f"[INST]{prompt}[/INST]", add_special_tokens=True).input_ids
    other, _ = samples("smollm2_135m")
    assert other["hotpotqa"].input_ids is None and other["hotpotqa"].use_template
    assert other["hotpotqa"].meta["prompt_format"] == "model_template"
    official, _ = samples("llama31_8b_instruct", protocol="official")
    assert official["hotpotqa"].input_ids is None  # only the pqcache protocol uses PQCache's format
