"""``rag``: CacheBlend's RAG evaluation — passages as reusable chunks, a fixed prefix, the query last.

Every sample is one prompt described as ordered segments (:mod:`kvbench.requests`): one ``prefix``
(the chat template's head and the dataset's instruction), one ``chunk`` per passage (the unit whose
KV a reuse method precomputes alone), and the ``query`` (question and the template's tail, always
recomputed). Dense methods run the concatenated ids; the segments tell reuse methods where the
chunks are.

**Datasets** (``task.dataset``, files read from ``task.data_dir``):

=============  ===============================================  ========  ===========  ============
dataset        file                                             samples   new tokens   score
=============  ===============================================  ========  ===========  ============
musique        ``musique_s.json`` (CacheBlend's own input)      150       32           F1 (ids)
wikimqa        ``wikimqa_s_clean.json`` (corrected subset)      102       32           F1 (ids)
multi_news     LongBench ``multi_news.jsonl``                   200       128          Rouge-L
example        ``example_inputs/{1..10}.json`` (``blend.py``)   10        32           none
=============  ===============================================  ========  ===========  ============

**Prompt, as CacheBlend's ``example/blend_{musique,wikimqa}.py`` and ``utils.py`` build it:**

* the question is normalised (``normalize_question``): "?" appended when missing, first character
  lower-cased;
* each passage is one chunk, ``f"{title}\\n\\n{text}\\n\\n"`` (titles are empty in both files);
* the query is ``query_prompt + question + "\\nAnswer:"``;
* prefix and query prompts are the scripts' strings per dataset (:data:`DATASETS`);
* every piece is tokenised on its own without special tokens (the code's ``encode(x)[1:]``).

The code hard-codes Mistral's ``[INST]`` / ``[/INST]`` ids around this; kvbench uses the evaluated
model's chat template instead: the template is rendered with a placeholder as the user message, the
text before it (with the BOS and any default system prompt the template writes) starts the prefix
segment and the text after it ends the query segment. For Mistral that is ``<s>[INST]`` … ``[/INST]``,
the code's layout. Tokenizers that put a word-boundary marker before every separately tokenised piece
(SentencePiece's "▁": Llama-2, Mistral) would turn the template's space at each junction into an
extra token, so that space is dropped there (the piece's own marker restores it). Checked with
Mistral-7B's SentencePiece model (``tokenizer.model.v1``, legacy Metaspace) and the v0.2 template: the
prefix is ``[1, 733, 16289, 28793] + encode(prefix_prompt)[1:]`` and the query ends
``[733, 28748, 16289, 28793]``, the ids of the code (with the BOS vLLM adds). A model without a chat
template gets its tokenizer's BOS (if any) as the head and nothing as the tail.

**multi_news** (CacheBlend's paper uses MultiNews; its exact file and chunking are not published):
the LongBench record's ``context`` is split at its ``Passage N:\\n`` headers, one chunk per article
(header included; the chunks join back to the context exactly); the prefix and query prompts are
LongBench's ``multi_news`` prompt (``dataset2prompt.json``) split around ``{context}``, so the dense
prompt is LongBench's. Rouge-L F (stemmed) of the whole generation against the reference summary;
no first-line cut (CacheBlend's SAMSum script cuts to one line because SAMSum summaries are one line).

**example** (``blend.py``'s ten inputs): passages ``ex["0"]``… as given, the prebuilt ``ex["query"]``,
no prefix prompt (``blend.py`` wraps the passages in ``[INST]`` only). There is no gold answer: each
sample's score is ``null`` (the run reports generations and timings; its ``score`` is null too).

**Scores** (0–100): CacheBlend's F1 over the model tokenizer's ids (:mod:`kvbench.tasks.rag_metrics`:
first line, Yes/No collapse, SQuAD normalisation, max over gold answers) for QA; Rouge-L F for
summaries. 2WikiMQA answers are ``[[answer], ...]``; like the script, the first entry of each is scored.

**Chunking and retrieval** (CacheBlend Fig. 12: top-6 chunks of 512 tokens; Fig. 2: 128-token chunks):
``task.chunk_tokens`` re-cuts the passages' concatenated ids into fixed-size chunks;
``task.top_k`` keeps the k chunks nearest the question (``task.retriever``: ``minilm`` = L2 distance of
all-MiniLM-L6-v2 embeddings, ``bm25``), in their original order (:mod:`kvbench.tasks.rag_retrieval`).

**Pipelines** (``task.pipeline``): ``stuff`` (default) is the single prompt above; ``mapreduce`` and
``maprerank`` read the chunks one at a time, as LangChain's chains do (CacheBlend Fig. 13;
:mod:`kvbench.tasks.rag_pipelines`).

**Length.** A prompt longer than ``task.max_length`` (null: the model's context minus the generation)
loses chunks from the middle, one at a time, as CacheBlend's SAMSum script drops few-shot examples; a
single remaining chunk that is still too long is cut at its end. Both are recorded per sample.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from kvbench.errors import ConfigError
from kvbench.figures.rag import FIGURE_KINDS
from kvbench.figures.rag_system import SYSTEM_FIGURE_KINDS
from kvbench.params import Params, param
from kvbench.requests import Segment
from kvbench.tasks import register
from kvbench.tasks.base import Sample, SampleResult, Task
from kvbench.tasks.longbench_protocol import DATASETS as LONGBENCH
from kvbench.tasks.params import data_dir_param, limit_param
from kvbench.tasks.rag_metrics import best_f1, best_rouge_l, tokenizer_encode
from kvbench.tasks.rag_retrieval import rechunk, retriever, top_k
from kvbench.tasks.sources import check_jsonl, json_kind, missing_folder, read_json, read_json_rows

if TYPE_CHECKING:  # (rag_stream's stream is a rag task: it imports this module)
    from kvbench.tasks.rag_stream import RagStreamParams


@dataclass(frozen=True)
class RagParams(Params):
    """CacheBlend's RAG evaluation: passages as reusable chunks, prefix / chunks / query segments."""

    dataset: str = param("musique", "musique | wikimqa | multi_news | example")
    data_dir: str | None = data_dir_param(
        "../shared/data/cacheblend (musique, wikimqa, example) or ../shared/data/longbench/full (multi_news)"
    )
    chunk_tokens: int | None = param(
        None, "null: one chunk per passage; else re-cut into fixed-size token chunks (Fig. 12: 512, Fig. 2: 128)", min=1
    )
    top_k: int | None = param(
        None, "null: all chunks; else the k nearest the question, in retrieved_order (Fig. 12: 6)", min=1
    )
    retriever: Literal["minilm", "bm25"] = param(
        "minilm", "minilm (all-MiniLM-L6-v2, L2 distance) | bm25 (rank-bm25 Okapi)"
    )
    retrieved_order: Literal["original", "nearest_first", "nearest_last"] = param(
        "original",
        "top_k's chunks in their passages' order (CacheBlend's) | nearest the question first | nearest last "
        "(the most relevant chunk next to the question: how chunk order moves a reused cache's quality)",
        legacy="original",
    )
    max_length: int | None = param(
        None, "prompt limit in tokens; null: the model's context minus the generation", min=1
    )
    limit: int | None = limit_param("samples")
    pipeline: Literal["stuff", "mapreduce", "maprerank"] = param(
        "stuff", "stuff (one prompt) | mapreduce | maprerank (LangChain's chains, CacheBlend Fig. 13)"
    )
    map_tokens: int | None = param(
        None, "new tokens per map step (null: 64 for mapreduce summaries, 32 for maprerank answers)", min=1
    )
    rerank_score: Literal["free", "cued"] = param(
        "free",
        'maprerank: free (the model writes the score line itself, LangChain\'s) | cued ("Score:" fed after its answer)',
        legacy="free",
    )


