"""The task interface: samples, the requests they make, scoring, aggregation.

A task turns its data into :class:`Sample` objects (prompt text, prebuilt token ids or ordered
segments, references, generation settings), describes what each sample asks of the engine as
requests (:meth:`Task.requests`; see :mod:`kvbench.requests`), and turns the engine's outputs into a
scored :class:`SampleResult` (:meth:`Task.result`) on a 0–100 scale with the benchmark's official
metric. Tasks never drive the model: the runner executes the requests. Aggregation over samples and
subsets lives in :meth:`Task.aggregate`. Every protocol choice a task makes is returned by
:meth:`Task.protocol` and recorded with the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping

import numpy as np

from kvbench.errors import ConfigError
from kvbench.requests import GenerateRequest, Output, Request, Segment, join_segments

if TYPE_CHECKING:
    from kvbench.models.loading import LoadedModel


@dataclass
class Sample:
    """One prompt with its reference and generation settings."""

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


@dataclass
class SampleResult:
    """What the runner writes for a sample (one line of ``samples.jsonl``)."""

    id: str
    prediction: Any
    reference: Any
    score: float
    subset: str | None
    meta: dict[str, Any]
    telemetry: dict[str, Any]
    budget: dict[str, Any]

    def to_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prediction": self.prediction,
            "reference": self.reference,
            "score": self.score,
            "subset": self.subset,
            "meta": self.meta,
            "telemetry": self.telemetry,
            "budget": self.budget,
        }


class Task:
    """Base task: subclasses set ``name`` and implement :meth:`samples` and :meth:`score`."""

    name: ClassVar[str] = ""
    #: config keys every task accepts (beyond its own), e.g. ``limit``
    common_keys: ClassVar[tuple[str, ...]] = ("name", "limit", "data_dir", "question_position", "shard")
    #: the task's own config keys with their defaults
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - set(self.common_keys) - set(self.defaults))
        if unknown:
            raise ConfigError(
                f"task {self.name} has no option(s) {', '.join(unknown)}",
                f"valid task.* keys: {', '.join(sorted(set(self.common_keys) | set(self.defaults)))}",
            )
        self.cfg = {**self.defaults, **cfg}
        limit = self.cfg.get("limit")
        if limit is not None and int(limit) < 1:
            raise ConfigError(f"task.limit={limit} must be positive", "drop task.limit or set it to 1 or more")
        self.shard = parse_shard(self.cfg.get("shard"))

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
        :mod:`kvbench.validate` can check them before the model is loaded; none by default."""
        return []

    def limited(self, samples: Iterable[Sample]) -> Iterable[Sample]:
        limit = self.cfg.get("limit")
        for index, sample in enumerate(samples):
            if limit is not None and index >= int(limit):
                return
            yield sample

    def protocol(self) -> dict[str, Any]:
        """The protocol choices of this run (recorded in every sample's config)."""
        return {"task": self.name}

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        raise NotImplementedError

    def prompt_ids(self, sample: Sample, model: LoadedModel) -> list[int]:
        """The sample's prompt as token ids (segments, prebuilt ids, or the prompt under the chat format)."""
        if sample.segments is not None:
            return join_segments(sample.segments)
        if sample.input_ids is not None:
            return list(sample.input_ids)
        return model.chat.encode(sample.prompt or "", use_template=sample.use_template, assistant_prefix=sample.assistant_prefix)

    def requests(self, sample: Sample, model: LoadedModel) -> list[Request]:
        """What the sample asks of the engine: by default one greedy generation of its prompt."""
        stop_ids = tuple(model.tokenizer.encode(s, add_special_tokens=False)[-1] for s in sample.stop_tokens)
        return [
            GenerateRequest(
                input_ids=self.prompt_ids(sample, model),
                max_new_tokens=sample.max_new_tokens,
                min_new_tokens=sample.min_new_tokens,
                stop_ids=stop_ids,
                stop_texts=tuple(sample.stop_texts),
                segments=tuple(sample.segments) if sample.segments is not None else None,
            )
        ]

    def result(self, sample: Sample, outputs: list[Output]) -> SampleResult:
        """The scored record of a sample from its requests' outputs (by default: score the generation)."""
        out = outputs[0]
        return SampleResult(
            id=sample.id,
            prediction=out.text,
            reference=sample.reference,
            score=float(self.score(sample, out.text)),
            subset=sample.subset,
            meta={**sample.meta, "stop_reason": out.stop_reason},
            telemetry=out.telemetry,
            budget=out.budget,
        )

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score`` (mean, 0–100), ``n`` and ``per_subset`` means."""
        scores = [r["score"] for r in records]
        per_subset: dict[str, list[float]] = {}
        for record in records:
            if record.get("subset") is not None:
                per_subset.setdefault(str(record["subset"]), []).append(record["score"])
        return {
            "score": round(float(np.mean(scores)), 2) if scores else None,
            "n": len(scores),
            "per_subset": {key: round(float(np.mean(v)), 2) for key, v in per_subset.items()},
        }

    def artifacts(self, records: list[dict[str, Any]], run_dir: Path, title: str) -> list[Path]:
        """Files (plots) the task writes next to the results; none by default."""
        return []

    @classmethod
    def comparison_figure(cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
        """One figure comparing several runs of this task (``(title, records)`` each), for ``kvbench
        report --figure``; tasks with a natural picture override it."""
        raise ConfigError(f"task {cls.name} has no comparison figure", "use kvbench report --pivot for a table")


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
        raise ConfigError(f"task.shard={text} is not i/n with 0 <= i < n",
                          "e.g. task.shard=0/2 and task.shard=1/2 for two workers")
    return (i, n) if n > 1 else None
