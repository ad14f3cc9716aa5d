"""``infinitebench``: InfiniteBench's 12 tasks, with synthetic generators for the retrieval ones.

Protocol (``task.protocol``, see ``infinitebench_protocol.PROTOCOLS``): ``open`` — the open-model
completion templates, no chat template, the official generation lengths; ``chat`` — the GPT-4
instruction templates inside the model's chat template. Both middle-truncate every prompt to
``task.max_length`` tokens (128K by default, or the model's context minus the generation length when
that is smaller) as ``eval_yarn_mistral.py`` does: ``ids[:L // 2] + ids[-L // 2:]``.

``infllm`` — what InfLLM's ``benchmark/pred.py`` does (PQCache's InfiniteBench pipeline is its InfLLM
fork), per model (``infinitebench_protocol.INFLLM_CONV``): InfLLM's prompts, the chat template with the
user message only, tokenised with special tokens except for Mistral (whose template writes ``<s>``),
InfLLM's generation lengths, and InfLLM's **suffix truncation after the template**: a prompt longer
than ``max_len - max_new_tokens`` keeps its first 128 tokens and its last
``max_len - max_new_tokens - 128``, decoded and re-tokenised as the script does. ``max_len`` is
``task.max_length`` when set, else InfLLM's config: 32000 for Mistral; **none** for Llama-3 (its config
does not truncate: a prompt longer than the model's context fails with a message naming
``task.max_length``); other models (InfLLM has no config for them) the model's context.

Scoring uses the official scorers, with ``task.scorer_version`` picking the En.Dia / En.MC revision
(``kvbench.tasks.metrics_infinitebench``).

Data: ``task.data_dir`` with the official ``<task>.jsonl`` files (book tasks read their text from
``context``; ``task.file`` names another file, e.g. ``passkey_8192.first5.jsonl``), or the hub's
``xinrongzhang2022/InfiniteBench``. The synthetic tasks — passkey,
number_string, kv_retrieval, math_find — can instead be *generated* at any length
(``task.generate=true``, or automatically without ``data_dir``), following InfiniteBench's construction:

* passkey / number_string: ``N`` copies of the noise line "The grass is green. ... There and back
  again.\\n" with the needle line inserted after ``round(depth · N)`` of them; a 5-digit pass key, or a
  10-digit sequence (5 digits with 5 duplicated); ``N`` is sized so the templated prompt has
  ``task.lengths`` tokens of the model (``length_unit: tokens``), or InfiniteBench's own count
  ``N = round(L · 1305 / 32768)`` (``length_unit: infinitebench``: L = 8192 gives the 326 lines of the
  released 8k files, which the tests check);
* kv_retrieval: a JSON object of random UUID key/value pairs, the asked key at ``depth``;
* math_find: a list of random integers, asking for the largest, smallest or median one.

``task.question_position=start`` moves ``{input}``/``{question}`` before the context for the tasks that
have one.
"""

from __future__ import annotations

import hashlib
import random
import re
import statistics
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param
from kvbench.tasks import register
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.infinitebench_protocol import (
    CHAT_TEMPLATES,
    INFLLM_CONV,
    INFLLM_INIT_TOKENS,
    INFLLM_TEMPLATES,
    MAX_NEW_TOKENS,
    OPEN_TEMPLATES,
    PROTOCOLS,
    SYNTHETIC,
    TASKS,
    infllm_conv,
)
from kvbench.tasks.params import QuestionPosition, data_dir_param, limit_param
from kvbench.tasks.sources import data_folder, hub_rows, read_jsonl