PLACEHOLDER = "\u0000KVBENCH_RAG_USER\u0000"
FIGURES_PAPER = "cacheblend"  # the paper whose figures comparison_figure draws (and whose legend it uses)
ANSWER_CUE = "\nAnswer:"
PASSAGE_HEADER = re.compile(r"(?:^|(?<=\n))Passage \d+:\n")
EXAMPLE_QUESTION = re.compile(r"Question:\s*(.*?)\nAnswer:\s*$", re.S)
WHERE = {
    "cacheblend": "../shared/data/cacheblend (CacheBlend's inputs/ folder: musique_s.json, wikimqa_s_clean.json, "
    "example_inputs/)",
    "longbench": "../shared/data/longbench/full (LongBench v1 data.zip: multi_news.jsonl)",
}


@dataclass(frozen=True)
class RagDataset:
    """One data set's files and CacheBlend prompts."""

    name: str
    file: str  # relative to task.data_dir
    source: str  # key of WHERE
    prefix_prompt: str
    query_prompt: str
    max_new_tokens: int
    metric: str | None  # "f1" | "rouge_l" | None (no gold answers)


_MULTI_NEWS_BEFORE, _MULTI_NEWS_AFTER = LONGBENCH["multi_news"].prompt.split("{context}")

DATASETS: dict[str, RagDataset] = {
    d.name: d
    for d in (
        RagDataset(
            "musique",
            "musique_s.json",
            "cacheblend",
            prefix_prompt="You will be asked a question after reading several passages. Please directly answer the "
            "question based on the given passages. Do NOT repeat the question. The answer should be within 5 "
            "words..\nPassages:\n",
            query_prompt="\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
            "The answer should be within 5 words. \nQuestion:",
            max_new_tokens=32,
            metric="f1",
        ),
        RagDataset(
            "wikimqa",
            "wikimqa_s_clean.json",
            "cacheblend",
            prefix_prompt="Answer the question based on the given passages. Only give me the answer and do not output "
            "any other words.\n\nThe following are given passages.\n",
            query_prompt="\n\nAnswer the question based on the given passages. Answer the question within 5 words. Do "
            "NOT repeat the question or output any other words. Question: ",
            max_new_tokens=32,
            metric="f1",
        ),
        RagDataset(
            "multi_news",
            "multi_news.jsonl",
            "longbench",
            _MULTI_NEWS_BEFORE,
            _MULTI_NEWS_AFTER,
            max_new_tokens=128,
            metric="rouge_l",
        ),
        RagDataset("example", "example_inputs", "cacheblend", "", "", max_new_tokens=32, metric=None),
    )
}


