"""The task interface: samples, the requests they make, scoring, aggregation.

A task turns its data into :class:`Sample` objects (prompt text, prebuilt token ids or ordered
segments, references, generation settings), describes what each sample asks of the engine as
requests (:meth:`Task.requests`; see :mod:`kvbench.requests`), and turns the engine's outputs into a
scored :class:`SampleResult` (:meth:`Task.result`) on a 0–100 scale with the benchmark's official
metric. Tasks never drive the model: the runner executes the requests. Aggregation over samples and
subsets lives in :meth:`Task.aggregate`. Every protocol choice a task makes is returned by
:meth:`Task.protocol` and recorded with the run.

**Several questions per context.** A task whose samples can carry several questions about one context
(NIAH with several needles, RULER's needle tasks) gives each :class:`Sample` its ``context`` segments
and its ``queries`` (:class:`SampleQuery`, first question first) and declares the options of
:class:`~kvbench.tasks.params.MultiQueryParams`: ``task.queries_per_context=N`` asks the first N questions
about a context compressed once (a :class:`~kvbench.requests.MultiQueryRequest`),
``task.compression=question_aware | question_agnostic`` decides whether the first question is in view
when the method compresses, and ``task.keep_answers`` keeps the conversation instead of dropping every
answer (question-aware: every answer after the first, whose turn is part of the compressed prompt).
One question, question aware, is exactly today's single prompt (``context + first question``, one
generation). Each question scores apart; the record keeps them in ``queries`` and :meth:`Task.aggregate`
reports ``score_first``, ``score_followup`` and ``score_by_query``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from kvbench.errors import ConfigError
from kvbench.params import Params, defaults, param, parse
from kvbench.requests import (
    GenerateRequest,
    MultiQueryRequest,
    Output,
    Query,
    Request,
    Segment,
    join_segments,
)
from kvbench.tasks.params import MultiQueryParams

if TYPE_CHECKING:
    from kvbench.models.loading import LoadedModel


T = TypeVar("T")


@dataclass(frozen=True)
class CommonParams(Params):
    """The common keys of :attr:`Task.common_keys` (all but ``name`` and ``shard``) for a task whose ``Params``
    leave them out, typed and checked like its own: every shipped task declares ``limit`` and ``data_dir``,
    and all but rag and rag_stream ``question_position`` (those take it only to refuse any value but
    ``end``). Whichever declares a key, :class:`Task` gives its value as ``self.<key>``."""

    limit: int | None = param(None, "first n samples (null: all)", min=1)
    data_dir: str | None = param(None, "the task's data folder (null: none)")
    question_position: str | None = param(None, "where the question goes (null: unset; the task checks it)")


@dataclass
class SampleQuery:
    """One of a sample's questions about its context (see :class:`~kvbench.requests.Query`).

    ``ids``: the question right after the context (the tail of its one-question prompt);
    ``followup_ids``: the same question as a new user turn (after an earlier question or answer);
    ``reference``: what :meth:`Task.score_answer` scores its answer against; ``text``: the question, as
    recorded."""

    reference: Any
    ids: list[int]
    followup_ids: list[int] | None = None
    text: str = ""


@dataclass
class Sample:
    """One prompt with its reference and generation settings.

    A sample with several questions sets ``context`` (the shared context as segments) and ``queries``;
    its one-question prompt is ``context + queries[0].ids`` and its ``reference`` the first's."""

    id: str
    reference: Any
    prompt: str | None = None  # the user message (or raw text when ``use_template`` is false)
    input_ids: list[int] | None = None  # prebuilt ids (take precedence over ``prompt``)
    segments: list[Segment] | None = None  # the prompt as prefix / chunks / query (take precedence)
    use_template: bool = True
    assistant_prefix: str = ""
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_tokens: tuple[str, ...] = ()  # texts whose (last) token id ends generation, e.g. LongBench's "\n"
    stop_texts: tuple[str, ...] = ()  # generation ends once the output contains one; it is cut there
    subset: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    context: list[Segment] | None = None
    queries: list[SampleQuery] | None = None


