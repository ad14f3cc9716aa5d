"""Shared-context multi-query in the engine: equivalence with separate prompts, bit-exact rollback for
every method, compression before any question, kept conversations."""

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.conversation import converse
from kvbench.engine.generate import generate
from kvbench.errors import ConfigError
from kvbench.kv.store import KVStore
from kvbench.methods import available_methods, create_method
from kvbench.requests import MultiQueryRequest, Query, Segment

NEW = 10
REUSE = ("cacheblend", "full_reuse", "prefix_cache")


def ids(n, seed, vocab=250):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def queries(questions, n=NEW, followups=None):
    followups = followups or [None] * len(questions)
    return tuple(Query(q, n, followup_ids=f, min_new_tokens=n) for q, f in zip(questions, followups))


def talk(loaded, name, context, questions, *, compression="question_agnostic", keep=False, segments=None, n=NEW,
         followups=None, **budget):
    request = MultiQueryRequest(context, queries(questions, n, followups), compression=compression, keep_answers=keep,
                                context_segments=segments)
    return converse(loaded, create_method({"name": name}), request, budget=BudgetConfig(**budget))


def single(loaded, name, prompt, n=NEW, segments=None, **budget):
    return generate(loaded, create_method({"name": name}), prompt, max_new_tokens=n, min_new_tokens=n,
                    segments=segments, budget=BudgetConfig(**budget)).tokens


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_full_asks_n_questions_exactly_as_n_separate_prompts(fixture, request):
    loaded = request.getfixturevalue(fixture)
    context = ids(500, seed=1)
    questions = [ids(9 + i, seed=10 + i) for i in range(3)]
    conversation = talk(loaded, "full", context, questions)
    answers = [turn.tokens for turn in conversation.turns]
    assert answers == [single(loaded, "full", context + q) for q in questions]
    assert len({tuple(a) for a in answers}) == 3, "different questions should get different answers (teeth)"
    assert [t.question_tokens for t in conversation.turns] == [len(q) for q in questions]


class Recorder:
    """Wraps KVStore.snapshot / restore: an independent copy of the store when the snapshot is taken,
    what the store held just before each restore, and what it held after."""

    def __init__(self, monkeypatch):
        self.copies, self.before, self.after = [], [], []
        snapshot, restore = KVStore.snapshot, KVStore.restore
        recorder = self

        def snap(store):
            recorder.copies.append(recorder.copy(store))
            return snapshot(store)

        def back(store, snaps):
            recorder.before.append(recorder.copy(store))
            restore(store, snaps)
            recorder.after.append(recorder.copy(store))

        monkeypatch.setattr(KVStore, "snapshot", snap)
        monkeypatch.setattr(KVStore, "restore", back)

    @staticmethod
    def copy(store):
        return [(layer.keys.clone(), layer.values.clone(), layer.positions.clone(), layer.n, layer.seen,
                 layer.resident_sink, layer.resident_recent) for layer in store.layers]

    @staticmethod
    def equal(a, b):
        return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) and x[3:] == y[3:]
                   for x, y in zip(a, b, strict=True))


def reuse_context():
    prefix, first, second = ids(20, seed=30), ids(200, seed=31), ids(220, seed=32)
    segments = (Segment(prefix, "prefix"), Segment(first, "chunk"), Segment(second, "chunk"))
    return prefix + first + second, segments


@pytest.mark.parametrize("name", available_methods())
def test_rollback_restores_the_store_bit_exactly_and_the_same_question_gets_the_same_answer(name, tiny_llama, monkeypatch):
    """Every registered method: after each answer the store is bit-identical to its post-context state
    (H2O's and StreamingLLM's decode-time evictions undone), and a question asked again after another
    one gets exactly its first answer (the method's own state is rolled back too: Quest's page bounds,
    ClusterKV's clusters, InfLLM's blocks, PQCache's codes of new tokens, H2O's scores)."""
    recorder = Recorder(monkeypatch)
    if name in REUSE:
        context, segments = reuse_context()
        compression = "question_aware"
    else:
        context, segments, compression = ids(600, seed=2), None, "question_agnostic"
    a, b = ids(12, seed=20), ids(15, seed=21)
    # the question-aware first question is prefilled; the others are fed as follow-ups
    followups = [a, b, a] if compression == "question_agnostic" else [a, [7] + b, [7] + a]
    conversation = talk(tiny_llama, name, context, [a, b, a], compression=compression, segments=segments,
                        followups=followups, n=40, token_ratio=0.1)
    assert len(recorder.copies) == 1 and len(recorder.after) == 2
    for before, after in zip(recorder.before, recorder.after):
        assert not Recorder.equal(before, recorder.copies[0]), "the question and answer should have changed the store"
        assert Recorder.equal(after, recorder.copies[0])
    turns = conversation.turns
    if compression == "question_agnostic":
        assert turns[2].tokens == turns[0].tokens
        assert turns[2].telemetry["held_tokens"] == turns[0].telemetry["held_tokens"]
    else:  # the first question was in the prefill: ask the follow-up form twice instead
        assert turns[1].question_tokens == len(b) + 1 and turns[2].question_tokens == len(a) + 1