CACHEBLEND_SHAPE = 'a JSON list of {"question": ..., "answers": [...], "ctxs": [{"title": ..., "text": ...}, ...]}'
EXAMPLE_SHAPE = 'a JSON object {"query": ..., "chunk_num": N, "0": <chunk>, ..., "<N-1>": <chunk>}'


def _check_cacheblend(path: Path, limit: int | None) -> None:
    """CacheBlend's musique/wikimqa file: the rows :meth:`Rag._records` reads, up to ``limit``."""
    rows = read_json_rows(path, CACHEBLEND_SHAPE)
    if not rows:
        raise ConfigError(f"{path} holds an empty list (expected {CACHEBLEND_SHAPE})", "download the file again")
    for line, row in rows[:limit]:
        problem = _cacheblend_row_problem(row)
        if problem:
            raise ConfigError(
                f"{path}:{line}: {problem} (expected {CACHEBLEND_SHAPE})", "repair that row or download the file again"
            )


def _cacheblend_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON {json_kind(row)}, not an object"
    missing = [key for key in ("question", "answers", "ctxs") if key not in row]
    if missing:
        return f"the row has no {', '.join(repr(k) for k in missing)}"
    if not isinstance(row["question"], str) or not row["question"]:
        return "its question is not a non-empty string"
    if not isinstance(row["answers"], list):
        return "its answers are not a list"
    if not isinstance(row["ctxs"], list) or not row["ctxs"]:
        return "its ctxs are not a non-empty list"
    for index, ctx in enumerate(row["ctxs"]):
        if not isinstance(ctx, dict) or not all(isinstance(ctx.get(k), str) for k in ("title", "text")):
            return f"ctxs[{index}] is not an object with a title and a text"
    return None


