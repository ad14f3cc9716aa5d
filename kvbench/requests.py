"""What a task asks the engine to do, and what comes back (lm-eval's shape).

Tasks never drive the model: they turn a sample into one or more *requests*, the runner hands each
request to the engine (:func:`kvbench.engine.execute`), and the task turns the outputs into a scored
result. A request that needs earlier outputs (a RAG pipeline's reduce step reads the map steps'
summaries) is a :class:`FollowUp`: the runner calls it with the outputs so far and runs what it returns.
Two kinds of request cover every task kvbench runs:

* :class:`GenerateRequest` — greedy generation after a prompt. The prompt is token ids, optionally
  described as ordered :class:`Segment` s: a fixed ``prefix`` (system prompt, instruction, chat
  template head), reusable document ``chunk`` s (RAG passages, whose KV a reuse method may take from
  its chunk store) and the ``query`` suffix (always computed). Dense, eviction and retrieval methods
  see only the concatenated ids; reuse methods need the segments and refuse prompts without them.
* :class:`ScoreRequest` — teacher forcing: prefill ``prefix_ids``, then predict every token of
  ``continuation_ids`` by one decode step each (PG19 perplexity in decode mode).
* :class:`MultiQueryRequest` — several questions about one shared context: the context is prefilled
  and compressed once, then each :class:`Query` is asked in turn and answered greedily
  (:mod:`kvbench.engine.conversation`); the :class:`Output` carries one ``turns`` entry per question.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SEGMENT_ROLES = ("prefix", "chunk", "query")


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of a chunked prompt.

    ``role``: ``prefix`` (an exact prefix shared by every request of a protocol: chat template head,
    instruction), ``chunk`` (a reusable document whose KV may be precomputed alone and stored), or
    ``query`` (the request-specific suffix: question and template tail, always recomputed).
    """

    ids: tuple[int, ...]
    role: str = "chunk"

    def __post_init__(self) -> None:
        if self.role not in SEGMENT_ROLES:
            raise ValueError(f"segment role {self.role!r} is not one of {SEGMENT_ROLES}")
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))

    def __len__(self) -> int:
        return len(self.ids)


def join_segments(segments: Sequence[Segment]) -> list[int]:
    """The prompt's token ids: the segments' ids in order."""
    return [i for segment in segments for i in segment.ids]


def segment_spans(segments: Sequence[Segment]) -> list[tuple[int, int]]:
    """``(start, end)`` token offsets of every segment in the joined prompt."""
    spans, start = [], 0
    for segment in segments:
        spans.append((start, start + len(segment)))
        start += len(segment)
    return spans


@dataclass
class GenerateRequest:
    """Greedy generation of up to ``max_new_tokens`` after ``input_ids``.

    ``segments`` (optional) describe the same ids as ordered prefix / chunks / query; when given,
    ``join_segments(segments) == input_ids``.
    """

    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_texts: tuple[str, ...] = ()
    segments: tuple[Segment, ...] | None = None

    def __post_init__(self) -> None:
        if self.segments is not None:
            self.segments = tuple(self.segments)
            if join_segments(self.segments) != list(self.input_ids):
                raise ValueError("a request's segments must join to its input_ids")


@dataclass
class ScoreRequest:
    """Teacher-forced negative log-likelihood of ``continuation_ids`` after ``prefix_ids``."""

    prefix_ids: list[int]
    continuation_ids: list[int]


COMPRESSIONS = ("question_aware", "question_agnostic")


@dataclass(frozen=True)
class Query:
    """One question about a shared context, in two forms (token ids):

    ``ids`` — the question as it follows the context directly: the tail of the single-question prompt
    (``context + ids`` is exactly what a one-question request would prefill);
    ``followup_ids`` — the question as a new user turn, for when something else sits between the
    context and it (an earlier question, or an earlier answer that was kept): chat templates close the
    previous turn first. ``None`` when the task has no such form (then only the direct form is asked).
    """

    ids: tuple[int, ...]
    max_new_tokens: int
    followup_ids: tuple[int, ...] | None = None
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(i) for i in self.ids))
        if self.followup_ids is not None:
            object.__setattr__(self, "followup_ids", tuple(int(i) for i in self.followup_ids))
        if not self.ids:
            raise ValueError("a query needs at least one token")


@dataclass
class MultiQueryRequest:
    """Several questions about one context, the context prefilled and compressed once.

    ``context_ids`` (with optional ``context_segments``: its prefix / chunks, for reuse methods) is the
    shared context; ``queries`` are asked in order. ``compression``:

    * ``question_aware`` — the first question is part of the prefilled prompt (``context + queries[0]``),
      so a method compresses with it in view (today's single-question behaviour); it stays in the cache,
      and later questions follow it as new turns;
    * ``question_agnostic`` — the method compresses the context alone; every question is fed after the
      compressed context (kvpress's query-agnostic evaluation).

    ``keep_answers``: false (default) rolls the cache back to the post-context state after every
    answer, so each question sees the context alone (``question_aware``: the context, the first question
    and its answer — that turn is part of the compressed prompt and must close); true keeps the
    conversation (SCBench's multi-turn mode): every later question follows the earlier questions and
    answers.
    """

    context_ids: list[int]
    queries: tuple[Query, ...]
    compression: str = "question_aware"
    keep_answers: bool = False
    context_segments: tuple[Segment, ...] | None = None

    def __post_init__(self) -> None:
        self.queries = tuple(self.queries)
        if not self.queries:
            raise ValueError("a multi-query request needs at least one query")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression {self.compression!r} is not one of {COMPRESSIONS}")
        if not self.context_ids:
            raise ValueError("a multi-query request needs a context")
        if self.context_segments is not None:
            self.context_segments = tuple(self.context_segments)
            if join_segments(self.context_segments) != list(self.context_ids):
                raise ValueError("a request's context segments must join to its context_ids")
            if any(s.role == "query" for s in self.context_segments):
                raise ValueError("the context of a multi-query request has no query segment (questions are queries)")


Request = GenerateRequest | ScoreRequest | MultiQueryRequest


@dataclass
class Output:
    """What the engine returns for one request.

    For a generation: ``text`` (decoded, stop token excluded), ``tokens`` and ``stop_reason``; for a
    scoring: ``nll`` (one value per continuation token). Both carry ``budget`` (the resolved budget
    as a dict) and ``telemetry``. For a multi-query request: ``turns``, one generation output per
    question (its own ``telemetry``: question tokens, TTFT, TPOT), and the conversation's telemetry.
    """

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = ""
    nll: list[float] | None = None
    prompt_tokens: int = 0
    budget: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] = field(default_factory=dict)
    turns: list[Output] = field(default_factory=list)


@dataclass
class FollowUp:
    """Requests that depend on the outputs of the sample's earlier requests (a pipeline's next step).

    ``build(outputs)`` receives the :class:`Output` of every request of the sample that ran before it,
    in order, and returns the requests to run next (which may include further ``FollowUp`` s). It only
    turns texts into requests — it never calls the engine — so tasks stay free of model calls; the
    runner (:func:`kvbench.runner.run_sample`) executes the requests in order and expands a
    ``FollowUp`` when it reaches it. The outputs the task finally receives are those of the executed
    requests, in execution order (a ``FollowUp`` itself has none).
    """

    build: Callable[[list[Output]], Sequence[Any]]
