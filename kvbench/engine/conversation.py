"""Shared-context multi-query: prefill and compress a context once, then ask several questions in turn.

The complaint this measures: a method that compresses with the question in view (SnapKV's observation
window is the prompt's last tokens) looks excellent on one question and can collapse when a second
question arrives about the same context (SnapKV#18, SCBench). :func:`converse` runs a
:class:`~kvbench.requests.MultiQueryRequest` through the same :class:`GenerationContext`, store and
method hooks as a single generation:

1. **prefill** the prompt with the method's prefill plan — the context alone (``question_agnostic``:
   the method compresses before any question exists, as kvpress's query-agnostic evaluation does) or
   the context followed by the first question (``question_aware``: today's single-question behaviour);
   the method evicts or indexes as usual, and the silent-failure guard runs;
2. **snapshot** the store (every :class:`~kvbench.kv.store.LayerKV`, bit for bit) and the method's own
   state (:meth:`~kvbench.engine.protocol.KVMethod.snapshot`): the post-context state;
3. for each question: **feed** its tokens with the method active, then **answer** greedily, then
   (``keep_answers=false``, the default) **restore** the snapshot, so the next question sees the
   compressed context alone — including whatever H2O or StreamingLLM evicted while answering.
   ``question_aware``: the first question is part of the compressed prompt, so its turn stays and
   closes with its answer — the snapshot is taken after that answer, and every later question follows
   context, first question and first answer. Dropping that answer would leave an empty assistant turn
   before the next question, which both packaged models answer with the prompt's instructions
   (measured on one 4-needle, 4k NIAH context: Qwen2.5-Coder-0.5B with ``full`` scored 25 with the first answer
   dropped and 100 with it kept; SmolLM2 answered every later question with nothing).

How question tokens enter the cache follows each method's rule
(:attr:`~kvbench.engine.protocol.KVMethod.extends_with_many_tokens`): dense and reuse methods extend the
cache by the whole question in one pass (causal attention by position over everything held, the
same computation as a prefill of ``context + question``); eviction and retrieval methods take the
question one token at a time, as decode steps, so each question token attends what the method keeps
or selects for it — H2O scores and evicts, StreamingLLM slides its window, Quest/PQCache/ClusterKV
select, exactly as for generated tokens.

Which form of a question is fed (:class:`~kvbench.requests.Query`): its direct form (the tail of the
one-question prompt) when it follows the context itself — so with ``full``, question-agnostic
questions with answers dropped are token-identical to separate one-question prompts — and its
follow-up form (a new user turn) when something sits in between: the first question in
``question_aware`` mode (it was part of the compressed prompt and stays), or kept earlier answers.
A kept answer enters the cache without its stop token; the follow-up form closes the turn itself.

Telemetry per question (``turns[i].telemetry``): ``question_tokens``, ``question_s`` (feeding them),
``ttft_s`` (question in → first answer token: the feeding plus the first token's logits; for the
question-aware first question, the prefill), ``tpot_s`` and bytes moved. The conversation's telemetry
is the usual per-sample summary (``prefill_s`` = the context's prefill, ``ttft_s`` = start to the first
answer token, ``tpot_s`` over every answer's decode steps) plus ``query_ttft_s`` and ``rollback_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.engine.context import GenerationContext
from kvbench.engine.generate import Picker, _find_stop, _telemetry, eager_decode, serving
from kvbench.engine.prefill import PrefillPlan
from kvbench.engine.prefill_cache import PrefillSharing
from kvbench.engine.protocol import KVMethod
from kvbench.engine.settings import EngineSettings
from kvbench.errors import ConfigError
from kvbench.models.loading import LoadedModel
from kvbench.profile import Profile
from kvbench.requests import MultiQueryRequest, Query, Segment


@dataclass
class Turn:
    """One question's answer and its measurements."""

    tokens: list[int]  # generated ids, the stop token included when one ended the answer
    text: str
    stop_reason: str  # "stop" | "length" | "stop_text"
    question_tokens: int  # tokens fed for the question (0 for the question-aware first question)
    telemetry: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    """Every question's :class:`Turn`, the prefilled prompt's length, the budget and the telemetry."""

    turns: list[Turn]
    prompt_tokens: int
    budget: ResolvedBudget
    telemetry: dict[str, Any] = field(default_factory=dict)


def question_forms(request: MultiQueryRequest) -> list[tuple[int, ...]]:
    """The ids fed for each question (empty for the question-aware first question, which is prefilled
    with the context): the direct form right after the context, the follow-up form otherwise."""
    aware = request.compression == "question_aware"
    forms: list[tuple[int, ...]] = []
    for index, query in enumerate(request.queries):
        if aware and index == 0:
            forms.append(())
            continue
        after_context = not aware and (index == 0 or not request.keep_answers)
        forms.append(query.ids if after_context or query.followup_ids is None else query.followup_ids)
    return forms