@dataclass(frozen=True)
class InfiniteBenchParams(Params):
    """InfiniteBench (12 tasks), with generators for passkey / number_string / kv_retrieval / math_find."""

    subsets: tuple[str, ...] | str = param(("passkey",), "task names, or [all]")
    protocol: Literal["open", "chat", "infllm"] = param(
        "open", "open (completion templates) | chat (GPT-4 templates + chat template) | infllm (InfLLM's pred.py)"
    )
    max_length: int | None = param(
        None,
        "open/chat: middle truncation (tokens), null: 128K; infllm: InfLLM's max_len (prompt + generation, "
        "suffix truncation), null: Mistral 32000, Llama-3 none, others their context",
        min=1,
    )
    max_new_tokens: int | None = param(None, "null: the protocol's per-task lengths", min=1)
    scorer_version: Literal["2024-06", "2024-08"] = param(
        "2024-08", "En.Dia / En.MC scorer revision: 2024-06 (before the #18 fix) | 2024-08"
    )
    generate: bool | None = param(None, "synthetic samples instead of files; null: when no data_dir is given")
    lengths: tuple[int, ...] = param((4096,), "generated prompt lengths", min=1)
    depths: tuple[float, ...] = param((0.0, 0.25, 0.5, 0.75, 1.0), "generated needle depths", min=0, max=1)
    length_unit: Literal["tokens", "infinitebench"] = param(
        "tokens", "tokens (of the model) | infinitebench (the original noise-line counts)"
    )
    seed: int = param(0, "generator seed")
    file: str | None = param(None, "a file in data_dir other than <task>.jsonl (one task at a time)")
    data_dir: str | None = data_dir_param("folder with the official <task>.jsonl files; null: the hub")
    question_position: QuestionPosition = param("end", "end | start")
    limit: int | None = limit_param("samples per task")


NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLES = {
    "passkey": ("The pass key is {key}. Remember it. {key} is the pass key.\n", "What is the pass key?"),
    "number_string": (
        "The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n",
        "What is the sequence of digits?",
    ),
}
FIND_TARGETS = ("largest", "smallest", "median")
HUB = "xinrongzhang2022/InfiniteBench"  # the data set on the Hugging Face hub (when task.data_dir is unset)
WHERE = "xinrongzhang2022/InfiniteBench on the hub (one <task>.jsonl per task)"
OPTIONS = "ABCD"