def test_a_method_that_forgets_its_state_is_caught(tiny_llama, monkeypatch):
    """Teeth for the test above: Quest without its restore answers a repeated question differently."""
    from kvbench.methods.quest import Quest

    context, a, b = ids(600, seed=2), ids(12, seed=20), ids(15, seed=21)
    kept = talk(tiny_llama, "quest", context, [a, b, a], n=40, token_ratio=0.1).turns
    assert kept[2].tokens == kept[0].tokens
    monkeypatch.setattr(Quest, "restore", lambda self, state: None)
    leaked = talk(tiny_llama, "quest", context, [a, b, a], n=40, token_ratio=0.1).turns
    assert leaked[2].tokens != leaked[0].tokens


EVICTING = ("snapkv", "pyramidkv", "h2o", "streamingllm")


@pytest.mark.parametrize("name", EVICTING)
def test_question_agnostic_compression_does_not_see_the_question(name, tiny_llama, monkeypatch):
    """What an eviction method keeps after the context does not depend on the question when it
    compresses before any question (while SnapKV's and H2O's choice does depend on it when the first
    question is in the prompt)."""
    context = ids(600, seed=3)
    kept = {}
    for compression in ("question_agnostic", "question_aware"):
        for seed in (40, 41):
            recorder = Recorder(monkeypatch)
            question = ids(30, seed=seed)
            talk(tiny_llama, name, context, [question, question], compression=compression,
                 followups=[question, question], n=2, token_ratio=0.1)
            positions = [layer[2] for layer in recorder.copies[0]]
            kept[compression, seed] = [p[p < len(context)] for p in positions]  # the context's kept slots
    agnostic = zip(kept["question_agnostic", 40], kept["question_agnostic", 41])
    assert all(torch.equal(x, y) for x, y in agnostic)
    assert all(p.shape[-1] < len(context) for p in kept["question_agnostic", 40]), "it should have compressed"
    if name in ("snapkv", "h2o"):
        aware = zip(kept["question_aware", 40], kept["question_aware", 41])
        assert not all(torch.equal(x, y) for x, y in aware), "with the question in view, the question matters"


def test_kept_answers_make_a_conversation(tiny_llama):
    """keep_answers: the second question follows the first answer (without its last token's stop
    meaning: the follow-up form closes the turn) — the same tokens as one prompt of the whole transcript."""
    context, a, b = ids(400, seed=4), ids(10, seed=50), ids(11, seed=51)
    followup_b = [5, 6] + b
    turns = talk(tiny_llama, "full", context, [a, b], keep=True, followups=[a, followup_b]).turns
    first = turns[0].tokens
    assert first == single(tiny_llama, "full", context + a)
    # no stop ids on the tiny model: the answer ended at its length, so its last token is fed first
    assert turns[1].question_tokens == 1 + len(followup_b)
    assert turns[1].tokens == single(tiny_llama, "full", context + a + first + followup_b)


def test_question_aware_follow_ups_come_after_the_first_question(tiny_llama):
    context, a, b = ids(400, seed=5), ids(10, seed=52), ids(11, seed=53)
    turns = talk(tiny_llama, "full", context, [a, b], compression="question_aware", followups=[a, [9] + b]).turns
    assert turns[0].tokens == single(tiny_llama, "full", context + a)
    assert turns[1].tokens == single(tiny_llama, "full", context + a + [9] + b)


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "quest", "pqcache", "clusterkv", "oracle"])
def test_one_question_aware_is_todays_generation(name, tiny_qwen2):
    context, question = ids(500, seed=6), ids(12, seed=54)
    turns = talk(tiny_qwen2, name, context, [question], compression="question_aware", n=16, token_ratio=0.1).turns
    assert turns[0].tokens == single(tiny_qwen2, name, context + question, n=16, token_ratio=0.1)


@pytest.mark.parametrize("name", ["h2o", "quest"])
def test_question_tokens_are_decode_steps_for_selective_methods(name, tiny_llama):
    """Eviction and retrieval methods take a question token by token: each one is a decode step of
    the method (attended counts recorded per step), so H2O keeps its cache at the budget throughout."""
    context, question = ids(600, seed=7), ids(20, seed=55)
    conversation = talk(tiny_llama, name, context, [question, question], n=5, token_ratio=0.1)
    budget = conversation.budget
    steps = len(conversation.telemetry["attended_per_layer"])  # one mean per layer
    assert steps == tiny_llama.spec.n_layers
    if name == "h2o":
        assert conversation.turns[0].telemetry["held_tokens"] == [budget.total] * tiny_llama.spec.n_layers


def test_a_reuse_method_with_nothing_to_compute_is_refused_question_agnostic(tiny_llama):
    context, segments = reuse_context()
    with pytest.raises(ConfigError, match="question_aware"):
        talk(tiny_llama, "full_reuse", context, [ids(8, seed=60)], segments=segments)


def test_telemetry_per_question(tiny_llama):
    context = ids(500, seed=8)
    conversation = talk(tiny_llama, "oracle", context, [ids(9, seed=61), ids(7, seed=62)], token_ratio=0.1)
    tele = conversation.telemetry
    assert tele["question_tokens"] == [9, 7] and tele["queries"] == 2 and tele["compression"] == "question_agnostic"
    assert len(tele["query_ttft_s"]) == 2 and all(t > 0 for t in tele["query_ttft_s"])
    assert tele["ttft_s"] > tele["prefill_s"]  # the first answer token comes after the first question's tokens
    assert tele["decode_steps"] == 2 * (NEW - 1)  # answer steps only; question tokens are not in TPOT
    for turn in conversation.turns:
        assert turn.telemetry["decode_steps"] == NEW - 1 and turn.telemetry["tpot_s"] > 0
