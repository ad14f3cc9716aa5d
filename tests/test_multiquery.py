"""Shared-context multi-query in the engine: equivalence with separate prompts, bit-exact rollback for
every method, compression before any question, kept conversations."""

import copy
from collections import deque

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.context import GenerationContext
from kvbench.engine.conversation import converse
from kvbench.engine.decode import StaticDecoder
from kvbench.engine.generate import generate
from kvbench.errors import ConfigError
from kvbench.kv.store import KVStore
from kvbench.methods import available_methods, create_method
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.methods.selection import compose
from kvbench.requests import MultiQueryRequest, Query, Segment

NEW = 10
REUSE = ("cacheblend", "cachecraft", "full_reuse", "prefix_cache", "random_recomp", "prefill_h2o", "set_cache")


def ids(n, seed, vocab=250):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def queries(questions, n=NEW, followups=None):
    followups = followups or [None] * len(questions)
    return tuple(Query(q, n, followup_ids=f, min_new_tokens=n) for q, f in zip(questions, followups))


def talk(
    loaded,
    name,
    context,
    questions,
    *,
    compression="question_agnostic",
    keep=False,
    segments=None,
    n=NEW,
    followups=None,
    **budget,
):
    request = MultiQueryRequest(
        context, queries(questions, n, followups), compression=compression, keep_answers=keep, context_segments=segments
    )
    return converse(loaded, create_method({"name": name}), request, budget=BudgetConfig(**budget))


def single(loaded, name, prompt, n=NEW, segments=None, **budget):
    return generate(
        loaded,
        create_method({"name": name}),
        prompt,
        max_new_tokens=n,
        min_new_tokens=n,
        segments=segments,
        budget=BudgetConfig(**budget),
    ).tokens


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
    """Wraps KVStore.snapshot / restore and the decode step: an independent copy of the store when the
    snapshot is taken, what the store held just before each restore and after it, and every decode
    step's attention output, by question."""

    def __init__(self, monkeypatch):
        self.copies, self.before, self.after, self.outputs = [], [], [], [[]]
        snapshot, restore, decode = KVStore.snapshot, KVStore.restore, GenerationContext._decode
        recorder = self

        def snap(store):
            recorder.copies.append(recorder.copy(store))
            return snapshot(store)

        def back(store, snaps):
            recorder.before.append(recorder.copy(store))
            restore(store, snaps)
            recorder.after.append(recorder.copy(store))
            recorder.outputs.append([])

        def step(ctx, module, layer, query, kv, scaling):
            out = decode(ctx, module, layer, query, kv, scaling)
            recorder.outputs[-1].append(out.clone())
            return out

        def static_step(decoder, layer, query, key, value):
            out = static_attend(decoder, layer, query, key, value)
            if decoder.kinds[layer] != "dynamic":  # (a dynamic layer's step is recorded by _decode)
                recorder.outputs[-1].append(out.clone())
            return out

        static_attend = StaticDecoder.attend
        monkeypatch.setattr(KVStore, "snapshot", snap)
        monkeypatch.setattr(KVStore, "restore", back)
        monkeypatch.setattr(GenerationContext, "_decode", step)  # (a dynamic step: H2O, StreamingLLM)
        monkeypatch.setattr(StaticDecoder, "attend", static_step)

    @staticmethod
    def copy(store):
        return [
            (
                layer.keys.clone(),
                layer.values.clone(),
                layer.positions.clone(),
                layer.n,
                layer.seen,
                layer.resident_sink,
                layer.resident_recent,
            )
            for layer in store.layers
        ]

    @staticmethod
    def equal(a, b):
        return all(
            torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2]) and x[3:] == y[3:]
            for x, y in zip(a, b, strict=True)
        )

    def same_steps(self, i, j):
        """Questions ``i`` and ``j`` went through identical decode steps (every layer's attention output)."""
        x, y = self.outputs[i], self.outputs[j]
        return len(x) == len(y) > 0 and all(torch.equal(a, b) for a, b in zip(x, y))


