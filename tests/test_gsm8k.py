import pytest

from kvbench.errors import ConfigError
from kvbench.tasks import create_task
from kvbench.tasks.gsm8k_cot import WEI8, extract, gold_number

from .conftest import SHARED_DATA

GSM = SHARED_DATA / "gsm8k"


def test_gold_and_extraction_rules():
    assert gold_number("She makes 9 * 2 = $18 every day.\n#### 1,018") == 1018.0
    text = "So 12 + 6 = 18 eggs. The answer is 18. Then 42 more"
    assert extract(text, "answer_is") == 18.0
    assert extract(text, "last_number") == 42.0  # PQCache's rule: the last number wins
    assert extract("Total is $1,250.50 in all", "answer_is") == 1250.5  # no "The answer is": last number
    assert extract("no digits here", "answer_is") is None
    assert extract("The answer is -3", "answer_is") == -3.0
    assert extract("The answer is -3", "last_number") == 3.0  # \d*\.?\d+ ignores the sign, as PQCache's code does


@pytest.mark.skipif(not GSM.exists(), reason="needs ../shared/data/gsm8k")
def test_pqcache_prompt_is_the_authors_format():
    task = create_task({"name": "gsm8k_cot", "data_dir": str(GSM), "limit": 3})
    shots = (GSM / "pqcache_gsm8k_prompt_formal.txt").read_text()
    assert shots.count("Question: ") == 10 and shots.count("The answer is") == 10
    samples = list(task.samples(None))
    assert [s.id for s in samples] == task.sample_ids() == ["test-0", "test-1", "test-2"]
    first = samples[0]
    assert first.prompt == shots + "\nQuestion: " + first.meta["question"] + "\n"
    assert first.reference == 18.0 and not first.use_template and first.max_new_tokens == 256
    assert first.stop_texts == ("\nQuestion: ",)
    assert task.score(first, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nThe answer is 18") == 100.0
    assert task.score(first, "The answer is 17") == 0.0


@pytest.mark.skipif(not GSM.exists(), reason="needs ../shared/data/gsm8k")
def test_wei8_and_question_first():
    wei = create_task({"name": "gsm8k_cot", "data_dir": str(GSM), "protocol": "wei8", "limit": 1})
    sample = next(iter(wei.samples(None)))
    assert sample.prompt.count("Q: ") == 9 and sample.prompt.endswith("\nA:") and len(WEI8) == 8
    start = create_task({"name": "gsm8k_cot", "data_dir": str(GSM), "question_position": "start", "limit": 1})
    prompt = next(iter(start.samples(None))).prompt
    assert prompt.startswith("Question: Janet") and prompt.index("Janet") < prompt.index("Angelo")


def test_pqcache_protocol_needs_its_prompt_file(tmp_path):
    (tmp_path / "test.jsonl").write_text('{"question": "q?", "answer": "#### 1"}\n')
    task = create_task({"name": "gsm8k_cot", "data_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="PQCache's GSM8k prompt"):
        list(task.samples(None))
    assert (
        next(
            iter(create_task({"name": "gsm8k_cot", "data_dir": str(tmp_path), "protocol": "wei8"}).samples(None))
        ).reference
        == 1.0
    )


def test_extraction_defaults_to_the_protocols_rule(tmp_path):
    """protocol=pqcache scores the last number, as PQCache's evaluation does; wei8 the "The answer is" number."""
    from kvbench.tasks.base import Sample

    sample = Sample(id="x", reference=18.0)
    tail = "The answer is 18. Then 42 more"  # the two rules disagree
    pq = create_task({"name": "gsm8k_cot", "data_dir": str(tmp_path)})
    assert pq.extraction == "last_number" and pq.score(sample, tail) == 0.0
    assert pq.score(sample, "9 * 2 = 18") == 100.0
    wei = create_task({"name": "gsm8k_cot", "protocol": "wei8"})
    assert wei.extraction == "answer_is" and wei.score(sample, tail) == 100.0
    explicit = create_task({"name": "gsm8k_cot", "extraction": "answer_is"})
    assert explicit.extraction == "answer_is" and explicit.score(sample, tail) == 100.0
    with pytest.raises(ConfigError, match="extraction"):
        create_task({"name": "gsm8k_cot", "extraction": "first"})