def converse(
    loaded: LoadedModel,
    method: KVMethod,
    request: MultiQueryRequest,
    *,
    budget: BudgetConfig | None = None,
    profile: Profile | None = None,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Conversation:
    """Answer every question of ``request`` about its shared context, compressing the context once
    (see the module docs for the protocol)."""
    aware = request.compression == "question_aware"
    queries = request.queries
    prompt = list(request.context_ids) + (list(queries[0].ids) if aware else [])
    segments: tuple[Segment, ...] | None = None
    if request.context_segments is not None:
        segments = request.context_segments + ((Segment(queries[0].ids, "query"),) if aware else ())
    forms = question_forms(request)
    kept_first = aware and not request.keep_answers and len(queries) > 1  # the first turn stays (module docs)
    extra = _extra_tokens(request, forms, kept_first)
    ids = torch.tensor(prompt, dtype=torch.long)

    def check(plan: PrefillPlan) -> None:
        if plan.positions.numel() == 0:
            raise ConfigError(
                f"method {method.name} takes every context token from its caches, so the context cannot be "
                "prefilled before a question exists",
                "use task.compression=question_aware with this method",
            )

    with serving(loaded, method, ids, segments, extra, budget, profile, engine, sharing) as ctx:
        logits = ctx.prefill(ids, segments, check)
        assert ctx.telemetry.prefill_s is not None  # (measured by the prefill)
        # when the prefill would have started (a shared one ran earlier)
        start = ctx.clock.now() - ctx.telemetry.prefill_s
        ctx.check_after_prefill()
        turns, first_token_at, rollback_s = _ask_all(
            ctx, method, request, forms, kept_first, logits, len(prompt), start, torch.device(loaded.spec.device)
        )
        method.after_request(ctx, segments)
    summary = _summary(ctx, method, request, turns, first_token_at, rollback_s)
    return Conversation(turns=turns, prompt_tokens=len(prompt), budget=ctx.budget, telemetry=summary)


def _extra_tokens(request: MultiQueryRequest, forms: list[tuple[int, ...]], kept_first: bool) -> int:
    """The cache capacity the conversation needs beyond the prompt."""
    # the most the cache ever holds beyond the prompt: one question and its answer (+ a carried token),
    # or every question and answer when the conversation is kept
    extents = [len(form) + query.max_new_tokens + 1 for form, query in zip(forms, request.queries)]
    if request.keep_answers:
        return sum(extents)
    return extents[0] + max(extents[1:]) if kept_first else max(extents)


def _ask_all(
    ctx: GenerationContext,
    method: KVMethod,
    request: MultiQueryRequest,
    forms: list[tuple[int, ...]],
    kept_first: bool,
    logits: torch.Tensor,
    position: int,
    start: float,
    device: torch.device,
) -> tuple[list[Turn], float, float]:
    """Feed and answer each question in turn after the prefill: (turns, first answer token's time since
    ``start``, seconds spent restoring the snapshot)."""
    clock, tele, queries = ctx.clock, ctx.telemetry, request.queries
    assert tele.prefill_s is not None  # (measured by the prefill)
    turns: list[Turn] = []
    rollback_s = 0.0
    rollback = len(queries) > 1 and not request.keep_answers
    # after the context, or (kept_first) after the first answer
    saved = (ctx.store.snapshot(), method.snapshot()) if rollback and not kept_first else None
    carry: list[int] = []  # a kept answer's last token, generated but not yet in the cache
    saved_at, saved_carry = position, carry
    first_token_at: float | None = None
    checked = [False]
    for index, (query, form) in enumerate(zip(queries, forms)):
        asked_at = clock.now()
        steps_before = len(tele.step_s)
        bytes_before = ctx.store.stats().bytes_h2d
        feed = carry + list(form)
        if feed:
            logits = _feed(ctx, feed, position, device, checked)
            position += len(feed)
        question_s = clock.now() - asked_at
        answer = _Answer(ctx, query, device)
        token = answer.pick(logits)
        ttft = (tele.prefill_s if not feed else 0.0) + clock.now() - asked_at
        if first_token_at is None:
            first_token_at = clock.now() - start
        tokens, stop_reason = answer.run(token, position, checked)
        turn = _turn(ctx, query, tokens, stop_reason, len(feed), ttft, asked_at, steps_before, bytes_before, position)
        turn.telemetry["question_s"] = question_s
        turns.append(turn)
        if request.keep_answers or (kept_first and index == 0):
            fed = len(tokens) - 1  # every generated token but the last went through the model
            position += fed
            carry = [] if stop_reason == "stop" else tokens[-1:]
            if kept_first:
                saved = (ctx.store.snapshot(), method.snapshot())
                saved_at, saved_carry = position, carry
        elif saved is not None and index < len(queries) - 1:
            restore_at = clock.now()
            ctx.store.restore(saved[0])
            method.restore(saved[1])
            rollback_s += clock.now() - restore_at
            position, carry = saved_at, saved_carry
    assert first_token_at is not None  # (a request has at least one question)
    return turns, first_token_at, rollback_s


def _summary(
    ctx: GenerationContext,
    method: KVMethod,
    request: MultiQueryRequest,
    turns: list[Turn],
    first_token_at: float,
    rollback_s: float,
) -> dict[str, Any]:
    """The conversation's telemetry (the per-sample summary plus the per-question lists); drops the turns' step_s."""
    summary = _telemetry(ctx, method, sum(len(t.tokens) for t in turns))
    first_steps = turns[0].telemetry.get("step_s") or []
    summary.update(
        {
            "ttft_s": first_token_at,
            "tt2t_s": first_token_at + first_steps[0] if first_steps else None,
            "context_tokens": len(request.context_ids),
            "compression": request.compression,
            "keep_answers": request.keep_answers,
            "queries": len(request.queries),
            "query_ttft_s": [t.telemetry["ttft_s"] for t in turns],
            "question_tokens": [t.question_tokens for t in turns],
            "rollback_s": rollback_s,
        }
    )
    for turn in turns:
        turn.telemetry.pop("step_s", None)
    return summary


def _feed(
    ctx: GenerationContext, ids: Sequence[int], position: int, device: torch.device, checked: list[bool]
) -> torch.Tensor:
    """Put ``ids`` into the cache at ``position`` onwards with the method active; the last one's logits.

    One pass when the method may extend a held cache by several tokens, else one decode step per token
    (selection, eviction and the method's bookkeeping at every token)."""
    if ctx.method.extends_with_many_tokens:
        logits = ctx.forward(torch.tensor([list(ids)], device=device), start=position)
        _after_first_step(ctx, checked)
        return logits
    for offset, token in enumerate(ids):
        ctx.telemetry.excluded_s = 0.0
        logits = ctx.forward(torch.tensor([[token]], device=device), start=position + offset)
        _after_first_step(ctx, checked)
    return logits


def _after_first_step(ctx: GenerationContext, checked: list[bool]) -> None:
    """The retrieval guard runs after the conversation's first decode step, question token or answer."""
    if not checked[0]:
        checked[0] = True
        ctx.check_after_first_step()


class _Answer:
    """Greedy answer to one question (:func:`kvbench.engine.generate.eager_decode`, the loop of every
    generating request)."""

    def __init__(self, ctx: GenerationContext, query: Query, device: torch.device) -> None:
        self.ctx, self.query = ctx, query
        self.stops = set(ctx.spec.stop_ids) | {int(i) for i in query.stop_ids}
        self.pick = Picker(self.stops, query.min_new_tokens, device)

    def run(self, token: int, position: int, checked: list[bool]) -> tuple[list[int], str]:
        """Tokens after ``token`` (placed at ``position``) until a stop or the length limit."""
        return eager_decode(
            self.ctx,
            token,
            position,
            pick=self.pick,
            max_new_tokens=self.query.max_new_tokens,
            stops=self.stops,
            stop_texts=self.query.stop_texts,
            after_step=lambda: _after_first_step(self.ctx, checked),
        )


def _turn(
    ctx: GenerationContext,
    query: Query,
    tokens: list[int],
    stop_reason: str,
    question_tokens: int,
    ttft: float,
    asked_at: float,
    steps_before: int,
    bytes_before: int,
    position: int,
) -> Turn:
    body = tokens[:-1] if stop_reason == "stop" else tokens
    text = ctx.loaded.tokenizer.decode(body, skip_special_tokens=True)
    cut = _find_stop(text, query.stop_texts)
    if cut >= 0:
        text = text[:cut]
    steps = ctx.telemetry.step_s[steps_before:]
    later = steps[1:]
    return Turn(
        tokens=tokens,
        text=text,
        stop_reason=stop_reason,
        question_tokens=question_tokens,
        telemetry={
            "question_tokens": question_tokens,
            "position": position,  # where the answer starts
            "ttft_s": ttft,
            "tpot_s": sum(later) / len(later) if later else None,
            "turn_s": ctx.clock.now() - asked_at,
            "new_tokens": len(tokens),
            "decode_steps": len(steps),
            "bytes_h2d": ctx.store.stats().bytes_h2d - bytes_before,
            "held_tokens": ctx.store.held_tokens(),
            "step_s": steps,
        },
    )
