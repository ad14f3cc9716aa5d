"""``niah``: needle in a haystack on Paul Graham essays (Kamradt's test, as PQCache Fig. 9 runs it).

Construction (``LLMNeedleHaystackTester`` semantics, at the token level):

* the haystack is the essays (sorted by file name) concatenated and repeated until long enough;
* for a target length ``L`` the whole prompt — chat template, question and needle included — is
  exactly ``L`` tokens: the haystack gets what the rest leaves;
* the needle goes in at ``depth`` (0 = start, 1 = end) of the haystack, moved back to the nearest
  sentence end (a token ending in ".") so it never splits a sentence; depth 1 appends it;
* ``question_position: end`` (default) asks after the document; ``start`` asks before it (PQCache
  Table 3's question-first placement), nothing else changes.

Score (0–100): ROUGE-1 *recall* of the needle's answer ("eat a sandwich and sit in Dolores Park on a
sunny day") in the response, stemmed unigrams, × 100 — the share of the answer's words the model
reproduced; verbosity is not penalised. ``scorer: rouge1_f`` uses KVCache-Factory's ROUGE-1 F of the
response against the whole needle sentence (× 100 instead of × 10); ``scorer: substring`` gives 100
when the needle's key phrase ("dolores park") appears. The heatmap (length × depth, greener = better)
is ``heatmap.png``.

**Several needles** (``needles: N``, up to 8): the configured needle and N − 1 more of the same form
with other cities and answers (:data:`EXTRA_NEEDLES`), each with its own question ("What is the best
thing to do in Tokyo?"). As in LangChain's multi-needle test, the first needle goes in at the sample's
``depth`` and the others evenly spaced over the rest of the haystack (needle i at
``depth + i · (1 − depth) / N``), each moved back to a sentence end; the prompt stays exactly ``L``
tokens (with the longest question). The questions are asked in a rotated order — sample ``k`` of the
depth grid starts with needle ``k mod N`` — so over the grid every needle is asked first equally often
and "first question" is not "shallowest needle". One question (the default) asks only the first.

**Several questions per context** (``queries_per_context``, ``compression``, ``keep_answers``: see
:mod:`kvbench.tasks.base`): the first ``queries_per_context`` questions of that order about one
compressed context; the question comes after the document (``question_position: end``). ``kvbench
report --figure`` then draws each method's score by question index.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Literal

from kvbench.errors import ConfigError
from kvbench.params import param
from kvbench.requests import Segment
from kvbench.tasks import register
from kvbench.tasks.base import Sample, SampleQuery, Task, followup_frame
from kvbench.tasks.params import MultiQueryParams, QuestionPosition, data_dir_param, limit_param

SCORERS = ("rouge1_recall", "rouge1_f", "substring")
# the defaults: the needle of Kamradt's test (PQCache's Fig. 9)
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
INSTRUCTION = "Don't give information outside the document or repeat your findings"
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
PLACEHOLDER = "\u0000KVBENCH_HAYSTACK\u0000"
#: the needles after the configured one for ``needles > 1``: (city, answer, key phrase for ``substring``)
EXTRA_NEEDLES = (
    ("Tokyo", "ride the Yamanote line at dawn and eat ramen in Shinjuku", "yamanote"),
    ("Paris", "rent a bicycle and have a picnic by the Canal Saint-Martin", "canal saint-martin"),
    ("Rome", "drink an espresso standing at the bar and see the Pantheon at night", "pantheon"),
    ("London", "take a boat down the Thames and eat curry on Brick Lane", "brick lane"),
    ("Sydney", "swim at Bondi Beach and walk the cliff path to Coogee", "bondi"),
    ("Cairo", "sail a felucca on the Nile at sunset", "felucca"),
    ("Lisbon", "ride tram 28 to the castle and eat custard tarts in Belem", "tram 28"),
)


@dataclass(frozen=True)
class NiahParams(MultiQueryParams):
    """Needle in a haystack on Paul Graham essays (Kamradt; PQCache Fig. 9)."""

    #: prompts are exactly ``lengths`` tokens, template included (kvbench.validate checks them against the
    #: model before it loads, with ``max_new_tokens`` on top)
    exact_lengths: ClassVar[bool] = True

    lengths: tuple[int, ...] = param((1024, 2048, 4096), "whole-prompt lengths in tokens", min=1)
    depths: tuple[float, ...] = param(
        (0.0, 0.25, 0.5, 0.75, 1.0), "needle depths: 0 = start of the document, 1 = end", min=0, max=1
    )
    question_position: QuestionPosition = param("end", "end | start (question before the document, PQCache Table 3)")
    needle: str = param(NEEDLE, "the needle sentence")
    question: str = param(QUESTION, "the question about it")
    answer: str = param(ANSWER, "the reference answer")
    instruction: str = param(INSTRUCTION, "the instruction after the document")
    system_prompt: str = param(SYSTEM, "the system prompt")
    max_new_tokens: int = param(48, "tokens generated per answer", min=1)
    scorer: Literal["rouge1_recall", "rouge1_f", "substring"] = param("rouge1_recall", "how an answer is scored")
    haystack: str = param("paul_graham_essays", "packaged asset; task.data_dir=<folder of .txt> overrides")
    data_dir: str | None = data_dir_param("a folder of .txt files as the haystack (null: the packaged essays)")
    limit: int | None = limit_param("samples")
    needles: int = param(1, ">1: that many needles (other cities) with one question each", min=1, legacy=1)


@dataclass(frozen=True)
class Needle:
    """A fact hidden in the haystack, the question that asks for it and its scored answer."""

    text: str
    question: str
    answer: str
    key: str  # what ``scorer: substring`` looks for (lower case)


@register
class NeedleInAHaystack(Task):
    name = "niah"
    Params = NiahParams
    params: NiahParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)  # (types, depths in [0, 1], needles >= 1: NiahParams)
        lengths = list(self.params.lengths)
        depths = list(self.params.depths)
        if not lengths or min(lengths) < 64:
            raise ConfigError(
                f"task.lengths={lengths} must be token counts of at least 64", "e.g. task.lengths=[1024,2048]"
            )
        if not depths:
            raise ConfigError(f"task.depths={depths} must lie in [0, 1]", "e.g. task.depths=[0,0.5,1]")
        count, asked = self.params.needles, self.params.queries_per_context
        if count > 1 + len(EXTRA_NEEDLES):
            raise ConfigError(
                f"task.needles={count!r} must be an integer from 1 to {1 + len(EXTRA_NEEDLES)}", "e.g. task.needles=4"
            )
        if asked > count:
            raise ConfigError(
                f"task.queries_per_context={asked} asks more questions than the {count} needle(s) answer",
                f"set task.needles={asked} or more",
            )
        if self.multi_query and self.params.question_position != "end":
            raise ConfigError(
                "several questions per context, or a question-agnostic context, need the question after the document",
                "drop task.question_position=start",
            )
        self.lengths = lengths
        self.depths = depths
        self.needles = self.needle_set()
        self._keys = {needle.answer: needle.key for needle in self.needles}

    def needle_set(self) -> list[Needle]:
        """The configured needle, then ``needles - 1`` of :data:`EXTRA_NEEDLES`."""
        answer = self.params.answer
        first = Needle(
            self.params.needle,
            self.params.question,
            answer,
            "dolores park" if answer == ANSWER else answer.lower(),
        )
        extra = [
            Needle(
                f"\nThe best thing to do in {city} is {answer}.\n",
                f"What is the best thing to do in {city}?",
                answer,
                key,
            )
            for city, answer, key in EXTRA_NEEDLES
        ]
        return [first, *extra][: self.params.needles]

    def order(self, depth: float) -> list[int]:
        """The order the needles are asked in for a sample at ``depth``: rotated by the depth's index."""
        n = len(self.needles)
        start = self.depths.index(depth) % n
        return [(start + j) % n for j in range(n)]

    # ------------------------------------------------------------------ samples
    @staticmethod
    def sample_id(length: int, depth: float) -> str:
        return f"len{length}_depth{depth:g}"

    def _grid(self) -> list[tuple[int, float]]:
        return [(length, depth) for length in self.lengths for depth in self.depths]

    def sample_ids(self) -> list[str]:
        return [self.sample_id(length, depth) for length, depth in self.limited_grid()]

    def protocol(self) -> dict[str, Any]:
        extra = (
            {
                "needles": len(self.needles),
                "needle_depths": "depth + i (1 - depth) / needles",
                "question_order": "rotated by the depth's index",
            }
            if len(self.needles) > 1
            else {}
        )
        return {
            "task": self.name,
            "question_position": self.params.question_position,
            "chat_template": True,
            "system_prompt": self.params.system_prompt,
            "max_new_tokens": self.params.max_new_tokens,
            "scorer": self.params.scorer,
            "length_unit": "tokens of the whole prompt (template included)",
            **extra,
            **self.multi_query_protocol(),
        }

    def _ask(self, needle: Needle) -> str:
        return f"{needle.question} {self.params.instruction}".strip()

    def _user_message(self, context: str, needle: Needle) -> str:
        ask = self._ask(needle)
        if self.params.question_position == "start":
            return f"{ask}\n\n{context}"
        return f"{context}\n\n{ask}"

    def samples(self, model: Any) -> Iterable[Sample]:
        tokenizer = model.tokenizer
        chat = model.chat
        system = self.params.system_prompt
        chat = type(chat)(chat.tokenizer, system_prompt=system, template=chat.template) if system else chat

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False).input_ids

        # per needle: the template before and after the haystack when its question is asked
        frames = [
            [encode(part) for part in chat.render(self._user_message(PLACEHOLDER, n)).split(PLACEHOLDER)]
            for n in self.needles
        ]
        followups = None
        if self.multi_query:
            before, after = followup_frame(chat)
            followups = [encode(before + self._ask(n) + after) for n in self.needles]
        needles = [encode(n.text) for n in self.needles]
        fixed = max(len(head) + len(tail) for head, tail in frames) + sum(len(n) for n in needles)
        haystack = self._haystack_ids(tokenizer, max(self.lengths))
        periods = _sentence_end_ids(tokenizer, tuple(sorted(set(haystack))))
        for length, depth in self.limited_grid():
            room = length - fixed
            if room < 1:
                raise ConfigError(
                    f"task.lengths contains {length}, too short for the prompt's {length - room} fixed tokens",
                    "use lengths of a few hundred tokens or more",
                )
            count = len(needles)
            depths = [depth + i * (1 - depth) / count for i in range(count)]
            context = _insert_all(haystack[:room], needles, depths, periods)
            order = self.order(depth)
            head, tail = frames[order[0]]
            queries = [
                SampleQuery(
                    self.needles[k].answer, frames[k][1], followups[k] if followups else None, self.needles[k].question
                )
                for k in order
            ]
            meta: dict[str, Any] = {
                "length": length,
                "depth": depth,
                "prompt_tokens": len(head) + len(context) + len(tail),
            }
            if count > 1:
                meta.update(needle_depths=[round(d, 4) for d in depths], order=order)
            yield Sample(
                id=self.sample_id(length, depth),
                reference=self.needles[order[0]].answer,
                input_ids=head + context + tail,
                max_new_tokens=self.params.max_new_tokens,
                subset=f"len{length}",
                meta=meta,
                context=[Segment(tuple(head), "prefix"), Segment(tuple(context), "chunk")]
                if self.params.question_position == "end"
                else None,
                queries=queries if self.params.question_position == "end" else None,
            )

    def limited_grid(self) -> list[tuple[int, float]]:
        grid = self._grid()
        return grid[: self.limit] if self.limit is not None else grid

    def _haystack_ids(self, tokenizer: Any, length: int) -> list[int]:
        text = _essays_text(self._haystack_dir())
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ConfigError(f"the haystack in {self._haystack_dir()} is empty", "point task.data_dir at .txt files")
        repeats = -(-length // len(ids))
        return (ids * repeats)[:length]

    def data_files(self) -> list[Path]:
        """The essays of ``task.data_dir`` (each checked to be text before the model loads); none for the
        packaged haystack."""
        return sorted(self._haystack_dir().glob("*.txt")) if self.params.data_dir else []

    def _haystack_dir(self) -> Path:
        if self.params.data_dir:
            path = Path(self.params.data_dir).expanduser()
            if not path.is_dir() or not list(path.glob("*.txt")):
                raise ConfigError(f"task.data_dir={path} holds no .txt files", "point it at a folder of essays")
            return path
        from kvbench.assets import fetch_asset

        return fetch_asset(self.params.haystack)

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        scorer = self.params.scorer
        if scorer == "substring":
            return 100.0 if self._keys.get(str(sample.reference), "dolores park") in prediction.lower() else 0.0
        needle = next((n.text for n in self.needles if n.answer == sample.reference), self.params.needle)
        target = str(sample.reference) if scorer == "rouge1_recall" else needle.strip()
        result = _rouge1().score(target, prediction)["rouge1"]
        return 100.0 * (result.recall if scorer == "rouge1_recall" else result.fmeasure)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = super().aggregate(records)
        grid: dict[str, dict[str, float]] = {}
        for record in records:
            meta = record.get("meta", {})
            grid.setdefault(str(meta.get("length")), {})[f"{meta.get('depth'):g}"] = round(record["score"], 2)
        metrics["grid"] = grid
        return metrics

    def artifacts(self, records: list[dict[str, Any]], run_dir: Path, title: str) -> list[Path]:
        from kvbench.plots import niah_heatmap

        path = run_dir / "heatmap.png"
        niah_heatmap(records, path, title=title)
        return [path]

    @classmethod
    def comparison_figure(cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
        """The runs' heatmaps side by side (PQCache Fig. 9); for multi-query runs, each run's score by
        question index."""
        from kvbench.plots import niah_panels, score_by_query

        if any(record.get("queries") for _, records in runs for record in records):
            return score_by_query(runs, path)
        return niah_panels(runs, path)


def _insert(context: list[int], needle: list[int], depth: float, periods: frozenset[int]) -> list[int]:
    """Put ``needle`` at ``depth`` of ``context``, backing up to the previous sentence end."""
    return _insert_all(context, [needle], [depth], periods)


def _insert_all(
    context: list[int], needles: list[list[int]], depths: list[float], periods: frozenset[int]
) -> list[int]:
    """Put each needle at its depth of ``context`` (depth 1 appends), each backed up to the previous
    sentence end; the points are taken on ``context`` itself, so needles never split each other."""
    points = []
    for depth in depths:
        point = len(context) if depth >= 1.0 else int(len(context) * depth)
        while 0 < point < len(context) and context[point - 1] not in periods:
            point -= 1
        points.append(point)
    out = list(context)
    # deepest first, and among needles at one point the later first, so each lands before the next
    for _, index in sorted(((point, index) for index, point in enumerate(points)), reverse=True):
        out[points[index] : points[index]] = needles[index]
    return out


@lru_cache(maxsize=8)
def _sentence_end_ids(tokenizer: Any, ids: tuple[int, ...]) -> frozenset[int]:
    return frozenset(i for i in ids if tokenizer.decode([i]).rstrip().endswith("."))


@lru_cache(maxsize=4)
def _essays_text(folder: Path) -> str:
    return "".join(path.read_text(encoding="utf-8", errors="replace") for path in sorted(folder.glob("*.txt")))


@lru_cache(maxsize=1)
def _rouge1() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