def same_state(a, b):
    """Deep equality of method states (tensors bit for bit; dicts, sequences, dataclasses recursively)."""
    import dataclasses

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, deque)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same_state(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    return a == b


def reuse_context():
    prefix, first, second = ids(20, seed=30), ids(200, seed=31), ids(220, seed=32)
    segments = (Segment(prefix, "prefix"), Segment(first, "chunk"), Segment(second, "chunk"))
    return prefix + first + second, segments


def watch_state(method):
    """Record a deep copy of the method's snapshot when taken, and its state right after each restore."""
    taken, restored = [], []
    snapshot, restore = method.snapshot, method.restore

    def snap():
        state = snapshot()
        taken.append(copy.deepcopy(state))
        return state

    def back(state):
        restore(state)
        restored.append(copy.deepcopy(snapshot()))

    method.snapshot, method.restore = snap, back
    return taken, restored


def ask(
    loaded, method, context, questions, followups, *, compression="question_agnostic", segments=None, n=NEW, **budget
):
    request = MultiQueryRequest(
        context, queries(questions, n, followups), compression=compression, context_segments=segments
    )
    return converse(loaded, method, request, budget=BudgetConfig(**budget))


@pytest.mark.parametrize("name", available_methods())
def test_rollback_restores_the_store_and_the_method_exactly(name, tiny_llama, monkeypatch):
    """Every registered method: after each answer the store is bit-identical to its post-context state
    (H2O's and StreamingLLM's decode-time evictions undone), the method's own state is what it was then
    (Quest's page bounds, ClusterKV's clusters and cache history, InfLLM's blocks, PQCache's codes of
    new tokens, H2O's scores — compared with a deep copy taken at the snapshot, so state that decode
    changes in place behind a shallow snapshot is caught), and a question asked again after another one
    goes through exactly the same decode steps."""
    recorder = Recorder(monkeypatch)
    a, b, c = ids(12, seed=20), ids(15, seed=21), ids(9, seed=22)
    if name in REUSE:  # question-aware (a reuse prefill needs a question); the repeated one is a follow-up
        context, segments = reuse_context()
        questions, followups, compression, repeated = (
            [a, b, c, b],
            [a, [7] + b, [7] + c, [7] + b],
            "question_aware",
            (1, 3),
        )
    else:
        context, segments = ids(500, seed=2), None
        questions, followups, compression, repeated = [a, b, a], [a, b, a], "question_agnostic", (0, 2)
    method = create_method({"name": name})
    taken, restored = watch_state(method)
    ask(
        tiny_llama,
        method,
        context,
        questions,
        followups,
        compression=compression,
        segments=segments,
        n=16,
        token_ratio=0.1,
    )
    # question-aware: the first answer stays (the snapshot follows it), so one restore fewer
    restores = len(questions) - (2 if compression == "question_aware" else 1)
    assert len(recorder.copies) == 1 and len(recorder.after) == restores
    for before, after in zip(recorder.before, recorder.after):
        assert not Recorder.equal(before, recorder.copies[0]), "the question and answer should have changed the store"
        assert Recorder.equal(after, recorder.copies[0])
    assert len(restored) == restores and all(same_state(state, taken[0]) for state in restored)
    if name not in REUSE:  # (reuse methods have no decode-time selection: their steps are dense)
        assert recorder.same_steps(*repeated)


class Drifting(RetrievalMethod):
    """A test method whose selection depends on decode-time state (a step counter), to show that the
    repeated-question check catches a method that does not roll its state back."""

    name = "test_drifting"

    def start(self, ctx):
        super().start(ctx)
        self.steps = 0

    def select(self, layer, query, kv):
        if layer == 0:
            self.steps += 1
        lay = self.layout(kv)
        offset = (7 * self.steps) % max(1, lay.middle - self.ctx.budget.select)
        chosen = lay.candidates(kv.home)[offset : offset + self.ctx.budget.select]
        return compose(lay, chosen.expand(kv.n_kv_heads, -1))

    def snapshot(self):
        return self.steps

    def restore(self, state):
        self.steps = state


@pytest.mark.parametrize("rolls_back", [True, False])
def test_the_repeated_question_check_catches_state_that_is_not_rolled_back(rolls_back, tiny_llama, monkeypatch):
    recorder = Recorder(monkeypatch)
    method = Drifting({})
    if not rolls_back:
        method.restore = lambda state: None
    a, b = ids(12, seed=20), ids(15, seed=21)
    ask(tiny_llama, method, ids(500, seed=2), [a, b, a], [a, b, a], n=8, token_ratio=0.1)
    assert recorder.same_steps(0, 2) == rolls_back


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
            talk(
                tiny_llama,
                name,
                context,
                [question, question],
                compression=compression,
                followups=[question, question],
                n=2,
                token_ratio=0.1,
            )
            positions = [layer[2] for layer in recorder.copies[0]]
            kept[compression, seed] = [
                row[row < len(context)] for p in positions for row in p
            ]  # per head row: the context's kept slots
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


def test_question_aware_follow_ups_come_after_the_first_question_and_its_answer(tiny_llama):
    """Question-aware with answers dropped: the first turn (prefilled with the context) closes with its
    answer, and every later question follows it — the second and third questions see the same cache
    (the third does not see the second's answer)."""
    context, a, b, c = ids(400, seed=5), ids(10, seed=52), ids(11, seed=53), ids(9, seed=54)
    turns = talk(
        tiny_llama, "full", context, [a, b, c], compression="question_aware", followups=[a, [9] + b, [9] + c]
    ).turns
    first = turns[0].tokens
    assert first == single(tiny_llama, "full", context + a)
    # no stop ids on the tiny model: the first answer ended at its length; all of it precedes the follow-up
    assert turns[1].tokens == single(tiny_llama, "full", context + a + first + [9] + b)
    assert turns[2].tokens == single(tiny_llama, "full", context + a + first + [9] + c)
    assert [t.question_tokens for t in turns[1:]] == [2 + len(b), 2 + len(c)]  # the carried token, 9, the question


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "quest", "pqcache", "clusterkv", "oracle"])
def test_one_question_aware_is_todays_generation(name, tiny_qwen2):
    context, question = ids(500, seed=6), ids(12, seed=54)
    turns = talk(tiny_qwen2, name, context, [question], compression="question_aware", n=16, token_ratio=0.1).turns
    assert turns[0].tokens == single(tiny_qwen2, name, context + question, n=16, token_ratio=0.1)


@pytest.mark.parametrize("name", ["h2o", "quest", "full"])
def test_selective_methods_take_a_question_token_by_token(name, tiny_llama, monkeypatch):
    """Eviction and retrieval methods take a question one token at a time, each a decode step of the
    method (H2O keeps its cache at the budget throughout); dense methods extend the cache in one pass."""
    recorder = Recorder(monkeypatch)
    question = ids(20, seed=55)
    conversation = talk(tiny_llama, name, ids(600, seed=7), [question, question], n=5, token_ratio=0.1)
    per_token = name != "full"
    steps = (len(question) if per_token else 0) + 5 - 1
    assert [len(turn) for turn in recorder.outputs] == [steps * tiny_llama.spec.n_layers] * 2
    if name == "h2o":
        budget = conversation.budget
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