@dataclass
class SampleResult:
    """What the runner writes for a sample (one line of ``samples.jsonl``)."""

    id: str
    prediction: Any
    reference: Any
    score: float | None  # None: nothing to score against (see Task.score)
    subset: str | None
    meta: dict[str, Any]
    telemetry: dict[str, Any]
    budget: dict[str, Any]
    queries: list[dict[str, Any]] | None = None  # several questions: each one's answer, score, telemetry

    def to_record(self) -> dict[str, Any]:
        record = {
            "id": self.id,
            "prediction": self.prediction,
            "reference": self.reference,
            "score": self.score,
            "subset": self.subset,
            "meta": self.meta,
            "telemetry": self.telemetry,
            "budget": self.budget,
        }
        if self.queries is not None:
            record["queries"] = self.queries
        return record


class Task:
    """Base task: subclasses set ``name`` and implement :meth:`samples` and :meth:`score`."""

    name: ClassVar[str] = ""
    #: the task's parameters (``task.<key>``), a dataclass declared in the task's own module (every shipped
    #: task names its own); an instance, parsed and checked from the config, is ``self.params``
    Params: ClassVar[type[Params]] = Params
    #: config keys every task accepts (beyond its own), e.g. ``limit``
    common_keys: ClassVar[tuple[str, ...]] = ("name", "limit", "data_dir", "question_position", "shard")
    #: the task's own config keys with their defaults: its ``Params``' (set for each subclass)
    defaults: ClassVar[dict[str, Any]] = {}
    #: how the run's score averages: ``samples`` (mean over samples) or ``subsets`` (mean of subset means)
    average: ClassVar[str] = "samples"
    #: whether the samples carry their prompt as segments with at least one reusable ``chunk`` — what
    #: the reuse methods need; :mod:`kvbench.validate` refuses a reuse method on a task without it
    chunked: ClassVar[bool] = False
    #: the figures :meth:`comparison_figure` draws (``kvbench report --figure-kind``), the default first;
    #: empty for a task with a single figure
    figure_kinds: ClassVar[tuple[str, ...]] = ()
    #: ``kvbench report`` columns that :meth:`comparison_figure` draws as one run: runs that differ
    #: only in them have their samples joined (RULER's runs, one per length, become one curve)
    figure_joins: ClassVar[tuple[str, ...]] = ()
    #: whether the runs of a sweep may share one chunk store (:meth:`kvbench.shared.Sweep.chunk_store`);
    #: false for a task whose runs must each start on an empty store (a request stream)
    shares_chunk_store: ClassVar[bool] = True
    #: whether a sample's result depends on the samples served before it in the same run (a request
    #: stream over one chunk store): a resumed run then serves its finished samples again, unrecorded,
    #: to rebuild that state before it goes on (:func:`kvbench.runner.run`)
    order_dependent: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "defaults" in vars(cls):
            raise TypeError(f"{cls.__name__} sets defaults: declare its Params instead (a dataclass in its module)")
        cls.defaults = defaults(cls.Params)  # (one declaration: the Params' defaults)

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - set(self.common_keys) - set(self.defaults))
        if unknown:
            raise ConfigError(
                f"task {self.name} has no option(s) {', '.join(unknown)}",
                f"valid task.* keys: {', '.join(sorted(set(self.common_keys) | set(self.defaults)))}",
            )
        owner = f"task {self.name}"
        #: the parameters, typed and checked (a wrong type, choice or range is one line naming the key): what
        #: the task reads its options from (``self.params.<key>``)
        self.params = parse(self.Params, {k: v for k, v in cfg.items() if k in self.defaults}, owner, prefix="task.")
        # the common keys the Params leave out, typed and checked the same way (CommonParams)
        common_fields = set(CommonParams.__dataclass_fields__) - set(self.defaults)
        common = parse(CommonParams, {k: v for k, v in cfg.items() if k in common_fields}, owner, prefix="task.")

        def common_key(key: str) -> Any:
            return getattr(common if key in common_fields else self.params, key)

        #: ``task.limit`` (None: every sample); what "limit" means is each task's own (samples, questions,
        #: samples per grid cell)
        self.limit: int | None = common_key("limit")
        #: ``task.data_dir`` as given (None: unset; :func:`~kvbench.tasks.sources.data_folder` checks it)
        self.data_dir: str | None = common_key("data_dir")
        #: ``task.question_position`` (None: unset, for a task whose parameters leave it out)
        self.question_position: str | None = common_key("question_position")
        self.shard = parse_shard(cfg.get("shard"))

    # ------------------------------------------------------------------ several questions per context
    @property
    def multi_query(self) -> bool:
        """Whether samples run as :class:`~kvbench.requests.MultiQueryRequest` (several questions, the
        question-agnostic layout or kept answers), rather than as one prompt."""
        p = self.params
        return isinstance(p, MultiQueryParams) and (
            p.queries_per_context > 1 or p.compression != "question_aware" or p.keep_answers
        )

    def multi_query_params(self) -> MultiQueryParams:
        """The multi-query options (:attr:`params`, of a task that declares them: every task in multi-query mode)."""
        if not isinstance(self.params, MultiQueryParams):
            raise TypeError(f"task {self.name} takes no multi-query options")
        return self.params

    def multi_query_protocol(self) -> dict[str, Any]:
        """The multi-query choices, for :meth:`protocol` (nothing when the task runs one prompt per sample)."""
        if not self.multi_query:
            return {}
        p = self.multi_query_params()
        return {
            "queries_per_context": p.queries_per_context,
            "compression": p.compression,
            "keep_answers": p.keep_answers,
        }

    @classmethod
    def recorded_config(cls, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """``cfg`` without the options added after runs were recorded that sit at their legacy values (the
        values that reproduce those runs, declared with the parameters: ``legacy=``, or a ``Params.identity``
        override for a key that only means something in a new mode): what :mod:`kvbench.runner` records,
        and what every run id and resume check hashes (:func:`kvbench.results.identity`). Runs made before
        an option existed keep their ids and resume; another value is another run."""
        return cls.Params.identity(dict(cfg))

    # ------------------------------------------------------------------ data and prompts
    def sample_ids(self) -> list[str] | None:
        """Ids of the samples this run will produce, if known without a model (fast resume)."""
        return None

    def samples(self, model: LoadedModel) -> Iterable[Sample]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shards (task.shard=i/n)
    def shard_sample_ids(self) -> list[str] | None:
        """:meth:`sample_ids` of this run's shard: every n-th id from the i-th (all without a shard)."""
        ids = self.sample_ids()
        if ids is None or self.shard is None:
            return ids
        index, count = self.shard
        return ids[index::count]

    def shard_samples(self, model: LoadedModel) -> Iterable[Sample]:
        """:meth:`samples` of this run's shard. Where the ids are known up front the shard is every n-th
        of them (:meth:`shard_sample_ids`); otherwise every n-th sample the task yields. Both are the same
        partition for every worker, because a sharded run differs from its siblings only in ``shard``."""
        if self.shard is None:
            yield from self.samples(model)
            return
        index, count = self.shard
        ids = self.shard_sample_ids()
        wanted = set(ids) if ids is not None else None
        for position, sample in enumerate(self.samples(model)):
            if (sample.id in wanted) if wanted is not None else position % count == index:
                yield sample

    def data_files(self) -> list[Path]:
        """The local data files this run will read (from ``task.data_dir``), so that
        :mod:`kvbench.validate` can check them before the model is loaded; none by default. A task whose
        configuration cannot find its data (a required file or folder missing) raises its error here."""
        return []

    def check_data(self, path: Path) -> None:
        """Check one of :meth:`data_files` by its shape before any model loads (:mod:`kvbench.validate`,
        also in ``--dry-run``), raising :class:`ConfigError` with the file and line and the shape
        expected. By default a JSONL file's rows parse, there is at least one, and each of the first
        ``task.limit`` has :meth:`row_fields`; a ``.txt`` file is text (:func:`~kvbench.tasks.sources.check_text`).
        Tasks with other formats override it."""
        from kvbench.tasks.sources import check_jsonl, check_text

        if path.suffix == ".jsonl":
            fields = self.row_fields(path)
            check_jsonl(path, limit=self.limit, fields=(lambda row: fields) if fields else None)
        elif path.suffix == ".txt":
            check_text(path)

    def row_fields(self, path: Path) -> tuple[str, ...]:
        """The keys every row of the JSONL data file ``path`` must have (what :meth:`samples` reads
        unconditionally); none by default."""
        return ()

    def hub_source(self) -> tuple[str, str] | None:
        """(data set, where else to get it) when this run reads its data from the Hugging Face hub, so that
        ``kvbench run`` can fail before the model loads when the hub does not answer
        (:func:`kvbench.runner.check_sources`); None by default."""
        return None

    def limited(self, samples: Iterable[T]) -> Iterator[T]:
        for index, sample in enumerate(samples):
            if self.limit is not None and index >= self.limit:
                return
            yield sample

    def protocol(self) -> dict[str, Any]:
        """The protocol choices of this run (recorded in every sample's config)."""
        return {"task": self.name}

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float | None:
        """0–100, or None for a sample with nothing to score against (left out of :meth:`aggregate`)."""
        raise NotImplementedError

    def score_answer(self, sample: Sample, reference: Any, prediction: str) -> float | None:
        """The score of an answer to one of the sample's questions (default: :meth:`score` against that
        question's reference)."""
        from dataclasses import replace

        return self.score(replace(sample, reference=reference), prediction)

    def prompt_ids(self, sample: Sample, model: LoadedModel) -> list[int]:
        """The sample's prompt as token ids (segments, prebuilt ids, or the prompt under the chat format)."""
        if sample.queries is not None and sample.context is not None:
            return join_segments(sample.context) + list(sample.queries[0].ids)
        if sample.segments is not None:
            return join_segments(sample.segments)
        if sample.input_ids is not None:
            return list(sample.input_ids)
        return model.chat.encode(
            sample.prompt or "", use_template=sample.use_template, assistant_prefix=sample.assistant_prefix
        )

    def requests(self, sample: Sample, model: LoadedModel) -> list[Request]:
        """What the sample asks of the engine: by default one greedy generation of its prompt; in
        multi-query mode one :class:`~kvbench.requests.MultiQueryRequest` with its first
        ``queries_per_context`` questions."""
        stop_ids = tuple(model.tokenizer.encode(s, add_special_tokens=False)[-1] for s in sample.stop_tokens)
        if self.multi_query:
            if sample.queries is None or sample.context is None:
                raise ConfigError(
                    f"task {self.name} sample {sample.id} has no separate questions to ask",
                    "drop task.queries_per_context / task.compression / task.keep_answers",
                )
            options = self.multi_query_params()
            asked = sample.queries[: options.queries_per_context]

            def query(q: SampleQuery) -> Query:
                return Query(
                    tuple(q.ids),
                    sample.max_new_tokens,
                    followup_ids=None if q.followup_ids is None else tuple(q.followup_ids),
                    min_new_tokens=sample.min_new_tokens,
                    stop_ids=stop_ids,
                    stop_texts=tuple(sample.stop_texts),
                )

            return [
                MultiQueryRequest(
                    join_segments(sample.context),
                    tuple(query(q) for q in asked),
                    compression=options.compression,
                    keep_answers=options.keep_answers,
                    context_segments=tuple(sample.context),
                )
            ]
        segments = sample.segments
        if sample.queries is not None and sample.context is not None:
            segments = [*sample.context, Segment(tuple(sample.queries[0].ids), "query")]
        return [
            GenerateRequest(
                input_ids=self.prompt_ids(sample, model),
                max_new_tokens=sample.max_new_tokens,
                min_new_tokens=sample.min_new_tokens,
                stop_ids=stop_ids,
                stop_texts=tuple(sample.stop_texts),
                segments=tuple(segments) if segments is not None else None,
            )
        ]

    def result(self, sample: Sample, outputs: list[Output]) -> SampleResult:
        """The scored record of a sample from its requests' outputs (by default: score the generation;
        several questions: score each answer, the sample's score is their mean)."""
        out = outputs[0]
        if out.turns:
            assert sample.queries is not None
            options = self.multi_query_params()
            queries = []
            for index, (query, turn) in enumerate(zip(sample.queries, out.turns)):
                queries.append(
                    {
                        "index": index,
                        "question": query.text,
                        "reference": query.reference,
                        "prediction": turn.text,
                        "score": _number(self.score_answer(sample, query.reference, turn.text)),
                        "stop_reason": turn.stop_reason,
                        "telemetry": turn.telemetry,
                    }
                )
            return SampleResult(
                id=sample.id,
                prediction=[q["prediction"] for q in queries],
                reference=[q["reference"] for q in queries],
                score=float(np.mean([q["score"] for q in queries])),
                subset=sample.subset,
                meta={
                    **sample.meta,
                    "compression": options.compression,
                    "keep_answers": options.keep_answers,
                    "queries": len(queries),
                },
                telemetry=out.telemetry,
                budget=out.budget,
                queries=queries,
            )
        return SampleResult(
            id=sample.id,
            prediction=out.text,
            reference=sample.reference,
            score=_number(self.score(sample, out.text)),
            subset=sample.subset,
            meta={**sample.meta, "stop_reason": out.stop_reason},
            telemetry=out.telemetry,
            budget=out.budget,
        )

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score`` (0–100), ``n`` (samples), ``scored`` (samples with a score: tasks without gold
        answers score ``None``) and ``per_subset`` means.

        The one place runs are averaged: ``score`` is the mean over scored samples, or with
        :attr:`average` ``"subsets"`` the unweighted mean of the subset means (LongBench's and
        InfiniteBench's "Average" over datasets). Tasks extend the result (grids, buckets); they do not
        re-average.
        """
        scored = [r for r in records if r.get("score") is not None]
        per_subset: dict[str, list[float]] = {}
        for record in scored:
            if record.get("subset") is not None:
                per_subset.setdefault(str(record["subset"]), []).append(float(record["score"]))
        subset_means = {key: round(float(np.mean(v)), 2) for key, v in per_subset.items()}
        score: float | None
        if self.average == "subsets" and subset_means:
            score = round(float(np.mean(list(subset_means.values()))), 2)
        else:
            score = round(float(np.mean([r["score"] for r in scored])), 2) if scored else None
        return {
            "score": score,
            "n": len(records),
            "scored": len(scored),
            "per_subset": subset_means,
            **multi_query_metrics(records),
        }

    def artifacts(self, records: list[dict[str, Any]], run_dir: Path, title: str) -> list[Path]:
        """Files (plots) the task writes next to the results; none by default."""
        return []

    @classmethod
    def check_figure_kind(cls, kind: str | None, option: str = "--figure-kind") -> None:
        """Refuse a figure ``kind`` the task does not draw (None, the default figure, always passes);
        ``option`` names where the kind was given, for the error's fix."""
        if kind is None or kind in cls.figure_kinds:
            return
        kinds = cls.figure_kinds
        fix = f"use {option} {' or '.join(kinds)}" if kinds else f"drop {option}: the task has a single figure"
        raise ConfigError(f"task {cls.name} has no figure kind {kind!r}", fix)

    @classmethod
    def draw_figure(
        cls,
        runs: list[tuple[str, list[dict[str, Any]]]],
        path: Path,
        kind: str | None = None,
        option: str = "--figure-kind",
    ) -> Path:
        """:meth:`comparison_figure` of figure ``kind`` (None: the task's default), checked first."""
        cls.check_figure_kind(kind, option)
        if kind is None:
            return cls.comparison_figure(runs, path)
        # only the tasks with figure_kinds take a kind (checked above); this signature has none
        return cls.comparison_figure(runs, path, kind=kind)  # type: ignore[call-arg]

    @classmethod
    def comparison_figure(cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
        """One figure comparing several runs of this task (``(title, records)`` each), for ``kvbench
        report --figure``; tasks with a natural picture override it."""
        raise ConfigError(f"task {cls.name} has no comparison figure", "use kvbench report --pivot for a table")


def _number(score: float | None) -> float | None:
    """A score as a plain float (tasks may compute numpy scalars), None kept."""
    return None if score is None else float(score)


def multi_query_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """First question vs the later ones, over the records that asked several (nothing otherwise).

    ``score_first``: mean score of every context's first question; ``score_followup``: mean over all
    later questions (each question counts once); ``score_by_query``: the mean at each question index;
    ``queries_asked``: questions scored in all."""
    asked = [record["queries"] for record in records if record.get("queries")]
    if not asked:
        return {}
    by_index: dict[int, list[float]] = {}
    for queries in asked:
        for query in queries:
            by_index.setdefault(int(query["index"]), []).append(float(query["score"]))
    later = [score for index, scores in by_index.items() if index > 0 for score in scores]
    return {
        "score_first": round(float(np.mean(by_index[0])), 2) if by_index.get(0) else None,
        "score_followup": round(float(np.mean(later)), 2) if later else None,
        "score_by_query": {str(index): round(float(np.mean(by_index[index])), 2) for index in sorted(by_index)},
        "queries_asked": sum(len(scores) for scores in by_index.values()),
    }


def followup_frame(chat: Any) -> tuple[str, str]:
    """What a chat template puts around a *later* user message: the text that closes the assistant's
    turn and opens a new user turn, and the text that closes it and opens the assistant's reply
    (ChatML: ``"<|im_end|>\\n<|im_start|>user\\n"`` and ``"<|im_end|>\\n<|im_start|>assistant\\n"``).

    Read off the template itself (a two-turn conversation with placeholders), so any model's format
    works. A follow-up question's ids are ``before + question + after``; a kept answer enters the cache
    without its stop token, since ``before`` closes the turn."""
    answer, question = "\u0000KVBENCH_ANSWER\u0000", "\u0000KVBENCH_QUESTION\u0000"
    messages = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt else []
    messages += [
        {"role": "user", "content": "context"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": question},
    ]
    text = chat.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=chat.template
    )
    if answer not in text or question not in text:
        raise ConfigError(
            "this model's chat template does not render a two-turn conversation",
            "set model.chat_template to a template with multi-turn support",
        )
    before, after = text.split(answer, 1)[1].split(question, 1)
    return before, after


def parse_shard(value: Any) -> tuple[int, int] | None:
    """``task.shard``: ``"i/n"`` (shard i of n, 0-based) → ``(i, n)``; None for an unsharded run.

    A sharded run computes every n-th sample, so n workers given ``task.shard=0/n`` ... ``n-1/n`` split a
    run between them. Each shard has its own run directory (``shard`` is part of the config, so of the
    hash) and its own lock, so the workers never wait for each other; ``kvbench report`` and
    :func:`kvbench.results.load` merge the shards back into the run they make up."""
    if value is None:
        return None
    text = str(value)
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not sep or n < 1 or not 0 <= i < n:
        raise ConfigError(
            f"task.shard={text} is not i/n with 0 <= i < n", "e.g. task.shard=0/2 and task.shard=1/2 for two workers"
        )
    return (i, n) if n > 1 else None
