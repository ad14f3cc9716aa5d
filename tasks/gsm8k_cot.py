"""``gsm8k_cot``: GSM8k with chain-of-thought few-shot prompts (PQCache Fig. 10a).

Protocols (``task.protocol``):

* ``pqcache`` (default) — PQCache's setup: its 10-exemplar "complex" chain-of-thought prompt (8
  exemplars with 9 reasoning steps, 2 with 8; the chain-of-thought-hub "hardest" prompt plus two),
  read from ``gsm8k_prompt_formal.txt`` in ``task.data_dir``; input = prompt + ``"\\nQuestion: "`` +
  question + ``"\\n"``; no chat template; greedy, 256 new tokens; the generation is cut at the first
  ``"\\nQuestion: "``.
* ``wei8`` — the 8-shot chain-of-thought prompt of Wei et al. (2022), ``Q: ... A: ... The answer is N.``,
  cut at the next ``"Q:"``.

Extraction (``task.extraction``; ``null``, the default, takes the protocol's own): ``last_number`` —
PQCache's evaluation (``GSM8k/evaluation_gsm8k.py`` ``evaluate_pred_answer``: commas removed, the last
match of ``\\d*\\.?\\d+`` in the output cut at "\\nQuestion: "), the ``pqcache`` protocol's rule;
``answer_is`` — the number after the last "The answer is", falling back to the last number of the
output, the ``wei8`` protocol's (its exemplars end "The answer is N."). Correct iff the floats are
equal; the gold answer is the number after ``####``. Score = 100 × correct (accuracy).

``task.question_position=start`` (kvbench's variant; no paper runs it) puts the test question before
the exemplars and ends the prompt by asking for "the first question".
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param
from kvbench.tasks import register
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.params import QuestionPosition, data_dir_param, limit_param
from kvbench.tasks.sources import data_folder, find_file, hub_rows, read_jsonl


@dataclass(frozen=True)
class Gsm8kCotParams(Params):
    """GSM8k chain-of-thought (PQCache Fig. 10a)."""

    protocol: Literal["pqcache", "wei8"] = param(
        "pqcache", "pqcache (10-shot complex CoT, PQCache's prompt file) | wei8 (Wei et al. 8-shot)"
    )
    data_dir: str | None = data_dir_param(
        "folder with test.jsonl (+ gsm8k_prompt_formal.txt for pqcache); null: the hub's openai/gsm8k"
    )
    split: str = param("test", "the dataset split")
    max_new_tokens: int = param(256, "tokens generated per answer", min=1)
    use_template: bool = param(False, "apply the chat template (PQCache prompts the model raw)")
    extraction: Literal["answer_is", "last_number"] | None = param(
        None, "null: the protocol's (pqcache: last_number, PQCache's evaluation; wei8: answer_is)"
    )
    question_position: QuestionPosition = param(
        "end", "end | start (kvbench's variant: the question before the exemplars)"
    )
    limit: int | None = limit_param("questions")


# Wei et al. (2022), "Chain-of-thought prompting elicits reasoning in large language models", the
# eight GSM8k exemplars.
WEI8 = (
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are done, "
        "there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must have "
        "been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating 35, "
        "they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops did "
        "Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny 20 - 12 = 8. "
        "The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he have "
        "now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. 5 + 4 = 9. "
        "The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each day, from monday to "
        "thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 computers "
        "were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many golf "
        "balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 more, "
        "he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 dollars "
        "left. 23 - 15 is 8. The answer is 8.",
    ),
)
PROMPT_FILES = ["gsm8k_prompt_formal.txt", "pqcache_gsm8k_prompt_formal.txt"]
TEST_FILES = ["test.jsonl", "gsm8k_test.jsonl"]
HUB = "openai/gsm8k"  # the data set on the Hugging Face hub (when task.data_dir is unset)
WHERE = "openai/grade-school-math grade_school_math/data/test.jsonl; PQCache's GSM8k/gsm8k_prompt_formal.txt"
NUMBER = re.compile(r"\d*\.?\d+")
ANSWER_IS = re.compile(r"The answer is\s*\$?\s*(-?[\d,]*\.?\d+)")


def gold_number(answer: str) -> float:
    return float(answer.split("####")[-1].strip().replace(",", ""))


def extract(text: str, rule: str) -> float | None:
    """The predicted number under ``rule`` (``answer_is`` or ``last_number``), or None."""
    if rule == "answer_is":
        found = ANSWER_IS.findall(text)
        if found:
            try:
                return float(found[-1].replace(",", ""))
            except ValueError:
                pass
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


@register
class GSM8kCoT(Task):
    name = "gsm8k_cot"
    Params = Gsm8kCotParams
    params: Gsm8kCotParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self._exemplars: str | None = None

    @property
    def extraction(self) -> str:
        """The answer-extraction rule: ``task.extraction``, else the protocol's (PQCache's: the last number)."""
        return self.params.extraction or ("last_number" if self.params.protocol == "pqcache" else "answer_is")

    # ------------------------------------------------------------------ data
    def data_files(self) -> list[Path]:
        folder = data_folder(self.params.data_dir)
        files = [find_file(folder, TEST_FILES, "the GSM8k test set", WHERE)] if folder is not None else []
        return files + ([self._prompt_file()] if self.params.protocol != "wei8" else [])

    def row_fields(self, path: Path) -> tuple[str, ...]:
        return ("question", "answer")

    def hub_source(self) -> tuple[str, str] | None:
        return (HUB, WHERE) if data_folder(self.params.data_dir) is None else None

    def _prompt_file(self) -> Path:
        """PQCache's few-shot prompt file (``protocol=pqcache``), from ``task.data_dir``."""
        folder = data_folder(self.params.data_dir)
        if folder is None:
            raise ConfigError("protocol=pqcache needs PQCache's prompt file", f"pass task.data_dir=<folder> ({WHERE})")
        return find_file(folder, PROMPT_FILES, "PQCache's GSM8k prompt", WHERE)

    def _rows(self) -> Iterable[dict[str, Any]]:
        folder = data_folder(self.params.data_dir)
        if folder is not None:
            return read_jsonl(find_file(folder, TEST_FILES, "the GSM8k test set", WHERE))
        return hub_rows(HUB, "main", self.params.split, WHERE)

    def exemplars(self) -> str:
        if self._exemplars is None:
            if self.params.protocol == "wei8":
                self._exemplars = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in WEI8)
            else:
                self._exemplars = self._prompt_file().read_text(encoding="utf-8")
        return self._exemplars

    def build_prompt(self, question: str) -> str:
        shots = self.exemplars()
        start = self.params.question_position == "start"
        if self.params.protocol == "wei8":
            if start:
                return f"Q: {question}\n\n{shots}Answer the first question.\nA:"
            return f"{shots}Q: {question}\nA:"
        if start:
            return f"Question: {question}\n\n{shots}\nAnswer the first question.\nLet's think step by step\n"
        return f"{shots}\nQuestion: {question}\n"

    def samples(self, model: Any) -> Iterable[Sample]:
        stop = ("\nQuestion: ",) if self.params.protocol == "pqcache" else ("\nQ:", "\n\nQ:")
        for index, row in enumerate(self.limited(self._rows())):
            yield Sample(
                id=f"{self.params.split}-{index}",
                reference=gold_number(row["answer"]),
                prompt=self.build_prompt(row["question"]),
                use_template=self.params.use_template,
                max_new_tokens=self.params.max_new_tokens,
                stop_texts=stop,
                meta={"question": row["question"]},
            )

    def sample_ids(self) -> list[str] | None:
        return [f"{self.params.split}-{i}" for i in range(self.limit)] if self.limit is not None else None

    def protocol(self) -> dict[str, Any]:
        shots = self.exemplars()
        return {
            "task": self.name,
            "protocol": self.params.protocol,
            "exemplars_sha256": hashlib.sha256(shots.encode()).hexdigest()[:16],
            "chat_template": self.params.use_template,
            "max_new_tokens": self.params.max_new_tokens,
            "extraction": self.extraction,
            "question_position": self.params.question_position,
        }

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        predicted = extract(prediction, self.extraction)
        return 100.0 if predicted is not None and predicted == float(sample.reference) else 0.0
