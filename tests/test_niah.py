import pytest

from kvbench.errors import ConfigError
from kvbench.tasks import create_task
from kvbench.tasks.niah import ANSWER, NEEDLE, _insert


@pytest.fixture
def essays(tmp_path):
    sentences = [f"Sentence number {i} talks about startups and code." for i in range(400)]
    (tmp_path / "a.txt").write_text(" ".join(sentences[:200]))
    (tmp_path / "b.txt").write_text(" ".join(sentences[200:]))
    return tmp_path


def niah(essays, **cfg):
    return create_task({"name": "niah", "data_dir": str(essays), **cfg})


def test_prompts_have_exactly_the_requested_length_and_one_needle(tiny_llama, essays):
    task = niah(essays, lengths=[800, 1500], depths=[0.0, 0.5, 1.0])
    samples = list(task.samples(tiny_llama))
    assert [s.id for s in samples] == task.sample_ids()
    needle = tiny_llama.tokenizer(NEEDLE, add_special_tokens=False).input_ids
    for sample in samples:
        assert len(sample.input_ids) == sample.meta["length"]
        text = tiny_llama.tokenizer.decode(sample.input_ids)
        assert text.count("Dolores Park") == 1
        assert text.rstrip().endswith("<|im_start|>assistant")
        assert len(needle) > 10


def test_needle_depth_and_sentence_boundary():
    context = [1, 2, 9, 3, 4, 9, 5, 6, 7, 8]  # 9 ends a sentence
    needle = [100, 101]
    assert _insert(context, needle, 0.0, frozenset({9})) == needle + context
    assert _insert(context, needle, 1.0, frozenset({9})) == context + needle
    # depth 0.5 -> point 5; tokens before it: context[4]=4, context[3]=3, context[2]=9 (a sentence end),
    # so the needle goes in at index 3. Depth 0.7 -> point 7; context[6]=5, context[5]=9 -> index 6.
    assert _insert(context, needle, 0.5, frozenset({9})) == [1, 2, 9] + needle + [3, 4, 9, 5, 6, 7, 8]
    assert _insert(context, needle, 0.7, frozenset({9})) == [1, 2, 9, 3, 4, 9] + needle + [5, 6, 7, 8]


def test_question_position_moves_only_the_question(tiny_llama, essays):
    end = next(iter(niah(essays, lengths=[900], depths=[0.5]).samples(tiny_llama)))
    start = next(iter(niah(essays, lengths=[900], depths=[0.5], question_position="start").samples(tiny_llama)))
    decode = tiny_llama.tokenizer.decode
    q = "What is the best thing to do in San Francisco?"
    end_text, start_text = decode(end.input_ids), decode(start.input_ids)
    assert end_text.index(q) > end_text.index("Dolores Park")
    assert start_text.index(q) < start_text.index("Dolores Park")
    assert len(start.input_ids) == len(end.input_ids) == 900


def test_scores():
    task = create_task({"name": "niah"})
    sample = type("S", (), {"reference": ANSWER})()
    assert task.score(sample, "The best thing is to eat a sandwich and sit in Dolores Park on a sunny day.") == 100
    assert task.score(sample, "Go to the beach.") == 0
    half = task.score(sample, "sit in Dolores Park")
    assert 0 < half < 60  # 4 of the answer's 12 words (stemmed unigrams, 'in' and 'sit' counted once)
    sub = create_task({"name": "niah", "scorer": "substring"})
    assert sub.score(sample, "dolores park!") == 100 and sub.score(sample, "a park") == 0


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"depths": [1.5]}, "depths"),
        ({"lengths": [10]}, "lengths"),
        ({"question_position": "middle"}, "question_position"),
        ({"scorer": "bleu"}, "scorer"),
        ({"bogus": 1}, "no option"),
    ],
)
def test_bad_task_options(cfg, match):
    with pytest.raises(ConfigError, match=match):
        create_task({"name": "niah", **cfg})
