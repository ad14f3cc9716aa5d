"""``rag_stream``: the rag task's questions as one stream of requests to a server (CacheBlend Fig. 14,
Cache-Craft's RAG stream).

CacheBlend's throughput experiment (§7.1) builds "Musique/2WikiMQA extended": 1,500 questions each
asked four times (the original and three GPT-4 paraphrases), every request's top-6 chunks in a random
order, sent to one engine whose chunk store starts empty; the first 1K requests are skipped. This task
builds that stream from the rag task's data (every option of ``task=rag`` applies: ``dataset``,
``chunk_tokens``, ``top_k``, ``retriever``, ``max_length``). It is ``task.popularity=repeat``, the
default:

* the first ``limit`` questions, each asked ``repeats`` times (default 4), the requests in a seeded
  random order (``seed``) — the arrival order; sample ids are ``<question id>~<k>``;
* each request's chunks in a random order of their own (``shuffle_chunks``, seeded by the request's
  place in the stream), so a chunk seen before sits at another position: CacheBlend's cache still
  hits, a prefix cache hits only when the same chunk happens to come first;
* each record says whether it is in the warm-up (the first ``warmup`` requests, excluded from the
  statistics), its place in the stream and its chunk order.

A chunk of that stream recurs only with its own question and always with the same companions, so
Cache-Craft's prefix overlap beta (the share of a chunk's stored attention to earlier chunks that
also precede it in the new prompt) is mostly 0 or 1. **``task.popularity=zipf``** builds Cache-Craft's
stream instead (issue 43).

**What Cache-Craft describes** (SIGMOD 2025, §7, as digested in ../research/seed-cachecraft.md): RAG
requests in which chunks recur across questions as in production — the production trace Sys-X, and
200 questions each of 2WikiMQA and MuSiQue, every request with its top-5 retrieved chunks; chunk
popularity is skewed (the top 5 % of chunks serve 60 % of Sys-X's requests; MuSiQue 60 %, 2WikiMQA
40 %), more than half of the requests draw their five chunks from three or more earlier requests, and
the chunk cache is warmed with the first 20 queries. The paper does not say how its MuSiQue/2WikiMQA
streams order or repeat the questions.

**The zipf stream** (every draw seeded by ``seed``, reproducible; nothing but the data set's own
questions, passages and answers):

* the corpus is the first ``limit`` questions of the data set (file order), each with its own passages
  (CacheBlend's files: 10 per question); a passage is one chunk (``task.chunk_tokens=null`` is
  required: re-cutting the concatenation of a request's passages would make a chunk depend on its
  companions) and its id is ``<dataset>-p<n>``, n counting the file's distinct passages in order of
  first appearance, so a passage that the file gives to several questions is one chunk (MuSiQue's
  ``musique_s.json``: 203 of 1,255 distinct passages belong to 2–3 questions; 2WikiMQA's
  ``wikimqa_s_clean.json``: 177 of 748 to 2–8) — the stream's only sharing across questions;
* popularity: each question gets a Zipf rank (a seeded permutation of the questions; rank 0 is the
  most popular) and each of the ``requests`` requests asks a question drawn with probability
  proportional to ``1 / (rank + 1) ** zipf_s``;
* partial overlap: a question's ``candidates`` best passages (by ``task.retriever`` against the question,
  as ``task=rag`` ranks them) are its candidates; each request takes ``top_k`` of them in a seeded draw
  without replacement weighted ``1 / (retrieval rank + 1)`` (Efraimidis–Spirakis), in the order drawn,
  so two requests of one question share some of their chunks, in different orders, and a passage
  shared by two questions meets other companions; ``shuffle_chunks=true`` then puts the drawn chunks in
  a uniformly random order (seeded by the request's place, as in the repeat stream), ``false`` keeps
  the draw order (the better-ranked chunks tend to come first);
* sample ids are ``<question id>~<k>`` (the question's k-th request); the first ``warmup`` requests
  (default 20, the paper's warm-up) are flagged, and the figure leaves them out (the protocol's
  ``stream_stats`` describe the whole stream, and apart, as ``after_warmup``, the requests after it);
* each record's ``meta`` holds its ``stream_position``, ``warmup``, ``question_id``,
  ``question_rank`` (its Zipf rank), ``chunk_ids`` / ``chunk_ranks`` (retrieval rank) /
  ``chunk_popularity`` (0 = the chunk most often requested in the whole stream) in prompt order,
  ``chunk_order`` (prompt slot -> index in draw order), ``chunks_seen`` (how many of its chunks an
  earlier request had) and ``stream_seed``; the run's protocol holds the stream's statistics
  (:func:`stream_stats`).

**Skew.** ``zipf_s`` (default 2.0) is chosen so that at the defaults (``task=rag_stream
task.popularity=zipf task.chunk_tokens=null``: 2WikiMQA, 30 questions, top 6 of 10 candidates, 200
requests, seed 0) the top 5 % of the chunks the stream retrieves (ranked by the number of requests that
retrieve each, ties to the one requested first; ``ceil(5 % x distinct)`` chunks) are in 61 % of the
requests (``top5_request_share`` in the protocol's ``stream_stats``; MiniLM and BM25 alike; 0.62 on
average over seeds 0-4, 0.60-0.62 on MuSiQue, with top_k 5 and over every question of either file) and
take 44 % of all chunk retrievals (``top5_access_share``). "Serve 60 % of requests" is read as the share
of requests holding at least one such chunk: the paper's per-data-set figures (MuSiQue 60 %, 2WikiMQA
40 %) count data sets whose questions are asked once, and CacheBlend's files read that way (every
question once, all its passages) give 49 % and 76 %. With a few dozen questions, 5 % of the chunks are
about one question's candidates, so the share is in effect the most popular question's share of the
requests (62 % at s = 2); without skew (``zipf_s=0``) it is 0.43, at s = 1 0.49. The same stream has
90 % of its chunk retrievals hit a chunk an earlier request retrieved, 93 % of its requests share some
but not all chunks with an earlier one, and 35 % repeat an earlier request's set in another order.

**Deviations** from the paper, beyond the data (no Sys-X, no SQuAD/DROP/CNN/XSUM): a request's chunks
come from its own question's passages, not from one index over a shared corpus; the Zipf law is over
questions (a chunk's popularity follows from its question's and its retrieval rank), not over chunks;
repeats ask the identical question; the candidate pool, its rank weights and the Zipf law are this
task's choices where the paper gives only the resulting skew; the files hold 150 (MuSiQue) and 102
(2WikiMQA) questions, not 200; the share of requests that draw their chunks from three or more earlier
requests is not measured; the warm-up requests are served like the others (the store empty at the
start) and only left out of the figure.

A run executes the requests in that order, one at a time, with one chunk store for the whole run:
start it on an empty store — ``store.tier=ram store.disk_gb=0`` (a disk folder keeps entries between
runs, and a RAM store would promote them). A resumed run first serves its finished requests again, in
order and unrecorded, so that the store and the method's state are what they were when it stopped (the
run's log says how many of the replayed answers equal their records); a resume therefore costs the time of
the requests already done. For prefix caching
use ``method.warm=none method.store_prompts=true`` (it then stores every prompt after answering it).

Deviation (CacheBlend): GPT-4 paraphrases cannot be made offline; a repeat asks the identical question, so it
retrieves the same chunks (a paraphrase may retrieve a slightly different set). Everything about
queueing is in :mod:`kvbench.stream`; ``kvbench report --figure F.png --where task=rag_stream`` draws
TTFT p50/p90 against achieved throughput for the runs (one line per method) and writes the numbers
beside the figure (``F.csv``, ``F.md``).

**Run identity.** The keys of the zipf stream came after runs of the repeat stream were recorded; at
``popularity=repeat`` they stay out of the run id and the recorded config (:meth:`RagStream.recorded_config`,
applied by :func:`kvbench.results.identity`), so those runs keep their ids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from kvbench.errors import ConfigError
from kvbench.params import Params, defaults, param
from kvbench.tasks import register
from kvbench.tasks.base import Sample, T
from kvbench.tasks.params import data_dir_param
from kvbench.tasks.rag import Rag, RawSample
from kvbench.tasks.rag_retrieval import retriever


@dataclass(frozen=True)
class RagStreamParams(Params):
    """CacheBlend Fig. 14 (the rag task's questions as one stream of requests) or Cache-Craft's Zipf stream."""

    dataset: str = param("wikimqa", "musique | wikimqa | example")
    data_dir: str | None = data_dir_param("../shared/data/cacheblend")
    chunk_tokens: int | None = param(512, "CacheBlend §7.1: 512-token chunks (null: one chunk per passage)", min=1)
    top_k: int | None = param(6, "... and the top 6 by L2 distance of MiniLM embeddings", min=1)
    retriever: Literal["minilm", "bm25"] = param("minilm", "minilm | bm25")
    max_length: int | None = param(
        None, "prompt limit in tokens; null: the model's context minus the generation", min=1
    )
    limit: int | None = param(30, "questions (each asked `repeats` times)", min=1)
    repeats: int = param(4, "the paper: the original and 3 paraphrases (here: the same question again)", min=1)
    seed: int = param(0, "arrival order and chunk orders", min=0)
    warmup: int = param(
        20, "first requests excluded from the statistics (their store was cold; Cache-Craft: 20)", min=0
    )
    shuffle_chunks: bool = param(True, "each request's chunks in a random order (the paper's \"in a random order\")")
    popularity: Literal["repeat", "zipf"] = param(
        "repeat", "repeat (CacheBlend Fig. 14: limit x repeats) | zipf (Cache-Craft: skewed chunk popularity)"
    )
    zipf_s: float = param(
        2.0, "zipf: P(question of popularity rank r) ~ 1/(r+1)^zipf_s; top 5% of chunks in ~60% of requests", min=0
    )
    requests: int = param(200, "zipf: requests drawn (repeat: limit x repeats)", min=1)
    candidates: int = param(
        10, "zipf: a request draws top_k of its question's `candidates` best passages (weight 1/(rank+1))", min=1
    )
    pipeline: Literal["stuff", "mapreduce", "maprerank"] = param(
        "stuff", "(rag's option; a stream serves single prompts)"
    )
    map_tokens: int | None = param(None, "(rag's option; unused by a stream)", min=1)

    #: the zipf stream's keys (issue 43): a run at popularity=repeat, the stream recorded before they
    #: existed, leaves them out of its identity at their defaults; a zipf run is identified by every key
    STREAM_KEYS: ClassVar[tuple[str, ...]] = ("popularity", "zipf_s", "requests", "candidates")

    @classmethod
    def identity(cls, values: dict[str, Any]) -> dict[str, Any]:
        values = super().identity(values)
        if values.get("popularity", "repeat") != "repeat":
            return values
        legacy = {key: value for key, value in defaults(cls).items() if key in cls.STREAM_KEYS}
        return {key: value for key, value in values.items() if not (key in legacy and value == legacy[key])}


POPULARITIES = ("repeat", "zipf")
#: the keys of the zipf stream (issue 43) at their declared defaults (:class:`RagStreamParams`), the values
#: the task had before them: at popularity=repeat they leave a run's id and recorded config as they were
#: (:meth:`RagStream.recorded_config`). zipf_s = 2.0: the top 5 % of chunks in about 60 % of requests
STREAM_KEYS: dict[str, Any] = {
    key: value
    for key, value in defaults(RagStreamParams).items()
    if key in ("popularity", "zipf_s", "requests", "candidates")
}
#: the share of the most requested chunks that :func:`stream_stats` reports on (the paper's top 5 %)
TOP_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class Draw:
    """One request of the zipf stream before retrieval: which question (index into the questions), its
    how-many-th request of that question, and the retrieval ranks of its chunks in prompt order."""

    position: int
    question: int
    ask: int
    ranks: tuple[int, ...]
    order: tuple[int, ...]  # prompt slot -> index in draw order (identity without shuffle_chunks)


@dataclasses.dataclass(frozen=True)
class Question:
    """A question of the zipf corpus: its record and its passages' chunk ids."""

    raw: RawSample
    chunk_ids: tuple[str, ...]
    rank: int  # Zipf popularity rank, 0 = most popular


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    """P(rank r) proportional to ``1 / (r + 1) ** s`` for ranks ``0..n-1``."""
    weights = (np.arange(n, dtype=np.float64) + 1.0) ** -float(s)
    return weights / weights.sum()


def rank_weighted_draw(rng: np.random.Generator, n: int, k: int) -> list[int]:
    """``k`` of the ranks ``0..n-1`` without replacement, rank r weighted ``1 / (r + 1)``, in the order
    drawn (Efraimidis–Spirakis: the largest keys ``u ** (1 / w)``)."""
    keys = rng.random(n) ** (np.arange(n, dtype=np.float64) + 1.0)
    return [int(i) for i in np.argsort(-keys, kind="stable")[:k]]


def stream_stats(chunk_sets: list[list[str]], top: float = TOP_SHARE) -> dict[str, Any]:
    """Popularity and overlap of a stream of requests (each a list of chunk ids, in stream order).

    ``top5_request_share``: share of the requests holding one of the ``top`` most requested chunks
    (counted by the requests that retrieve them, ties to the earlier first request; ``ceil(top x
    distinct)`` chunks); ``top5_access_share``: those chunks' share of all retrievals;
    ``seen_share``: retrievals of a chunk an earlier request had; ``partial_overlap_share``: requests
    that share some but not all of their chunks with an earlier request; ``same_set_share``: requests
    whose chunk set an earlier request had (any order)."""
    counts = request_counts(chunk_sets)
    ranks = popularity_ranks(chunk_sets)
    hot = {c for c, rank in ranks.items() if rank < max(1, math.ceil(top * len(ranks)))}
    retrievals = sum(len(c) for c in chunk_sets)
    holders: dict[str, list[frozenset[str]]] = {}  # chunk -> the distinct earlier sets that hold it
    earlier: set[frozenset[str]] = set()
    seen_n = partial = same = 0
    for chunks in chunk_sets:
        now = frozenset(chunks)
        seen_n += sum(c in holders for c in chunks)
        partial += any(not now <= old for c in now for old in holders.get(c, ()))
        same += now in earlier
        if now not in earlier:
            earlier.add(now)
            for c in now:
                holders.setdefault(c, []).append(now)
    n = len(chunk_sets)
    return {
        "requests": n,
        "distinct_chunks": len(counts),
        "top_share": top,
        "top_chunks": len(hot),
        "top5_request_share": sum(bool(hot & set(c)) for c in chunk_sets) / n if n else None,
        "top5_access_share": sum(counts[c] for c in hot) / retrievals if retrievals else None,
        "seen_share": seen_n / retrievals if retrievals else None,
        "partial_overlap_share": partial / n if n else None,
        "same_set_share": same / n if n else None,
    }


def request_counts(chunk_sets: list[list[str]]) -> dict[str, int]:
    """How many requests retrieve each chunk, in order of first appearance."""
    counts: dict[str, int] = {}
    for chunks in chunk_sets:
        for chunk in dict.fromkeys(chunks):
            counts[chunk] = counts.get(chunk, 0) + 1
    return counts


def popularity_ranks(chunk_sets: list[list[str]]) -> dict[str, int]:
    """Each chunk's popularity rank in the stream: 0 = retrieved by the most requests, ties to the chunk
    requested first."""
    counts = request_counts(chunk_sets)
    return {chunk: rank for rank, chunk in enumerate(sorted(counts, key=lambda c: -counts[c]))}


@register
class RagStream(Rag):
    name = "rag_stream"
    Params = RagStreamParams
    params: RagStreamParams
    figure_kinds = ()
    shares_chunk_store = False  # every run starts on an empty store, also inside a sweep
    order_dependent = True  # a resumed run replays its finished requests to rebuild the store

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)  # (types, choices and ranges: RagStreamParams)
        if self.params.pipeline != "stuff":
            raise ConfigError("task rag_stream serves single prompts", "drop task.pipeline (or use task=rag)")
        self._check_popularity()

    def _check_popularity(self) -> None:
        p = self.params
        if not math.isfinite(p.zipf_s):
            raise ConfigError(f"task.zipf_s={p.zipf_s!r} must be finite", f"e.g. task.zipf_s={STREAM_KEYS['zipf_s']}")
        if p.popularity == "repeat":
            given = {"zipf_s": p.zipf_s, "requests": p.requests, "candidates": p.candidates}
            moved = [key for key, value in given.items() if value != STREAM_KEYS[key]]
            if moved:
                raise ConfigError(
                    f"task.{moved[0]} shapes the zipf stream, not task.popularity=repeat",
                    f"set task.popularity=zipf, or drop task.{moved[0]}",
                )
            return
        if p.repeats != self.defaults["repeats"]:
            raise ConfigError(
                "task.repeats counts the repeat stream's requests, not task.popularity=zipf's",
                "drop task.repeats and set task.requests",
            )
        if p.top_k is None:
            raise ConfigError("task.popularity=zipf retrieves task.top_k chunks per request", "set e.g. task.top_k=5")
        if p.candidates < p.top_k:
            raise ConfigError(
                f"task.candidates={p.candidates} is fewer than task.top_k={p.top_k} (a request draws "
                "top_k of its question's candidates)",
                f"set task.candidates={p.top_k} or more",
            )
        if p.chunk_tokens is not None:
            raise ConfigError(
                "task.popularity=zipf keeps each passage one chunk (re-cut chunks would depend on their companions)",
                "set task.chunk_tokens=null",
            )

    @property
    def zipf(self) -> bool:
        return self.params.popularity == "zipf"

    # ------------------------------------------------------------------ the stream
    def limited(self, samples: Iterable[T]) -> Iterator[T]:
        """The stream is complete as built: ``limit`` counts questions, before the repeats (see :meth:`_records`)."""
        return iter(samples)

    def _records(self) -> Iterator[RawSample]:
        if self.zipf:
            yield from self._zipf_records()
            return
        questions = list(islice(super()._records(), self.limit))
        asked = [(raw, k) for raw in questions for k in range(self.params.repeats)]
        for index in np.random.default_rng(self.params.seed).permutation(len(asked)):
            raw, k = asked[int(index)]
            yield dataclasses.replace(raw, id=f"{raw.id}~{k}")

    def sample_ids(self) -> list[str]:
        if self.zipf:  # from the draws alone: no retrieval, no model
            return [f"{self._questions[d.question].raw.id}~{d.ask}" for d in self._draws]
        return super().sample_ids()

    def samples(self, model: Any) -> Iterable[Sample]:
        if self.zipf:
            yield from self._zipf_samples(model)
            return
        warmup, seed = self.params.warmup, self.params.seed
        for position, sample in enumerate(super().samples(model)):
            segments = list(sample.segments or [])
            where = [i for i, s in enumerate(segments) if s.role == "chunk"]
            order = list(range(len(where)))
            if self.params.shuffle_chunks and len(where) > 1:
                order = [int(i) for i in np.random.default_rng([seed, position]).permutation(len(where))]
                chunks = [segments[i] for i in where]
                for slot, pick in zip(where, order):
                    segments[slot] = chunks[pick]
                sample.segments = segments
                sample.meta["chunk_lengths"] = [len(segments[i]) for i in where]
            sample.meta.update(
                stream_position=position,
                warmup=position < warmup,
                chunk_order=order,
                question_id=sample.id.rsplit("~", 1)[0],
                stream_seed=seed,
            )
            yield sample

    # ------------------------------------------------------------------ the zipf stream
    @cached_property
    def _questions(self) -> list[Question]:
        """The first ``limit`` questions, their passages' chunk ids (numbered in order of first appearance,
        so an id does not depend on ``limit``) and their Zipf ranks (a seeded permutation)."""
        ids: dict[str, str] = {}
        records: list[tuple[RawSample, tuple[str, ...]]] = []
        for raw in islice(Rag._records(self), self.limit):
            chunk_ids = tuple(ids.setdefault(p, f"{self.dataset.name}-p{len(ids)}") for p in raw.passages)
            records.append((raw, chunk_ids))
        ranks = np.random.default_rng([self.params.seed, 43, 1]).permutation(len(records))
        return [Question(raw, chunk_ids, int(rank)) for (raw, chunk_ids), rank in zip(records, ranks)]

    @cached_property
    def _draws(self) -> list[Draw]:
        """Every request of the zipf stream, before retrieval (seeded; no model, no retriever)."""
        questions, seed, top_k = self._questions, self.params.seed, self.params.top_k
        assert top_k is not None  # (popularity=zipf needs it: _check_popularity)
        by_rank = sorted(range(len(questions)), key=lambda q: questions[q].rank)
        p = zipf_probabilities(len(questions), self.params.zipf_s)
        picks = np.random.default_rng([seed, 43, 2]).choice(len(questions), size=self.params.requests, p=p)
        asked: dict[int, int] = {}
        draws = []
        for position, rank in enumerate(picks):
            q = by_rank[int(rank)]
            n = min(self.params.candidates, len(questions[q].raw.passages))
            k = min(top_k, n)
            drawn = rank_weighted_draw(np.random.default_rng([seed, 43, 3, position]), n, k)
            order = list(range(k))
            if self.params.shuffle_chunks and k > 1:
                order = [int(i) for i in np.random.default_rng([seed, position]).permutation(k)]
            draws.append(Draw(position, q, asked.get(q, 0), tuple(drawn[i] for i in order), tuple(order)))
            asked[q] = asked.get(q, 0) + 1
        return draws

    def _ranking(self, question: Question) -> list[int]:
        """The question's passages, best first, as ``task=rag`` ranks them (ties to the earlier passage)."""
        raw = question.raw
        distances = retriever(self.params.retriever).distances(str(raw.question), raw.passages)
        return sorted(range(len(raw.passages)), key=lambda i: (float(distances[i]), i))

    @cached_property
    def _stream(self) -> tuple[list[list[int]], dict[str, Any], dict[str, int]]:
        """Each request's passages (indices into its question's, prompt order), the stream's statistics
        (:func:`stream_stats`: the whole stream, and ``after_warmup``) and every chunk's popularity rank."""
        rankings: dict[int, list[int]] = {}
        passages = []
        for draw in self._draws:
            if draw.question not in rankings:
                rankings[draw.question] = self._ranking(self._questions[draw.question])
            passages.append([rankings[draw.question][r] for r in draw.ranks])
        chunk_sets = [self._chunk_ids(d, p) for d, p in zip(self._draws, passages)]
        stats = {**stream_stats(chunk_sets), "after_warmup": stream_stats(chunk_sets[self.params.warmup :])}
        return passages, stats, popularity_ranks(chunk_sets)

    def _chunk_ids(self, draw: Draw, passages: list[int]) -> list[str]:
        ids = self._questions[draw.question].chunk_ids
        return [ids[i] for i in passages]

    def _zipf_records(self) -> Iterator[RawSample]:
        passages, _, _ = self._stream
        for draw, picked in zip(self._draws, passages):
            raw = self._questions[draw.question].raw
            yield dataclasses.replace(raw, id=f"{raw.id}~{draw.ask}", passages=[raw.passages[i] for i in picked])

    def _zipf_samples(self, model: Any) -> Iterator[Sample]:
        warmup, seed = self.params.warmup, self.params.seed
        passages, _, popularity = self._stream
        seen: set[str] = set()
        for draw, picked, sample in zip(self._draws, passages, super().samples(model)):
            question = self._questions[draw.question]
            chunk_ids = self._chunk_ids(draw, picked)
            kept = list(range(len(chunk_ids)))
            for _ in range(int(sample.meta.get("dropped_chunks", 0))):  # as rag's fit_chunks drops them
                del kept[len(kept) // 2]
            sample.meta.update(
                stream_position=draw.position,
                warmup=draw.position < warmup,
                chunk_order=list(draw.order),
                question_id=question.raw.id,
                stream_seed=seed,
                popularity="zipf",
                question_rank=question.rank,
                chunk_ids=[chunk_ids[i] for i in kept],
                chunk_ranks=[draw.ranks[i] for i in kept],
                chunk_popularity=[popularity[chunk_ids[i]] for i in kept],
                chunks_seen=sum(chunk_ids[i] in seen for i in kept),
            )
            if len(kept) < len(chunk_ids):
                sample.meta["dropped_chunk_ids"] = [c for i, c in enumerate(chunk_ids) if i not in kept]
            seen.update(chunk_ids[i] for i in kept)
            yield sample

    def protocol(self) -> dict[str, Any]:
        protocol = {
            **super().protocol(),
            "task": self.name,
            "repeats": self.params.repeats,
            "seed": self.params.seed,
            "warmup": self.params.warmup,
            "shuffle_chunks": self.params.shuffle_chunks,
            "stream": "limit questions x repeats, seeded random order; served one at a time in that order",
        }
        if not self.zipf:
            return protocol
        del protocol["repeats"]
        return {
            **protocol,
            "popularity": "zipf",
            "zipf_s": self.params.zipf_s,
            "requests": self.params.requests,
            "candidates": self.params.candidates,
            "retrieved_order": "uniformly shuffled" if self.params.shuffle_chunks else "as drawn",
            "stream": "requests questions drawn by Zipf rank (P ~ 1/(rank+1)^zipf_s, ranks a seeded permutation); "
            "each takes top_k of its question's candidates best passages, drawn weighted 1/(retrieval rank+1); "
            "served one at a time in that order",
            "stream_stats": self._stream[1],
        }

    # ------------------------------------------------------------------ the figure
    @classmethod
    def comparison_figure(
        cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path, kind: str | None = None
    ) -> Path:
        """TTFT p50/p90 (queueing included) against achieved throughput, one line per run, on a rate grid
        shared by the runs (:func:`kvbench.stream.rate_grid`); the numbers go to ``path`` with ``.csv`` and
        ``.md`` suffixes."""
        import pandas as pd

        from kvbench.plots import stream_figure
        from kvbench.report import distinct_labels, to_markdown
        from kvbench.stream import rate_grid, service_times, stream_stats

        if kind is not None:
            raise ConfigError(f"task rag_stream has a single figure, not {kind!r}", "drop --figure-kind")
        prepared = []
        # one line of text per run: runs that would read alike get the config keys that tell them apart
        labels = distinct_labels(
            [str(title).split("\n")[0] for title, _ in runs], [getattr(r, "config", {}) for r in runs]
        )
        for label, (_, records) in zip(labels, runs):
            records = sorted(records, key=lambda r: r["meta"]["stream_position"])
            warmup = sum(bool(r["meta"].get("warmup")) for r in records)
            seed = int(records[0]["meta"].get("stream_seed", 0)) if records else 0
            service, _ = service_times(records[warmup:])
            prepared.append((label, records, warmup, seed, float(service.mean())))
        rates = rate_grid([p[4] for p in prepared])
        curves, rows = [], []
        for label, records, warmup, seed, _ in prepared:
            stats = stream_stats(records, rates, warmup=warmup, seed=seed)
            curves.append((label, stats))
            rows += [{"run": label, "warmup": warmup, **row} for row in stats]
        frame = pd.DataFrame(rows)
        frame.to_csv(path.with_suffix(".csv"), index=False)
        path.with_suffix(".md").write_text(to_markdown(frame) + "\n", encoding="utf-8")
        n = len(prepared[0][1]) if prepared else 0
        caption = (
            f"Each run's requests were served for real, one at a time in arrival order, with a chunk store that "
            f"started empty ({n} requests, the first {prepared[0][2] if prepared else 0} excluded); queueing "
            f"is replayed for Poisson arrivals at {len(rates)} rates ({rates[0]:.3g}–{rates[-1]:.3g} req/s, one "
            "seeded stream for every method): one server, FIFO, batch 1. TTFT = wait + chunk caches computed on "
            "a miss + prefill; throughput = served requests / (last completion - first arrival)."
        )
        return stream_figure(curves, path, title="TTFT under load vs achieved throughput", caption=caption)