def _check_example(path: Path) -> None:
    """One of CacheBlend's ``example_inputs/<n>.json``."""
    row = read_json(path, EXAMPLE_SHAPE)
    fix = "repair the file or download it again"
    if not isinstance(row, dict):
        raise ConfigError(f"{path}:1: a JSON {json_kind(row)}, not an object (expected {EXAMPLE_SHAPE})", fix)
    count = row.get("chunk_num")
    if not isinstance(row.get("query"), str) or isinstance(count, bool) or not isinstance(count, (int, str)):
        raise ConfigError(f"{path}: no query text or chunk_num (expected {EXAMPLE_SHAPE})", fix)
    try:
        chunks = int(count)
    except ValueError:
        raise ConfigError(f"{path}: chunk_num={count!r} is not a number (expected {EXAMPLE_SHAPE})", fix) from None
    missing = [str(i) for i in range(chunks) if not isinstance(row.get(str(i)), str)]
    if missing or chunks < 1:
        what = f"chunk {missing[0]!r} is missing" if missing else f"chunk_num={chunks}"
        raise ConfigError(f"{path}: {what} (expected {EXAMPLE_SHAPE})", fix)


@dataclass
class RawSample:
    """A record before tokenisation: passages, the query text and the question used for retrieval."""

    id: str
    passages: list[str]
    query: str
    question: str | None
    answers: list[str] | None


def normalize_question(question: str) -> str:
    """CacheBlend's ``normalize_question``: end with "?", lower-case the first character."""
    if not question.endswith("?"):
        question += "?"
    return question[0].lower() + question[1:]


