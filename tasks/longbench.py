"""``longbench``: LongBench v1 (and LongBench-E) under the official protocol, with named variants.

The official protocol (THUDM/LongBench ``pred.py`` / ``eval.py``), step by step:

1. ``prompt = dataset2prompt[dataset].format(**sample)``;
2. **middle truncation** of the raw prompt to ``max_length`` tokens: tokenize (special tokens
   included), and if too long keep ``decode(ids[:half]) + decode(ids[-half:])`` with
   ``half = int(max_length / 2)`` — before any chat template;
3. the model's **chat template**, except for trec, triviaqa, samsum, lsht, lcc and repobench-p;
4. greedy decoding of ``dataset2maxlen`` tokens; samsum also stops at a newline and generates at least
   one token (``min_length = context + 1``); stop ids include every end-of-turn token of the model;
5. scoring with the official metric (``kvbench.tasks.metrics``): first line only for trec, triviaqa,
   samsum and lsht, max over the reference answers; the dataset score is ``round(100 · mean, 2)``, and
   the run's score is the unweighted mean over datasets (the papers' "Average").

``task.max_length`` is the truncation limit: an integer, or ``null`` for the protocol's value for
this model (``task.protocol``: ``official``, ``pqcache``, ``quest``, ``kvcache_factory`` — see
``LENGTH_LIMITS``) falling back to the model's context minus the longest generation.

``task.protocol=pqcache`` also formats chat prompts as PQCache's ``vq_pred.py`` does (step 3):
Llama-3 / 3.1 get the chat template with the system message "You are a helpful assistant."; Mistral
gets the raw string ``[INST]{prompt}[/INST]`` (no spaces, no template). In both cases the rendered text
is tokenised *with* the tokenizer's special tokens, as the script does — so a Llama-3.1 prompt starts
with two ``<|begin_of_text|>`` tokens (the template writes one, the tokenizer adds one), reproduced on
purpose. Models the script has no rule for keep their own template (``meta.prompt_format`` records
which format a sample got).
``task.question_position=start`` moves the question of the QA datasets before the context (PQCache
Table 3): the template's ``Question: {input}`` line goes to the front, everything else stays.
LongBench-E (``task.e=true``) reads the ``<name>_e`` files and also reports the 0-4k / 4-8k / 8k+
length buckets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from kvbench.errors import ConfigError
from kvbench.params import Params, param
from kvbench.tasks import register
from kvbench.tasks.base import Sample, Task
from kvbench.tasks.longbench_protocol import (
    DATASETS,
    GROUPS,
    LENGTH_LIMITS,
    NO_CHAT,
    PQCACHE_SYSTEM_PROMPT,
    QA,
    Dataset,
    pqcache_chat_style,
)
from kvbench.tasks.params import QuestionPosition, data_dir_param, limit_param
from kvbench.tasks.sources import data_folder, hub_rows, read_jsonl


@dataclass(frozen=True)
class LongBenchParams(Params):
    """LongBench v1 / LongBench-E under the official protocol."""

    subsets: tuple[str, ...] | str = param(
        ("multi_news",), "dataset names or groups: all, en, e, pqcache (Table 2), pqcache_qa (Table 3), clusterkv"
    )
    e: bool = param(False, "LongBench-E: <name>_e files and length buckets")
    protocol: Literal["official", "pqcache", "quest", "kvcache_factory"] = param(
        "official", "length-limit table: official | pqcache | quest | kvcache_factory"
    )
    max_length: int | None = param(
        None,
        "middle-truncation limit in tokens; null: the protocol's value, else model context - longest generation",
        min=1,
    )
    question_position: QuestionPosition = param(
        "end", "end | start (QA datasets: question before the context, PQCache Table 3)"
    )
    data_dir: str | None = data_dir_param(
        "folder with <dataset>.jsonl (LongBench data.zip); null: the hub's THUDM/LongBench"
    )
    config_dir: str | None = param(
        None, "folder with the official dataset2prompt.json / dataset2maxlen.json (null: built-in copies)"
    )
    limit: int | None = limit_param("samples per dataset")


HUB = "THUDM/LongBench"  # the data set on the Hugging Face hub (when task.data_dir is unset)
WHERE = "THUDM/LongBench on the hub (data.zip holds <dataset>.jsonl files)"
QUESTION = re.compile(r"(Question: \{input\}|问题：\{input\})\n*")


def move_question_first(template: str) -> str:
    """The template with its question line moved to the front (PQCache's question-first variant)."""
    match = QUESTION.search(template)
    if match is None or match.start() < template.index("{context}"):
        raise ConfigError("this dataset's prompt has no question after the context", "use question_position=end")
    rest = template[: match.start()] + template[match.end() :]
    return match.group(1) + "\n\n" + rest


def prompt_fields(template: str) -> tuple[str, ...]:
    """The row keys a prompt template formats in (``{context}``, ``{input}``), in order."""
    import string

    names = (field for _, field, _, _ in string.Formatter().parse(template) if field)
    return tuple(dict.fromkeys(name.split(".")[0].split("[")[0] for name in names))


def middle_truncate(tokenizer: Any, prompt: str, max_length: int) -> tuple[str, bool]:
    """LongBench's truncation: keep the first and last ``max_length // 2`` tokens of the raw prompt."""
    ids = tokenizer(prompt, add_special_tokens=True).input_ids
    if len(ids) <= max_length:
        return prompt, False
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    ), True