def truncate_middle(ids: list[int], max_length: int) -> list[int]:
    """InfiniteBench's ``truncate_input(..., manner="middle")`` on token ids."""
    if len(ids) <= max_length:
        return ids
    return ids[: max_length // 2] + ids[-max_length // 2 :]


def truncate_suffix(tokenizer: Any, ids: list[int], limit: int, special_tokens: bool) -> list[int]:
    """InfLLM's ``truncation: suffix`` (``benchmark/pred.py``): over ``limit`` tokens, keep the first 128 and
    the last ``limit - 128``, decode them (special tokens kept as text) and tokenise the text again."""
    if len(ids) <= limit:
        return ids
    text = tokenizer.decode(ids[:INFLLM_INIT_TOKENS] + ids[-(limit - INFLLM_INIT_TOKENS) :])
    return tokenizer(text, add_special_tokens=special_tokens).input_ids


def labels_for(task: str, row: dict[str, Any]) -> list[str]:
    """Reference labels as the official ``get_answer``: multiple choice adds the option letter."""
    answer = row["answer"]
    answers = [answer] if isinstance(answer, str) else list(answer)
    if task in ("longbook_choice_eng", "code_debug") and row.get("options"):
        letters = [OPTIONS[row["options"].index(a)] for a in answers if a in row["options"]]
        return [answers[0], *letters] if letters else answers
    return [str(a) for a in answers]


def sample_seed(seed: int, task: str, length: int, depth: float) -> int:
    """A stable per-sample seed (Python's ``hash`` of strings changes between processes)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{task}/{length}/{depth:g}".encode()).digest()[:4], "little")


class Generator:
    """Seeded synthetic samples in InfiniteBench's released format (``context``/``input``/``answer``)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def key(self, task: str) -> str:
        digits = [str(self.rng.randint(0, 9)) for _ in range(5)]
        if task == "number_string":
            for k in range(5):
                pos = self.rng.randint(0, 5 + k - 1)
                digits.insert(pos, digits[pos])
        return "".join(digits)

    def retrieval(self, task: str, units: int, depth: float, key: str | None = None) -> dict[str, Any]:
        key = key or self.key(task)
        needle, question = NEEDLES[task]
        before = round(depth * units)
        context = NOISE * before + needle.format(key=key) + NOISE * (units - before)
        return {"context": context, "input": question, "answer": [key], "len": 26 * (units - before)}

    def kv_retrieval(self, units: int, depth: float) -> dict[str, Any]:
        pairs = [
            (
                str(uuid.UUID(int=self.rng.getrandbits(128), version=4)),
                str(uuid.UUID(int=self.rng.getrandbits(128), version=4)),
            )
            for _ in range(max(units, 1))
        ]
        target = round(depth * (len(pairs) - 1))
        body = ", ".join(f'"{k}": "{v}"' for k, v in pairs)
        return {
            "context": "JSON data:\n{" + body + "}",
            "input": f'Key: "{pairs[target][0]}"\nThe value associated with the specified key is: ',
            "answer": [pairs[target][1]],
        }

    def math_find(self, units: int, depth: float) -> dict[str, Any]:
        numbers = [self.rng.randint(0, 999) for _ in range(max(units, 1) | 1)]  # odd: a unique median
        target = FIND_TARGETS[int(depth * len(FIND_TARGETS)) % len(FIND_TARGETS)]
        pick: dict[str, Callable[[list[int]], float]] = {"largest": max, "smallest": min, "median": statistics.median}
        value = pick[target](numbers)
        return {
            "context": "[" + ", ".join(map(str, numbers)) + "]",
            "input": f"You should answer with only one number, no other words. The {target} number of the list is: ",
            "answer": [str(int(value))],
        }

    def make(self, task: str, units: int, depth: float) -> dict[str, Any]:
        if task in NEEDLES:
            return self.retrieval(task, units, depth)
        return self.kv_retrieval(units, depth) if task == "kv_retrieval" else self.math_find(units, depth)


@register
class InfiniteBench(Task):
    name = "infinitebench"
    average = "subsets"
    Params = InfiniteBenchParams
    params: InfiniteBenchParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        subsets = self.params.subsets
        self.names = [subsets] if isinstance(subsets, str) else list(subsets)
        if "all" in self.names:
            self.names = list(TASKS)
        unknown = [n for n in self.names if n not in TASKS]
        if unknown:
            raise ConfigError(f"unknown InfiniteBench task(s) {', '.join(unknown)}", f"use {', '.join(TASKS)}")
        #: the protocol's templates, chat use, truncation and generation lengths
        self.protocol_spec = PROTOCOLS[self.params.protocol]
        generate = self.params.generate
        self.generating = generate if generate is not None else not self.params.data_dir
        if self.generating:
            real = [n for n in self.names if n not in SYNTHETIC]
            if real:
                raise ConfigError(
                    f"{', '.join(real)} cannot be generated",
                    f"pass task.data_dir=<folder> ({WHERE}) or task.generate=false",
                )

    # ------------------------------------------------------------------ protocol
    def template(self, task: str) -> str:
        table = {"open": OPEN_TEMPLATES, "chat": CHAT_TEMPLATES, "infllm": INFLLM_TEMPLATES}[
            self.protocol_spec["templates"]
        ]
        text = table[task]
        if self.params.question_position == "start":
            for slot in ("{input}", "{question}"):
                at = text.find(slot)
                if at > text.find("{context}"):
                    text = slot + "\n\n" + text[:at].rstrip("\n") + text[at + len(slot) :]
                    break
        return text

    def max_new_tokens(self, task: str) -> int:
        if self.params.max_new_tokens:
            return self.params.max_new_tokens
        return MAX_NEW_TOKENS[self.protocol_spec["max_new_tokens"]][task]

    @property
    def infllm(self) -> bool:
        return self.params.protocol == "infllm"

    def max_length(self) -> int:
        return int(self.params.max_length or self.protocol_spec["max_length"])

    def length_limit(self, model: Any, task: str) -> int | None:
        """Truncation limit of one task's prompts (``None``: not truncated). ``open`` / ``chat``:
        ``task.max_length`` when set, else 128K or, for a shorter model, its context minus the task's
        generation length. ``infllm``: ``max_len - max_new_tokens`` with InfLLM's ``max_len``."""
        if self.infllm:
            conv = INFLLM_CONV[infllm_conv(model.spec.name)]
            if self.params.max_length:
                max_len = self.params.max_length
            elif conv["truncation"] is None:
                return None
            else:
                max_len = conv["max_len"] or model.spec.max_length
            return max_len - self.max_new_tokens(task)
        if self.params.max_length:
            return self.params.max_length
        return min(self.max_length(), model.spec.max_length - self.max_new_tokens(task))

    def truncate(self, model: Any, task: str, ids: list[int]) -> list[int]:
        limit = self.length_limit(model, task)
        if limit is None:
            return ids
        if self.infllm:
            special = INFLLM_CONV[infllm_conv(model.spec.name)]["special_tokens"]
            return truncate_suffix(model.tokenizer, ids, limit, special)
        return truncate_middle(ids, limit)

    def protocol(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "protocol": self.params.protocol,
            "templates": self.protocol_spec["templates"],
            "chat_template": self.protocol_spec["chat"],
            "truncation": (
                "InfLLM's suffix rule after the template (first 128 tokens + the tail) to "
                + (
                    f"{self.params.max_length} tokens"
                    if self.params.max_length
                    else "InfLLM's max_len (Mistral 32000, Llama-3 none, other models their context)"
                )
                + " minus the generation"
                if self.infllm
                else f"middle to {self.max_length()} tokens"
                + ("" if self.params.max_length else " or the model's context minus the generation, if smaller")
            ),
            "max_new_tokens": {n: self.max_new_tokens(n) for n in self.names},
            "scorer_version": self.params.scorer_version,
            "question_position": self.params.question_position,
            "generated": bool(self.generating),
            "length_unit": self.params.length_unit if self.generating else None,
        }

    # ------------------------------------------------------------------ data
    def _local_file(self, folder: Path, task: str) -> Path:
        path = folder / (self.params.file or f"{task}.jsonl")
        if not path.exists():
            raise ConfigError(f"{task}.jsonl not found in {folder}", f"get it from {WHERE}")
        return path

    def data_files(self) -> list[Path]:
        folder = data_folder(self.params.data_dir)
        if folder is None or self.generating:
            return []
        return [self._local_file(folder, task) for task in self.names]

    def row_fields(self, path: Path) -> tuple[str, ...]:
        return ("answer",)

    def hub_source(self) -> tuple[str, str] | None:
        return (HUB, WHERE) if data_folder(self.params.data_dir) is None and not self.generating else None

    def _rows(self, task: str) -> Iterable[dict[str, Any]]:
        folder = data_folder(self.params.data_dir)
        if folder is not None:
            return read_jsonl(self._local_file(folder, task))
        return hub_rows(HUB, None, task, WHERE)

    def format_prompt(self, task: str, row: dict[str, Any]) -> str:
        fields: dict[str, Any] = {
            "context": row.get("context", ""),
            "input": row.get("input", ""),
            "question": row.get("input", ""),
        }
        options = row.get("options") or []
        for letter, option in zip(OPTIONS, options):
            fields[f"OPTION_{letter}"] = option
        if task == "math_find":
            # InfLLM's pred.py: greedy "The .+ of" minus " of" (the same words on the released questions)
            found = re.findall(r"The .+ of" if self.infllm else r"The \w+ number", row["input"])
            if not found:
                raise ConfigError(
                    f"math_find sample without 'The ... number' in its question: {row['input'][:80]!r}",
                    "check the data file",
                )
            target = found[0].lower()[:-3] if self.infllm else found[0].lower()
            fields["prefix"] = f"What is {target} in the following list?"
        if task == "kv_retrieval":
            quoted = re.findall(r'"[^"]*"', row.get("input", ""))
            fields["key"] = quoted[0] if quoted else ""  # InfLLM's input[6:44]: the quoted key
        if task == "code_run":
            fields["func_call"] = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])[0]
            fields["func"] = fields["func_call"].split("(")[0]
        return self.template(task).format(**fields)

    def _units(self, task: str, length: int, model: Any) -> int:
        """How many noise lines / records / numbers make a prompt of ``length``."""
        if self.params.length_unit == "infinitebench":
            per_unit = {
                "passkey": 32768 / 1305,
                "number_string": 32768 / 1305,
                "kv_retrieval": 131072 / 1855,
                "math_find": 131072 / 45000,
            }[task]
            return round(length / per_unit)
        probe = Generator(0)
        sizes = []
        for units in (10, 60):
            ids = self._encode(model, task, probe.make(task, units, 0.5))
            sizes.append(len(ids))
        per_unit = (sizes[1] - sizes[0]) / 50
        fixed = sizes[0] - 10 * per_unit
        units = int((length - fixed) / per_unit)
        generator = Generator(1)
        while units > 1 and len(self._encode(model, task, generator.make(task, units, 0.5))) > length:
            units -= 1
        return max(units, 1)

    def _encode(self, model: Any, task: str, row: dict[str, Any]) -> list[int]:
        prompt = self.format_prompt(task, row)
        if self.infllm and model.chat.available:  # InfLLM's build_chat: the user message only
            text = model.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                tokenize=False,
                add_generation_prompt=True,
                chat_template=model.chat.template,
            )
            special = INFLLM_CONV[infllm_conv(model.spec.name)]["special_tokens"]
            return model.tokenizer(text, add_special_tokens=special).input_ids
        return model.chat.encode(prompt, use_template=self.protocol_spec["chat"] and model.chat.available)

    def sample_ids(self) -> list[str] | None:
        if not self.generating:
            return None
        ids = [
            f"{task}-len{int(length)}_depth{float(depth):g}"
            for task in self.names
            for length in self.params.lengths
            for depth in self.params.depths
        ]
        if self.limit is None:
            return ids
        per_task = len(ids) // len(self.names)
        return [i for n, i in enumerate(ids) if n % per_task < self.limit]

    def samples(self, model: Any) -> Iterable[Sample]:
        for task in self.names:
            if self.generating:
                rows = self._generated(task, model)
            else:
                rows = ((str(row.get("id", i)), row, {}) for i, row in enumerate(self.limited(self._rows(task))))
            for row_id, row, meta in rows:
                encoded = self._encode(model, task, row)
                ids = self.truncate(model, task, encoded)
                if len(ids) < len(encoded):
                    meta = {**meta, "truncated_from": len(encoded)}
                yield Sample(
                    id=f"{task}-{row_id}",
                    reference=labels_for(task, row),
                    input_ids=ids,
                    max_new_tokens=self.max_new_tokens(task),
                    subset=task,
                    meta={"task": task, "prompt_tokens": len(ids), **meta},
                )

    def _generated(self, task: str, model: Any) -> Iterable[tuple[str, dict[str, Any], dict[str, Any]]]:
        count = 0
        for length in self.params.lengths:
            units = self._units(task, length, model)
            for depth in self.params.depths:
                if self.limit is not None and count >= self.limit:
                    return
                row = Generator(sample_seed(self.params.seed, task, length, depth)).make(task, units, depth)
                count += 1
                yield f"len{length}_depth{depth:g}", row, {"length": length, "depth": depth, "units": units}

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.tasks.metrics_infinitebench import score_sample

        assert sample.subset is not None  # (every sample names its InfiniteBench task)
        return 100.0 * score_sample(
            sample.subset, prediction, sample.reference, scorer_version=self.params.scorer_version
        )

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = super().aggregate(records)  # average: subsets (the papers' "Average" over datasets)
        grid: dict[str, dict[str, float]] = {}
        for record in records:
            meta = record.get("meta", {})
            if "length" in meta:
                grid.setdefault(str(meta["length"]), {})[f"{meta['depth']:g}"] = round(record["score"], 2)
        if grid and len(self.names) == 1:
            metrics["grid"] = grid
        return metrics