def split_articles(context: str) -> list[str]:
    """A LongBench multi_news context cut before each ``Passage N:`` header (joins back exactly)."""
    starts = [m.start() for m in PASSAGE_HEADER.finditer(context)]
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = [*starts, len(context)]
    return [context[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


@register
class Rag(Task):
    name = "rag"
    chunked = True
    figure_kinds: ClassVar[tuple[str, ...]] = FIGURE_KINDS + SYSTEM_FIGURE_KINDS
    Params: ClassVar[type[Params]] = RagParams
    #: rag's parameters, or rag_stream's (:class:`~kvbench.tasks.rag_stream.RagStream`; they leave out
    #: ``rerank_score``)
    params: RagParams | RagStreamParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)  # (types, choices and ranges, the pipeline's options among them: RagParams)
        name = self.params.dataset
        if name not in DATASETS:
            raise ConfigError(f"unknown task.dataset {name!r} for task rag", f"use one of {', '.join(DATASETS)}")
        self.dataset = DATASETS[name]
        if self.question_position not in (None, "end"):  # (a common key that rag's parameters leave out)
            raise ConfigError("task rag always asks the question after the passages", "drop task.question_position")
        if self.params.top_k is not None and name == "multi_news":
            raise ConfigError(
                "task.top_k needs a question to retrieve by, and multi_news has none",
                "drop task.top_k for multi_news (task.chunk_tokens still re-chunks)",
            )
        from kvbench.tasks.rag_pipelines import check

        check(self.params.pipeline, name)
        self.path = self._data_path()
        self._encode: Any = None  # the model tokenizer's F1 tokenisation, set by samples()

    @property
    def rerank_score(self) -> str:
        """``task.rerank_score``: who writes maprerank's score line (``free``: the model; ``cued``: prompted).
        rag_stream has no such key (its stream serves single prompts): ``free``. The key joined after runs
        existed: at its default it stays out of the run id (``legacy`` in :class:`RagParams`)."""
        return self.params.rerank_score if isinstance(self.params, RagParams) else "free"

    def _retrieved_order(self) -> str:
        """``task.retrieved_order`` (a stream, whose parameters lack it, keeps the passages' order)."""
        return self.params.retrieved_order if isinstance(self.params, RagParams) else "original"

    # ------------------------------------------------------------------ data
    def _data_path(self) -> Path:
        """The dataset's file (or folder, for ``example``); checked before any model loads."""
        where = WHERE[self.dataset.source]
        value = self.params.data_dir
        if not value:
            raise ConfigError(
                f"task rag needs task.data_dir for dataset {self.dataset.name}", f"pass task.data_dir={where}"
            )
        folder = Path(str(value)).expanduser()
        if not folder.is_dir():
            raise missing_folder(folder, where)
        path = folder / self.dataset.file
        if not path.exists() and self.dataset.name == "multi_news":
            path = next(iter(sorted(folder.rglob(self.dataset.file))), path)
        if not path.exists() and self.dataset.name == "example" and self._example_files(folder):
            path = folder  # data_dir may also be the example_inputs folder itself
        if not path.exists():
            raise ConfigError(f"{self.dataset.file} not found in {folder}", f"pass task.data_dir={where}")
        if self.dataset.name == "example" and not self._example_files(path):
            raise ConfigError(f"{path} holds no <n>.json inputs", f"pass task.data_dir={where}")
        return path

    def data_files(self) -> list[Path]:
        return self._example_files(self.path) if self.dataset.name == "example" else [self.path]

    def check_data(self, path: Path) -> None:
        """The dataset's file has the shape :meth:`_records` reads: CacheBlend's JSON list of objects with
        ``question``, ``answers`` and ``ctxs`` (each ``title`` and ``text``); LongBench's JSONL rows with
        ``context`` and ``answers``; an example input, one object with ``query``, ``chunk_num`` and the
        chunks ``"0"``..``"<chunk_num - 1>"``. A file that is not is one error naming file and line."""
        name = self.dataset.name
        if name == "multi_news":
            check_jsonl(path, limit=self.limit, fields=lambda row: ("context", "answers"))
        elif name == "example":
            _check_example(path)
        else:
            _check_cacheblend(path, self.limit)

    @staticmethod
    def _example_files(folder: Path) -> list[Path]:
        return sorted((p for p in folder.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem))

    def _records(self) -> Iterator[RawSample]:
        """Every record of the data set, in file order, as :class:`RawSample` (no tokenizer needed)."""
        name, data = self.dataset.name, self.dataset
        if name in ("musique", "wikimqa"):
            for index, row in enumerate(json.loads(self.path.read_text(encoding="utf-8"))):
                question = normalize_question(row["question"])
                answers = [a[0] if isinstance(a, list) else a for a in row["answers"]]
                yield RawSample(
                    id=f"{name}-{index}",
                    passages=[f"{ctx['title']}\n\n{ctx['text']}\n\n" for ctx in row["ctxs"]],
                    query=f"{data.query_prompt}{question}{ANSWER_CUE}",
                    question=question,
                    answers=answers,
                )
        elif name == "multi_news":
            with open(self.path, encoding="utf-8") as handle:
                for index, line in enumerate(row for row in handle if row.strip()):
                    row = json.loads(line)
                    yield RawSample(
                        id=f"{name}-{row.get('_id', index)}",
                        passages=split_articles(row["context"]),
                        query=data.query_prompt,
                        question=None,
                        answers=list(row["answers"]),
                    )
        else:
            for file in self._example_files(self.path):
                row = json.loads(file.read_text(encoding="utf-8"))
                match = EXAMPLE_QUESTION.search(row["query"])
                yield RawSample(
                    id=f"example-{file.stem}",
                    passages=[row[str(i)] for i in range(int(row["chunk_num"]))],
                    query=row["query"],
                    question=match.group(1).strip() if match else row["query"],
                    answers=None,
                )

    def sample_ids(self) -> list[str]:
        return [raw.id for raw in self.limited(self._records())]

    # ------------------------------------------------------------------ prompts
    def protocol(self) -> dict[str, Any]:
        data = self.dataset
        return {
            "task": self.name,
            "dataset": data.name,
            "source": "CacheBlend example/blend_*.py + utils.py @ 55ad026"
            if data.source == "cacheblend"
            else "LongBench v1 multi_news, CacheBlend-style chunks",
            "prefix_prompt": data.prefix_prompt,
            "query_prompt": data.query_prompt,
            "question": "CacheBlend normalize_question ('?' appended, first char lower-cased)"
            if data.name in ("musique", "wikimqa")
            else None,
            "passage": "title + '\\n\\n' + text + '\\n\\n'"
            if data.name in ("musique", "wikimqa")
            else "LongBench 'Passage N:' article"
            if data.name == "multi_news"
            else "as given",
            "segments": "prefix = template head + prefix prompt; one chunk per passage; query = query + template "
            "tail; pieces tokenised separately without special tokens",
            "chat_template": "the model's (placeholder split); tokenizer BOS only when it has none",
            "max_new_tokens": data.max_new_tokens,
            "stop": "the model's stop ids",
            "scorer": {
                "f1": "CacheBlend F1 over model-tokenizer ids (first line, Yes/No collapse, SQuAD "
                "normalisation, max over answers)",
                "rouge_l": "Rouge-L F, rouge-score with stemming, max over references",
                None: "none (no gold answers): score null",
            }[data.metric],
            "chunk_tokens": self.params.chunk_tokens,
            "top_k": self.params.top_k,
            "retriever": self.params.retriever if self.params.top_k is not None else None,
            "retrieved_order": self._retrieved_order() if self.params.top_k is not None else None,
            "max_length": self.params.max_length,
            "overflow": "drop middle chunks, then cut the last one's end",
            **_pipeline_protocol(self),
        }

    def samples(self, model: Any) -> Iterable[Sample]:
        tokenizer = model.tokenizer
        self._encode = tokenizer_encode(tokenizer)
        encode = _piece_encoder(tokenizer)
        head, tail = template_frame(tokenizer, model.chat)
        data = self.dataset
        prefix = head + encode(data.prefix_prompt)
        limit = int(self.params.max_length or model.spec.max_length - data.max_new_tokens)
        for raw in self.limited(self._records()):
            query = encode(raw.query) + tail
            chunks = [encode(text) for text in raw.passages]
            texts = list(raw.passages)
            if self.params.chunk_tokens is not None:
                chunks = rechunk(chunks, self.params.chunk_tokens)
                texts = [tokenizer.decode(ids) for ids in chunks]
            meta: dict[str, Any] = {"dataset": data.name, "passages": len(raw.passages)}
            if self.params.pipeline != "stuff":
                meta["question"] = raw.question  # the map steps ask it of every chunk
            k = self.params.top_k
            if k is not None and k < len(chunks):
                distances = retriever(self.params.retriever).distances(str(raw.question), texts)
                keep = top_k(distances, k)
                if self._retrieved_order() != "original":  # (ties to the earlier passage, as top_k)
                    keep = sorted(keep, key=lambda i: (float(distances[i]), i))
                    keep = keep[::-1] if self._retrieved_order() == "nearest_last" else keep
                chunks = [chunks[i] for i in keep]
                meta["retrieved"] = keep
            room = limit - len(prefix) - len(query)
            if room < 1:
                raise ConfigError(
                    f"sample {raw.id}: prefix and query alone take {len(prefix) + len(query)} of {limit} tokens",
                    "raise task.max_length or use a model with a longer context",
                )
            chunks, dropped, cut = fit_chunks(chunks, room)
            segments = [
                Segment(tuple(prefix), "prefix"),
                *(Segment(tuple(c), "chunk") for c in chunks),
                Segment(tuple(query), "query"),
            ]
            meta.update(
                chunks=len(chunks),
                chunk_lengths=[len(c) for c in chunks],
                prefix_tokens=len(prefix),
                query_tokens=len(query),
                prompt_tokens=sum(len(s) for s in segments),
                dropped_chunks=dropped,
                truncated=cut,
            )
            yield Sample(
                id=raw.id,
                reference={"answers": raw.answers} if raw.answers is not None else None,
                segments=segments,
                max_new_tokens=data.max_new_tokens,
                subset=data.name,
                meta=meta,
            )

    # ------------------------------------------------------------------ scoring
    def score(self, sample: Sample, prediction: str) -> float | None:
        """0–100, or None for the ``example`` inputs (no gold answers)."""
        if self.dataset.metric is None or sample.reference is None:
            return None
        answers = sample.reference["answers"]
        if self.dataset.metric == "rouge_l":
            return 100.0 * best_rouge_l(prediction, answers)
        if self._encode is None:
            raise RuntimeError("Rag.score needs the model tokenizer: call samples(model) first")
        return 100.0 * best_f1(prediction, answers, self._encode)

    def requests(self, sample: Sample, model: Any) -> list[Any]:
        if self.params.pipeline != "stuff":
            from kvbench.tasks.rag_pipelines import requests

            return requests(self, sample, model)
        return super().requests(sample, model)

    def result(self, sample: Sample, outputs: list[Any]) -> SampleResult:
        if self.params.pipeline != "stuff":
            from kvbench.tasks.rag_pipelines import result

            return result(self, sample, outputs)
        out = outputs[0]
        score = self.score(sample, out.text)
        return SampleResult(
            id=sample.id,
            prediction=out.text,
            reference=sample.reference,
            score=None if score is None else float(score),
            subset=sample.subset,
            meta={**sample.meta, "stop_reason": out.stop_reason},
            telemetry=out.telemetry,
            budget=out.budget,
        )

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        metrics = super().aggregate(records)
        if self.params.pipeline != "stuff":
            from kvbench.tasks.rag_pipelines import aggregate

            metrics.update(aggregate(self.params.pipeline, records))
        return metrics

    @classmethod
    def comparison_figure(
        cls, runs: list[tuple[str, list[dict[str, Any]]]], path: Path, kind: str | None = None
    ) -> Path:
        """CacheBlend's figures of the runs (``kind``: one of :data:`FIGURE_KINDS` or
        :data:`SYSTEM_FIGURE_KINDS`, default quality vs TTFT; see :mod:`kvbench.figures.rag`), with the
        methods named and drawn as the paper's legend says (``legend`` in results/papers/cacheblend.yaml)."""
        from kvbench.figures.legend import paper_legend
        from kvbench.figures.rag import BUILDERS, draw
        from kvbench.figures.rag_system import BUILDERS as SYSTEM_BUILDERS

        build = {**BUILDERS, **SYSTEM_BUILDERS}[kind or FIGURE_KINDS[0]]
        return draw(build, runs, path, paper_legend(FIGURES_PAPER))


def _pipeline_protocol(task: Rag) -> dict[str, Any]:
    from kvbench.tasks.rag_pipelines import protocol

    return protocol(task)


def fit_chunks(chunks: list[list[int]], room: int) -> tuple[list[list[int]], int, bool]:
    """Drop middle chunks until the rest fit in ``room`` tokens; cut a lone oversized chunk's end.

    Returns the chunks, how many were dropped, and whether the last one was cut.
    """
    chunks = list(chunks)
    dropped = 0
    while len(chunks) > 1 and sum(len(c) for c in chunks) > room:
        del chunks[len(chunks) // 2]
        dropped += 1
    cut = bool(chunks) and len(chunks[0]) > room
    if cut:
        chunks[0] = chunks[0][:room]
    return chunks, dropped, cut


def template_frame(tokenizer: Any, chat: Any) -> tuple[list[int], list[int]]:
    """Token ids of the chat template before and after the user message (``chat``: a ChatFormat)."""
    if not chat.available:
        return _bos_ids(tokenizer), []
    before, after = chat.render(PLACEHOLDER).split(PLACEHOLDER)
    if _marks_piece_starts(tokenizer):
        before = before[:-1] if before.endswith(" ") else before
        after = after[1:] if after.startswith(" ") else after
    encode = _piece_encoder(tokenizer)
    return encode(before), encode(after)


def _piece_encoder(tokenizer: Any) -> Any:
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids if text else []


def _marks_piece_starts(tokenizer: Any) -> bool:
    """True for tokenizers that put a word-boundary space before every separately tokenised piece
    (SentencePiece "▁" with a prepended dummy prefix): two pieces "a" decode to "a a"."""
    ids = tokenizer("a", add_special_tokens=False).input_ids
    return tokenizer.decode(ids + ids).strip() == "a a"


def _bos_ids(tokenizer: Any) -> list[int]:
    """The BOS the tokenizer itself prepends to text (for models without a chat template)."""
    bos = tokenizer.bos_token_id
    with_special = tokenizer("a", add_special_tokens=True).input_ids
    return [bos] if bos is not None and with_special[:1] == [bos] else []