def pqcache_ids(model: Any, prompt: str) -> tuple[list[int], str] | None:
    """Token ids of a chat-style prompt as PQCache's ``vq_pred.py`` builds them, with the format's name;
    ``None`` for a model its ``build_chat`` has no rule for (or, for the template style, no template)."""
    style = pqcache_chat_style(model.spec.name)
    tokenizer = model.tokenizer
    if style == "system" and model.chat.available:
        messages = [{"role": "system", "content": PQCACHE_SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=model.chat.template
        )
    elif style == "inst":
        text = f"[INST]{prompt}[/INST]"
    else:
        return None
    return tokenizer(text, add_special_tokens=True).input_ids, f"pqcache_{style}"


@register
class LongBench(Task):
    name = "longbench"
    average = "subsets"
    Params = LongBenchParams
    params: LongBenchParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        given = self.params.subsets
        subsets = [given] if isinstance(given, str) else list(given)
        names: list[str] = []
        for item in subsets:
            names += GROUPS[item] if item in GROUPS else [item]
        unknown = [n for n in names if n not in DATASETS]
        if unknown:
            raise ConfigError(
                f"unknown LongBench subset(s) {', '.join(unknown)}",
                f"use dataset names ({', '.join(DATASETS)}) or groups ({', '.join(GROUPS)})",
            )
        if self.params.e:
            missing = [n for n in names if not DATASETS[n].in_e]
            if missing:
                raise ConfigError(f"LongBench-E has no {', '.join(missing)}", "use task.subsets=[e] or drop those")
        if self.params.question_position == "start":
            others = [n for n in names if n not in QA]
            if others:
                raise ConfigError(
                    f"question_position=start applies to QA datasets only, not {', '.join(others)}",
                    "use task.subsets=[pqcache_qa] (PQCache Table 3)",
                )
        self.names = list(dict.fromkeys(names))
        self.datasets = self._datasets()

    # ------------------------------------------------------------------ protocol
    def _datasets(self) -> dict[str, Dataset]:
        """The protocol constants, from the official JSON files when ``config_dir`` is given."""
        folder = self.params.config_dir
        if not folder:
            return {n: DATASETS[n] for n in self.names}
        prompts = json.loads((Path(folder) / "dataset2prompt.json").read_text(encoding="utf-8"))
        maxlen = json.loads((Path(folder) / "dataset2maxlen.json").read_text(encoding="utf-8"))
        return {n: DATASETS[n]._replace(prompt=prompts[n], max_new_tokens=int(maxlen[n])) for n in self.names}

    def limit_for(self, model: Any) -> tuple[int, str]:
        if self.params.max_length:
            return self.params.max_length, "task.max_length"
        table = LENGTH_LIMITS[self.params.protocol]
        if model.spec.name in table:
            return table[model.spec.name], f"{self.params.protocol} limit for {model.spec.name}"
        longest = max(d.max_new_tokens for d in self.datasets.values())
        return model.spec.max_length - longest, "model context minus the longest generation"

    def template(self, dataset: Dataset) -> str:
        return move_question_first(dataset.prompt) if self.params.question_position == "start" else dataset.prompt

    def protocol(self) -> dict[str, Any]:
        return {
            "task": self.name,
            "protocol": self.params.protocol,
            "truncation": "middle, before the chat template",
            "max_length": self.params.max_length,
            "chat_template": f"all but {', '.join(NO_CHAT)}"
            + (
                "; PQCache's vq_pred.py format where it has one (meta.prompt_format)"
                if self.params.protocol == "pqcache"
                else ""
            ),
            "question_position": self.params.question_position,
            "max_new_tokens": {n: d.max_new_tokens for n, d in self.datasets.items()},
            "longbench_e": self.params.e,
            "scorer": "LongBench v1 metrics.py semantics",
        }

    # ------------------------------------------------------------------ data
    def _file(self, name: str) -> str:
        return f"{name}_e" if self.params.e else name

    def _local_file(self, folder: Path, name: str) -> Path:
        file = self._file(name)
        path = folder / f"{file}.jsonl"
        if not path.exists():
            found = sorted(folder.rglob(f"{file}.jsonl"))
            if not found:
                raise ConfigError(f"{file}.jsonl not found in {folder}", f"get it from {WHERE}")
            path = found[0]
        return path

    def data_files(self) -> list[Path]:
        folder = data_folder(self.params.data_dir)
        return [self._local_file(folder, name) for name in self.names] if folder is not None else []

    def row_fields(self, path: Path) -> tuple[str, ...]:
        """A row's keys the prompt template names (``context``, ``input``) and ``answers``."""
        name = path.stem.removesuffix("_e") if self.params.e else path.stem
        dataset = self.datasets.get(name)
        return ("answers", *prompt_fields(self.template(dataset))) if dataset is not None else ("answers",)

    def hub_source(self) -> tuple[str, str] | None:
        return (HUB, WHERE) if data_folder(self.params.data_dir) is None else None

    def _rows(self, name: str) -> Iterable[dict[str, Any]]:
        folder = data_folder(self.params.data_dir)
        if folder is not None:
            return read_jsonl(self._local_file(folder, name))
        return hub_rows(HUB, self._file(name), "test", WHERE)

    def samples(self, model: Any) -> Iterable[Sample]:
        limit, source = self.limit_for(model)
        self._limit_source = (limit, source)
        for name, dataset in self.datasets.items():
            template = self.template(dataset)
            for index, row in enumerate(self.limited(self._rows(name))):
                missing = [key for key in ("answers", *prompt_fields(template)) if key not in row]
                if missing:  # (local files are checked before the model loads; a hub row is not)
                    raise ConfigError(
                        f"LongBench {name} row {index + 1} has no {', '.join(missing)}",
                        f"use complete data: {WHERE}",
                    )
                prompt = template.format(**row)
                prompt, truncated = middle_truncate(model.tokenizer, prompt, limit)
                use_chat = name not in NO_CHAT and model.chat.available
                built = (
                    pqcache_ids(model, prompt) if self.params.protocol == "pqcache" and name not in NO_CHAT else None
                )
                fmt = built[1] if built else ("model_template" if use_chat else "raw")
                yield Sample(
                    id=f"{name}-{row.get('_id', index)}",
                    reference={"answers": row["answers"], "all_classes": row.get("all_classes")},
                    prompt=prompt,
                    input_ids=built[0] if built else None,
                    use_template=use_chat,
                    max_new_tokens=dataset.max_new_tokens,
                    min_new_tokens=1 if name == "samsum" else 0,
                    stop_tokens=("\n",) if name == "samsum" else (),
                    subset=name,
                    meta={
                        "dataset": name,
                        "length": row.get("length"),
                        "truncated": truncated,
                        "max_length": limit,
                        "chat_template": use_chat or built is not None,
                        "prompt_format": fmt,
                    },
                )

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float:
        from kvbench.tasks.metrics import score_sample

        ref = sample.reference
        assert sample.subset is not None  # (every sample names its LongBench dataset)
        return 100.0 * score_sample(sample.subset, prediction, ref["answers"], ref.get("all_classes"))

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = super().aggregate(records)  # average: subsets (the papers' "Average" over datasets)
        if self.params.e:
            buckets: dict[str, dict[str, list[float]]] = {}
            for record in records:
                length = record["meta"].get("length") or 0
                bucket = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
                buckets.setdefault(str(record["subset"]), {}).setdefault(bucket, []).append(record["score"])
            metrics["length_buckets"] = {
                name: {b: round(float(np.mean(v)), 2) for b, v in sorted(groups.items())}
                for name, groups in buckets.items()
            }
        return metrics
