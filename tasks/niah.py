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
when "dolores park" appears. The heatmap (length × depth, greener = better) is ``heatmap.png``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from kvbench.errors import ConfigError
from kvbench.tasks import register
from kvbench.tasks.base import Sample, Task

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
INSTRUCTION = "Don't give information outside the document or repeat your findings"
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
SCORERS = ("rouge1_recall", "rouge1_f", "substring")
PLACEHOLDER = "\u0000KVBENCH_HAYSTACK\u0000"


@register
class NeedleInAHaystack(Task):
    name = "niah"
    defaults = {
        "lengths": [1024, 2048, 4096],
        "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
        "question_position": "end",
        "needle": NEEDLE,
        "question": QUESTION,
        "answer": ANSWER,
        "instruction": INSTRUCTION,
        "system_prompt": SYSTEM,
        "max_new_tokens": 48,
        "scorer": "rouge1_recall",
        "haystack": "paul_graham_essays",
    }

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        lengths = [int(x) for x in self.cfg["lengths"]]
        depths = [float(x) for x in self.cfg["depths"]]
        if not lengths or min(lengths) < 64:
            raise ConfigError(f"task.lengths={lengths} must be token counts of at least 64", "e.g. task.lengths=[1024,2048]")
        if not depths or min(depths) < 0 or max(depths) > 1:
            raise ConfigError(f"task.depths={depths} must lie in [0, 1]", "e.g. task.depths=[0,0.5,1]")
        if self.cfg["question_position"] not in ("end", "start"):
            raise ConfigError(
                f"task.question_position={self.cfg['question_position']!r} is not end or start", "use end or start"
            )
        if self.cfg["scorer"] not in SCORERS:
            raise ConfigError(f"unknown task.scorer {self.cfg['scorer']!r}", f"use one of {', '.join(SCORERS)}")
        self.lengths = lengths
        self.depths = depths

    # ------------------------------------------------------------------ samples
    @staticmethod
    def sample_id(length: int, depth: float) -> str:
        return f"len{length}_depth{depth:g}"

    def _grid(self) -> list[tuple[int, float]]:
        return [(length, depth) for length in self.lengths for depth in self.depths]

    def sample_ids(self) -> list[str]:
        return [self.sample_id(length, depth) for length, depth in self.limited_grid()]

    def protocol(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "question_position": self.cfg["question_position"],
            "chat_template": True,
            "system_prompt": self.cfg["system_prompt"],
            "max_new_tokens": self.cfg["max_new_tokens"],
            "scorer": self.cfg["scorer"],
            "length_unit": "tokens of the whole prompt (template included)",
        }

    def _user_message(self, context: str) -> str:
        ask = f"{self.cfg['question']} {self.cfg['instruction']}".strip()
        if self.cfg["question_position"] == "start":
            return f"{ask}\n\n{context}"
        return f"{context}\n\n{ask}"

    def samples(self, model: Any) -> Iterable[Sample]:
        tokenizer = model.tokenizer
        chat = model.chat
        system = self.cfg["system_prompt"]
        chat = type(chat)(chat.tokenizer, system_prompt=system, template=chat.template) if system else chat
        before, after = chat.render(self._user_message(PLACEHOLDER)).split(PLACEHOLDER)
        head = tokenizer(before, add_special_tokens=False).input_ids
        tail = tokenizer(after, add_special_tokens=False).input_ids
        needle = tokenizer(self.cfg["needle"], add_special_tokens=False).input_ids
        haystack = self._haystack_ids(tokenizer, max(self.lengths))
        periods = _sentence_end_ids(tokenizer, tuple(sorted(set(haystack))))
        for length, depth in self.limited_grid():
            room = length - len(head) - len(tail) - len(needle)
            if room < 1:
                raise ConfigError(
                    f"task.lengths contains {length}, too short for the prompt's {length - room} fixed tokens",
                    "use lengths of a few hundred tokens or more",
                )
            context = _insert(haystack[:room], needle, depth, periods)
            yield Sample(
                id=self.sample_id(length, depth),
                reference=self.cfg["answer"],
                input_ids=head + context + tail,
                max_new_tokens=int(self.cfg["max_new_tokens"]),
                subset=f"len{length}",
                meta={"length": length, "depth": depth, "prompt_tokens": len(head) + len(context) + len(tail)},
            )

    def limited_grid(self) -> list[tuple[int, float]]:
        grid = self._grid()
        limit = self.cfg.get("limit")
        return grid[: int(limit)] if limit is not None else grid

    def _haystack_ids(self, tokenizer: Any, length: int) -> list[int]:
        text = _essays_text(self._haystack_dir())
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if not ids:
            raise ConfigError(f"the haystack in {self._haystack_dir()} is empty", "point task.data_dir at .txt files")
        repeats = -(-length // len(ids))
        return (ids * repeats)[:length]

    def _haystack_dir(self) -> Path:
        if self.cfg.get("data_dir"):
            path = Path(str(self.cfg["data_dir"])).expanduser()
            if not path.is_dir() or not list(path.glob("*.txt")):
                raise ConfigError(f"task.data_dir={path} holds no .txt files", "point it at a folder of essays")
            return path
        from kvbench.assets import fetch_asset

        return fetch_asset(str(self.cfg["haystack"]))

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        scorer = self.cfg["scorer"]
        if scorer == "substring":
            return 100.0 if "dolores park" in prediction.lower() else 0.0
        target = str(sample.reference) if scorer == "rouge1_recall" else self.cfg["needle"].strip()
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
        """The runs' heatmaps side by side (PQCache Fig. 9)."""
        from kvbench.plots import niah_panels

        return niah_panels(runs, path)


def _insert(context: list[int], needle: list[int], depth: float, periods: frozenset[int]) -> list[int]:
    """Put ``needle`` at ``depth`` of ``context``, backing up to the previous sentence end."""
    if depth >= 1.0:
        return context + needle
    point = int(len(context) * depth)
    while point > 0 and context[point - 1] not in periods:
        point -= 1
    return context[:point] + needle + context[point:]


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
