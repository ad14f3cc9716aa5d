"""``rag_stream``: the rag task's questions as one stream of requests to a server (CacheBlend Fig. 14).

CacheBlend's throughput experiment (§7.1) builds "Musique/2WikiMQA extended": 1,500 questions each
asked four times (the original and three GPT-4 paraphrases), every request's top-6 chunks in a random
order, sent to one engine whose chunk store starts empty; the first 1K requests are skipped. This task
builds that stream from the rag task's data (every option of ``task=rag`` applies: ``dataset``,
``chunk_tokens``, ``top_k``, ``retriever``, ``max_length``):

* the first ``limit`` questions, each asked ``repeats`` times (default 4), the requests in a seeded
  random order (``seed``) — the arrival order; sample ids are ``<question id>~<k>``;
* each request's chunks in a random order of their own (``shuffle_chunks``, seeded by the request's
  place in the stream), so a chunk seen before sits at another position: CacheBlend's cache still
  hits, a prefix cache hits only when the same chunk happens to come first;
* each record says whether it is in the warm-up (the first ``warmup`` requests, excluded from the
  statistics), its place in the stream and its chunk order.

A run executes the requests in that order, one at a time, with one chunk store for the whole run:
start it on an empty store — ``store.tier=ram store.disk_gb=0`` (a disk folder keeps entries between
runs, and a RAM store would promote them) — and run it to the end in one go (a resumed run restarts with an
empty store; every record keeps what its request really had to compute, so the figures stay true to what
happened). For prefix caching
use ``method.warm=none method.store_prompts=true`` (it then stores every prompt after answering it).

Deviation: GPT-4 paraphrases cannot be made offline; a repeat asks the identical question, so it
retrieves the same chunks (a paraphrase may retrieve a slightly different set). Everything about
queueing is in :mod:`kvbench.stream`; ``kvbench report --figure F.png --where task=rag_stream`` draws
TTFT p50/p90 against achieved throughput for the runs (one line per method) and writes the numbers
beside the figure (``F.csv``, ``F.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.errors import ConfigError
from kvbench.tasks import register
from kvbench.tasks.base import Sample, T
from kvbench.tasks.rag import Rag, RawSample


@register
class RagStream(Rag):
    name = "rag_stream"
    defaults = {**Rag.defaults, "repeats": 4, "seed": 0, "warmup": 20, "shuffle_chunks": True}
    figure_kinds = ()
    shares_chunk_store = False  # every run starts on an empty store, also inside a sweep

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        for key, low in (("repeats", 1), ("warmup", 0), ("seed", 0)):
            value = self.cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"task.{key}={value!r} must be an integer >= {low}", f"e.g. task.{key}={max(low, 1)}")
        if not isinstance(self.cfg["shuffle_chunks"], bool):
            raise ConfigError(
                f"task.shuffle_chunks={self.cfg['shuffle_chunks']!r} must be true or false",
                "use task.shuffle_chunks=true",
            )
        if self.cfg["pipeline"] != "stuff":
            raise ConfigError("task rag_stream serves single prompts", "drop task.pipeline (or use task=rag)")

    # ------------------------------------------------------------------ the stream
    def limited(self, samples: Iterable[T]) -> Iterator[T]:
        """The stream is complete as built: ``limit`` counts questions, before the repeats (see :meth:`_records`)."""
        return iter(samples)

    def _records(self) -> Iterator[RawSample]:
        questions = list(islice(super()._records(), self.limit))
        asked = [(raw, k) for raw in questions for k in range(int(self.cfg["repeats"]))]
        for index in np.random.default_rng(int(self.cfg["seed"])).permutation(len(asked)):
            raw, k = asked[int(index)]
            yield dataclasses.replace(raw, id=f"{raw.id}~{k}")

    def samples(self, model: Any) -> Iterable[Sample]:
        warmup, seed = int(self.cfg["warmup"]), int(self.cfg["seed"])
        for position, sample in enumerate(super().samples(model)):
            segments = list(sample.segments or [])
            where = [i for i, s in enumerate(segments) if s.role == "chunk"]
            order = list(range(len(where)))
            if self.cfg["shuffle_chunks"] and len(where) > 1:
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

    def protocol(self) -> dict[str, Any]:
        return {
            **super().protocol(),
            "task": self.name,
            "repeats": self.cfg["repeats"],
            "seed": self.cfg["seed"],
            "warmup": self.cfg["warmup"],
            "shuffle_chunks": self.cfg["shuffle_chunks"],
            "stream": "limit questions x repeats, seeded random order; served one at a time in that order",
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
        from kvbench.report import to_markdown
        from kvbench.stream import rate_grid, service_times, stream_stats

        if kind is not None:
            raise ConfigError(f"task rag_stream has a single figure, not {kind!r}", "drop --figure-kind")
        prepared = []
        for title, records in runs:
            records = sorted(records, key=lambda r: r["meta"]["stream_position"])
            warmup = sum(bool(r["meta"].get("warmup")) for r in records)
            seed = int(records[0]["meta"].get("stream_seed", 0)) if records else 0
            service, _ = service_times(records[warmup:])
            prepared.append((str(title).split("\n")[0], records, warmup, seed, float(service.mean())))
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
        return stream_figure(
            curves, path, title="TTFT under load vs achieved throughput (CacheBlend Fig. 14)", caption=caption
        )
