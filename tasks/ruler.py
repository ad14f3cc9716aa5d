"""``ruler``: NVIDIA RULER's 13 synthetic tasks, generated offline with the running model's tokenizer.

Tasks (``task.subsets``, default all): the eight needle variants ``niah_single_1/2/3``,
``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery``; variable tracking ``vt``; common-
and frequent-words extraction ``cwe`` / ``fwe``; and the QA tasks ``qa_1`` (SQuAD) / ``qa_2``
(HotpotQA), which need data: ``task.data_dir`` holding RULER's files — ``squad.json`` (SQuAD v2.0
dev, ``dev-v2.0.json``) and ``hotpotqa.json`` (HotpotQA dev distractor, ``hotpot_dev_distractor_v1.json``;
either name works). Without them the QA tasks are skipped with one printed line. Generators, templates
and the task table are in :mod:`kvbench.tasks.ruler_data` and :mod:`kvbench.tasks.ruler_protocol`.

Construction, for every task, length ``L`` in ``task.lengths`` and sample index ``i <
task.num_samples``:

* a random generator seeded by ``(task.seed, task, L, i)`` draws the sample; few-shot examples (the
  variable-tracking example of about 500 tokens, the common-words example) are drawn first;
* the prompt is RULER's: instruction, context and question in the user turn of the model's chat
  template (``task.chat_template=false``: RULER's ``base`` template, plain text), the answer prefix
  (" The special magic number for ... is") opening the assistant's reply;
* the haystack size is the largest for which the prompt's tokens plus the task's tokens to generate
  fit in ``L`` — RULER's ``max_seq_length``, which counts the generation — found by secant steps and
  bisection on exact token counts of the sample itself (RULER bisects once per task on a probe sample
  and then steps down by 500 words / 25 lines for samples that overflow; per-sample fitting keeps every
  prompt within a few tokens of the limit);
* the prompt is three segments, tokenized apart and joined: ``prefix`` (chat head, examples,
  instruction), ``chunk`` (the context) and ``query`` (question, chat tail, answer prefix).

A sample's draw keeps every question its context answers on its own (each needle key, each chain);
:meth:`Ruler.build` returns it with the fitted segments, and :func:`~kvbench.tasks.ruler_protocol.render`
words any of those questions, so several can be asked about one context in turn.

**Several questions per context** (``queries_per_context``, ``compression``, ``keep_answers``; see
:mod:`kvbench.tasks.base`): a sample asks its draw's questions one key at a time — RULER's asked keys
first (``niah_multiquery``: its four; ``niah_multikey_*``: the asked key, then the distractor needles'
keys as further questions), the rest in key order — up to ``queries_per_context``; a task whose
context answers fewer questions (``niah_single_*``, ``niah_multikey_2/3`` with one real key,
``vt``, ``cwe``, ``fwe``, QA: one) asks the ones it has. The haystack is fitted so that the context
with its *longest* question, plus the generation, fits ``L``. Each question is worded as RULER words a
one-key question (singular: "What is the special magic number for ...") and scored alone.

Every input of the generator is a config key (``seed``, ``lengths``, ``num_samples``, ``subsets``,
``haystack``, ``chat_template``, ``data_dir``, ``generator_version``), and the model is in the run id
too, so the run id names the samples; each sample's meta records a digest of its token ids. A change
to the generators bumps :data:`GENERATOR_VERSION`, and a config naming another version is refused.

Score (0–100): RULER's ``string_match_all`` — the share of the expected strings found in the output,
case-insensitive — and ``string_match_part`` (any of the answers) for QA. ``metrics.json`` has the
mean per task (``per_subset.<task>``), per length over tasks (``per_subset.len<L>``), the grid
``task_length`` and the overall ``score``, the mean over all task × length cells.

QA: sample ``i`` asks the ``i``-th answerable question of the file (RULER's order; the seed picks the
distractor documents), with its gold documents, the rest of its article (SQuAD) and random others.

Deviations: sentences are split by a regular expression (RULER: nltk's punkt model, which needs a
download); the essays are kvbench's 49 Paul Graham essays (RULER downloads its own list); word keys
pair a random adjective with a random noun (RULER: a random element of the set of all pairs, the same
but for a few duplicates); keys are distinct and distractor keys never equal a needle key; ``fwe``
fits its size like the others (RULER grows it in steps of L/32 words); the variable-tracking example
is drawn afresh per sample at a size fitted once (RULER draws one and renames its variables per
sample); few-shot examples are RULER's task text without the model template RULER leaves inside them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from random import Random
from typing import Any

import numpy as np

from kvbench.errors import ConfigError, note
from kvbench.params import param
from kvbench.requests import Segment
from kvbench.tasks import register
from kvbench.tasks.base import Sample, SampleQuery, Task, followup_frame, multi_query_metrics
from kvbench.tasks.params import MultiQueryParams, QuestionPosition, data_dir_param, limit_param
from kvbench.tasks.ruler_data import (
    WONDERWORDS_VERSION,
    Draw,
    QASet,
    Question,
    common_words,
    common_words_vocabulary,
    essay_words,
    freq_words,
    niah,
    qa,
    read_hotpotqa,
    read_squad,
    ruler_question,
    variable_tracking,
)
from kvbench.tasks.ruler_protocol import FAMILIES, QA_TASKS, TASKS, PromptText, render, score


@dataclass(frozen=True)
class RulerParams(MultiQueryParams):
    """NVIDIA RULER's synthetic tasks, generated with the model's tokenizer."""

    subsets: tuple[str, ...] | str = param(tuple(TASKS), "RULER task names, or [all]")
    lengths: tuple[int, ...] = param((4096, 8192), "prompt + tokens to generate (RULER's max_seq_length)", min=1)
    num_samples: int = param(20, "per task and length (RULER: 500)", min=1)
    seed: int = param(42, "fixed seed: byte-identical samples")
    haystack: str = param("paul_graham_essays", "essay haystack: a packaged asset or a folder of .txt")
    chat_template: bool = param(True, "false: RULER's base template (plain text)")
    generator_version: int = param(1, "names the generators' revision (part of the run id)", min=1)
    data_dir: str | None = data_dir_param(
        "qa_1 / qa_2: a folder with squad.json (SQuAD v2.0 dev) and hotpotqa.json (HotpotQA dev distractor); "
        "without them they are skipped"
    )
    question_position: QuestionPosition = param("end", "RULER asks after the context")
    limit: int | None = limit_param("samples per task and length (at most num_samples)")


#: bump when a change to the generators or prompts changes any sample
GENERATOR_VERSION = 1
#: RULER's few-shot variable-tracking example is fitted to this many tokens
VT_EXAMPLE_TOKENS = 500
QA_FILES = {"qa_1": ("squad.json", "dev-v2.0.json"), "qa_2": ("hotpotqa.json", "hotpot_dev_distractor_v1.json")}
PLACEHOLDER = "\u0000KVBENCH_USER\u0000"


def sample_seed(seed: int, task: str, length: int, index: int) -> int:
    """A stable per-sample seed (Python's ``hash`` of strings changes between processes)."""
    return int.from_bytes(hashlib.sha256(f"ruler/{seed}/{task}/{length}/{index}".encode()).digest()[:8], "little")


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def largest_fitting(measure: Callable[[int], int], budget: int, low: int, high: int | None = None) -> int | None:
    """The largest ``n`` in ``[low, high]`` with ``measure(n) <= budget``, or None when ``low`` overflows.

    ``measure`` (a prompt's token count for a haystack of ``n`` units) grows about linearly, so secant
    steps from the sizes measured so far bracket the answer, and interpolation between the nearest
    fitting and overflowing sizes (each checked with its neighbour) closes the bracket, usually in a
    handful of measurements. The result fits, and ``n + 1`` does not (unless ``n == high``).
    """
    sizes: dict[int, int] = {}

    def size(n: int) -> int:
        if n not in sizes:
            sizes[n] = measure(n)
        return sizes[n]

    if size(low) > budget:
        return None
    lo, prev, hi = low, None, None
    while hi is None:
        if high is not None and lo >= high:
            return lo
        rate = (size(lo) - size(prev)) / (lo - prev) if prev is not None else 0.0
        n = lo + int((budget - size(lo)) / rate) + 1 if rate > 0 else 2 * lo + 8
        n = max(n, lo + 1) if high is None else min(max(n, lo + 1), high)
        if size(n) <= budget:
            prev, lo = lo, n
        else:
            hi = n
    while hi - lo > 1:
        guess = lo + (budget - size(lo)) * (hi - lo) // (size(hi) - size(lo))
        n = min(max(guess, lo + 1), hi - 1)
        if size(n) <= budget:
            lo = n
            if n + 1 < hi and size(n + 1) > budget:
                hi = n + 1
        else:
            hi = n
            if n - 1 > lo and size(n - 1) <= budget:
                lo = n - 1
    return lo


@register
class Ruler(Task):
    name = "ruler"
    chunked = True  # prefix / the haystack as one chunk / query
    # a sweep split into one run per length draws one curve per method, also when the lengths were run
    # with different sample counts (a draw depends only on seed, task, length and index)
    figure_joins = ("lengths", "num_samples")
    Params = RulerParams
    params: RulerParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)  # (types, ranges, num_samples >= 1: RulerParams)
        subsets = self.params.subsets
        names = [subsets] if isinstance(subsets, str) else list(subsets)
        names = list(TASKS) if names == ["all"] else names
        unknown = [n for n in names if n not in TASKS]
        if unknown or not names:
            raise ConfigError(
                f"unknown RULER task(s) {', '.join(unknown) or '(none given)'}",
                f"task.subsets takes [all] or names from {', '.join(TASKS)}",
            )
        self.lengths = list(self.params.lengths)
        if not self.lengths or min(self.lengths) < 256:
            raise ConfigError(
                f"task.lengths={self.lengths} must be token counts of at least 256", "e.g. task.lengths=[4096,8192]"
            )
        self.num_samples = self.params.num_samples
        version = self.params.generator_version
        if version != GENERATOR_VERSION:
            raise ConfigError(
                f"task.generator_version={version} names other RULER samples than this "
                f"kvbench generates (version {GENERATOR_VERSION})",
                f"drop the override, or use the kvbench release that generated version {version}",
            )
        if self.params.question_position != "end":
            raise ConfigError(
                f"task.question_position={self.params.question_position!r}: RULER asks after the context",
                "drop task.question_position",
            )
        self.qa_paths = {task: self._qa_file(task) for task in names if task in QA_TASKS}
        skipped = [task for task, path in self.qa_paths.items() if path is None]
        if skipped:
            note(
                f"ruler: skipping {', '.join(skipped)}: no SQuAD / HotpotQA in task.data_dir "
                f"(put RULER's squad.json / hotpotqa.json there)"
            )
        self.names = [n for n in names if n not in skipped]
        self.skipped = skipped
        self._vt_units: dict[int, int] = {}  # per tokenizer

    def _qa_file(self, task: str) -> Path | None:
        if not self.params.data_dir:
            return None
        from kvbench.tasks.sources import data_folder

        folder = data_folder(self.params.data_dir)
        assert folder is not None  # (task.data_dir is set)
        found = [p for name in QA_FILES[task] for p in [folder / name, *sorted(folder.rglob(name))] if p.is_file()]
        return found[0] if found else None

    # ------------------------------------------------------------------ ids and protocol
    def per_cell(self) -> int:
        return min(self.num_samples, self.limit) if self.limit is not None else self.num_samples

    def _grid(self) -> list[tuple[str, int, int]]:
        return [(task, length, i) for task in self.names for length in self.lengths for i in range(self.per_cell())]

    @staticmethod
    def sample_id(task: str, length: int, index: int) -> str:
        return f"{task}-len{length}-{index}"

    def sample_ids(self) -> list[str]:
        return [self.sample_id(*cell) for cell in self._grid()]

    def protocol(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "generator_version": GENERATOR_VERSION,
            "tasks": self.names,
            "skipped": self.skipped,
            "length_unit": "prompt tokens (chat template and answer prefix included) + the task's tokens to "
            "generate <= length (RULER's max_seq_length)",
            "max_new_tokens": {t: FAMILIES[TASKS[t][0]].max_new_tokens for t in self.names},
            "metric": {t: "string_match_" + FAMILIES[TASKS[t][0]].metric for t in self.names},
            "chat_template": self.params.chat_template,
            "answer_prefix": "opens the assistant turn",
            "wonderwords": WONDERWORDS_VERSION,
            "sentence_split": "regex (RULER: nltk punkt)",
            **(
                {"questions": "one key each: RULER's asked keys first, then the others; up to queries_per_context"}
                if self.multi_query
                else {}
            ),
            **self.multi_query_protocol(),
        }

    # ------------------------------------------------------------------ samples
    def samples(self, model: Any) -> Iterable[Sample]:
        for length in self.lengths:
            if length > model.spec.max_length:
                raise ConfigError(
                    f"task.lengths has {length}, beyond the model's {model.spec.max_length} tokens",
                    f"use lengths up to {model.spec.max_length}",
                )
        for task, length, index in self._grid():
            yield self.make_sample(task, length, index, model)

    def make_sample(self, task: str, length: int, index: int, model: Any) -> Sample:
        """Sample ``index`` of ``task`` at ``length``: drawn, fitted to the length, tokenized."""
        draw, units, prompts = self._fit(task, length, index, model)
        segments = prompts[0]
        ids = [i for s in segments for i in s.ids]
        questions = self.questions(draw)
        meta = {
            "task": task,
            "length": length,
            "index": index,
            "units": units,
            "prompt_tokens": len(ids),
            "query": questions[0].query,
            "digest": ids_digest(ids),
        }
        context, queries = None, None
        if self.multi_query:
            context = segments[:2]
            followups = self._followups(task, draw, questions, model)
            queries = [
                SampleQuery(list(q.answers), list(p[2].ids), f, q.query)
                for q, p, f in zip(questions, prompts, followups)
            ]
            meta["queries_digest"] = ids_digest([i for q in queries for i in q.ids])
        return Sample(
            id=self.sample_id(task, length, index),
            reference=list(questions[0].answers),
            input_ids=ids,
            segments=segments,
            max_new_tokens=FAMILIES[TASKS[task][0]].max_new_tokens,
            subset=task,
            meta=meta,
            context=context,
            queries=queries,
        )

    def questions(self, draw: Draw) -> list[Question]:
        """What a sample asks: RULER's one question, or (multi-query) its draw's questions one key at a
        time, RULER's asked keys first, up to ``queries_per_context``."""
        if not self.multi_query:
            return [ruler_question(draw)]
        order = list(draw.asked) + [i for i in range(len(draw.questions)) if i not in draw.asked]
        return [draw.questions[i] for i in order][: self.params.queries_per_context]

    def build(self, task: str, length: int, index: int, model: Any) -> tuple[Draw, int, list[Segment]]:
        """The sample's draw (context and every question it answers), its haystack size, and the
        segments of RULER's prompt (of its first question, in multi-query mode): the largest haystack
        whose prompt plus the task's tokens to generate fit in ``length``."""
        draw, units, prompts = self._fit(task, length, index, model)
        return draw, units, prompts[0]

    def _fit(self, task: str, length: int, index: int, model: Any) -> tuple[Draw, int, list[list[Segment]]]:
        """:meth:`build` with the segments of every question the sample asks (one prompt each, sharing
        their prefix and context); the longest one decides the fit."""
        family = FAMILIES[TASKS[task][0]]
        budget = length - family.max_new_tokens
        draw_at = self.drawer(task, length, index, model)
        built: dict[int, tuple[Draw, list[list[Segment]]]] = {}

        def measure(units: int) -> int:
            draw = draw_at(units)
            prompts = self.prompts([render(task, draw, q) for q in self.questions(draw)], model)
            built[units] = (draw, prompts)
            return len(prompts[0][0]) + len(prompts[0][1]) + max(len(p[2]) for p in prompts)

        low, high = self._unit_range(task)
        units = largest_fitting(measure, budget, low, high)
        if units is None:
            raise ConfigError(
                f"task.lengths has {length}, too short for {task} ({measure(low)} prompt tokens with the smallest "
                f"haystack + {family.max_new_tokens} to generate)",
                "use longer task.lengths",
            )
        if high is not None and units == high:
            raise ConfigError(
                f"{task} at length {length} needs more than the {high} distinct words of its vocabulary",
                f"drop {task} from task.subsets or use shorter task.lengths",
            )
        draw, prompts = built[units]
        return draw, units, prompts

    def _unit_range(self, task: str) -> tuple[int, int | None]:
        """The smallest haystack a task's generator accepts, and the largest (None: unbounded)."""
        family, args = TASKS[task]
        if family == "niah":
            needles = max(args.get("num_keys", 1), args.get("num_queries", 1)) * args.get("num_values", 1)
            return (1 if args["haystack"] == "essay" else needles), None
        if family == "variable_tracking":
            return args["num_hops"] + 1, None
        if family == "common_words_extraction":
            return args["num_cw"], len(common_words_vocabulary())
        if family == "qa":
            return (1 if args["dataset"] == "squad" else 10), None  # a HotpotQA question has ten paragraphs
        return 1, None

    def drawer(self, task: str, length: int, index: int, model: Any) -> Callable[[int], Draw]:
        """``units -> Draw`` for one sample: every call replays the sample's own random generator."""
        family, args = TASKS[task]
        seed = sample_seed(self.params.seed, task, length, index)
        if family == "niah":
            essay = self._essay() if args["haystack"] == "essay" else ()
            return lambda units: niah(Random(seed), units, essay=essay, **args)
        if family == "variable_tracking":
            example_units = self._vt_example_units(model)

            def vt(units: int) -> Draw:
                rng = Random(seed)
                example = variable_tracking(
                    rng, example_units, num_chains=args["num_chains"], num_hops=min(10, args["num_hops"]), name_length=3
                )
                return variable_tracking(rng, units, examples=(example,), **args)

            return vt
        if family == "common_words_extraction":
            short = length < 4096  # RULER's smaller repeats and example below 4K
            example_args = (
                dict(num_cw=args["num_cw"], freq_cw=3, freq_ucw=1)
                if short
                else dict(num_cw=args["num_cw"], freq_cw=10, freq_ucw=3)
            )
            main_args = dict(num_cw=args["num_cw"], freq_cw=6, freq_ucw=1) if short else args

            def cwe(units: int) -> Draw:
                rng = Random(seed)
                example = common_words(rng, 20 if short else 40, **example_args)
                return common_words(rng, units, examples=(example,), **main_args)

            return cwe
        if family == "freq_words_extraction":
            vocab_size = (length - FAMILIES[family].max_new_tokens) // 50
            return lambda units: freq_words(Random(seed), units, vocab_size=vocab_size, **args)
        dataset = self._qa_set(task)
        return lambda units: qa(Random(seed), units, dataset=dataset, item=index)

    # ------------------------------------------------------------------ prompts and data
    def segments(self, text: PromptText, model: Any) -> list[Segment]:
        """``prefix`` (chat head + examples + instruction), ``chunk`` (the context) and ``query`` (question,
        chat tail, answer prefix), each tokenized alone. Spaces that end the instruction move to the
        context, so the boundary falls where a BPE tokenizer splits anyway."""
        return self.prompts([text], model)[0]

    def prompts(self, texts: list[PromptText], model: Any) -> list[list[Segment]]:
        """:meth:`segments` of several questions about one context: the prefix and the context are
        tokenized once (they must not depend on the question), the query part of each."""
        tokenizer = model.tokenizer
        head, tail = self._chat_frame(model)
        first = texts[0]
        if any(t.before != first.before or t.context != first.context for t in texts[1:]):
            raise ValueError("the questions of one RULER context must share its instruction and context")
        before = first.before.rstrip(" ")
        context = first.before[len(before) :] + first.context
        base = not self.params.chat_template
        prefix = Segment(tokenizer(head + before, add_special_tokens=base).input_ids, "prefix")
        chunk = Segment(tokenizer(context, add_special_tokens=False).input_ids, "chunk")
        return [
            [
                prefix,
                chunk,
                Segment(tokenizer(t.after + tail + t.answer_prefix, add_special_tokens=False).input_ids, "query"),
            ]
            for t in texts
        ]

    def _followups(self, task: str, draw: Draw, questions: list[Question], model: Any) -> list[list[int] | None]:
        """Each question as a new user turn (the question sentence, the template's turn frame and the
        answer prefix); without a chat template, its plain-text form."""
        texts = [render(task, draw, q) for q in questions]
        if not self.params.chat_template:
            return [model.tokenizer(t.after + t.answer_prefix, add_special_tokens=False).input_ids for t in texts]
        before, after = followup_frame(model.chat)
        return [
            model.tokenizer(before + t.after.lstrip("\n") + after + t.answer_prefix, add_special_tokens=False).input_ids
            for t in texts
        ]

    def _chat_frame(self, model: Any) -> tuple[str, str]:
        """The chat template's text before and after the user message ("", "" for RULER's base template)."""
        if not self.params.chat_template:
            return "", ""
        head, tail = model.chat.render(PLACEHOLDER).split(PLACEHOLDER)
        return head, tail

    def _vt_example_units(self, model: Any) -> int:
        """Noise lines of the variable-tracking example: as many as fit ``VT_EXAMPLE_TOKENS`` tokens of its
        task text (RULER's ``max_seq_length=500`` example, no model template, nothing to generate)."""
        if id(model.tokenizer) in self._vt_units:
            return self._vt_units[id(model.tokenizer)]
        _, args = TASKS["vt"]
        probe = sample_seed(self.params.seed, "vt-example", 0, 0)

        def measure(units: int) -> int:
            draw = variable_tracking(
                Random(probe), units, num_chains=args["num_chains"], num_hops=min(10, args["num_hops"]), name_length=3
            )
            text = render("vt", draw, ruler_question(draw))
            return len(model.tokenizer(text.user + text.answer_prefix, add_special_tokens=False).input_ids)

        low = min(10, args["num_hops"]) + 1
        units = self._vt_units[id(model.tokenizer)] = largest_fitting(measure, VT_EXAMPLE_TOKENS, low) or low
        return units

    def _essay(self) -> tuple[str, ...]:
        haystack = self.params.haystack
        folder = Path(haystack).expanduser()
        if not folder.is_dir():
            from kvbench.assets import fetch_asset

            folder = fetch_asset(haystack)
        return _essay_words(folder)

    def _qa_set(self, task: str) -> QASet:
        path = self.qa_paths[task]
        assert path is not None  # skipped tasks never reach here
        return _read_qa(path, TASKS[task][1]["dataset"])

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        return score(str(sample.subset), prediction, sample.reference)

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean per task × length cell; per task and per length the mean of its cells; ``score`` the mean
        of all cells (RULER's average over tasks, then over lengths)."""
        cells: dict[tuple[str, int], list[float]] = {}
        for record in records:
            meta = record.get("meta", {})
            cells.setdefault((str(meta["task"]), int(meta["length"])), []).append(float(record["score"]))
        mean = {key: float(np.mean(v)) for key, v in cells.items()}
        tasks = [t for t in TASKS if any(t == k[0] for k in mean)]
        lengths = sorted({k[1] for k in mean})
        by_task = {t: float(np.mean([v for k, v in mean.items() if k[0] == t])) for t in tasks}
        by_length = {f"len{n}": float(np.mean([v for k, v in mean.items() if k[1] == n])) for n in lengths}
        metrics = {
            "score": round(float(np.mean(list(mean.values()))), 2) if mean else None,
            "n": len(records),
            "per_subset": {key: round(v, 2) for key, v in {**by_task, **by_length}.items()},
            "task_length": {t: {str(n): round(mean[t, n], 2) for n in lengths if (t, n) in mean} for t in tasks},
            **multi_query_metrics(records),
        }
        if "score_first" in metrics:  # first vs later questions per task
            metrics["task_query"] = {
                t: multi_query_metrics([r for r in records if r["meta"]["task"] == t]).get("score_by_query")
                for t in tasks
            }
        return metrics

    @classmethod
    def comparison_figure(cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path) -> Path:
        """Score against length, one line per run (RULER's average over tasks at each length); for
        multi-query runs, each run's score by question index."""
        from kvbench.plots import ruler_by_length, score_by_query

        if any(record.get("queries") for _, records in runs for record in records):
            return score_by_query(runs, path)
        return ruler_by_length(runs, path)


@lru_cache(maxsize=2)
def _essay_words(folder: Path) -> tuple[str, ...]:
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ConfigError(f"task.haystack={folder} holds no .txt files", "point it at a folder of essays")
    return essay_words("".join(p.read_text(encoding="utf-8", errors="replace") for p in files))


@lru_cache(maxsize=2)
def _read_qa(path: Path, dataset: str) -> QASet:
    try:
        return read_squad(path) if dataset == "squad" else read_hotpotqa(path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{path} is not {dataset} in RULER's format ({type(exc).__name__}: {exc})",
            "use SQuAD v2.0 dev (squad.json) / HotpotQA dev distractor (hotpotqa.json)",
        ) from None
