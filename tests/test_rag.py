"""The rag task: CacheBlend's prompts as prefix / chunk / query segments, data sets, errors, a full run."""

import json
import subprocess
import sys

import pytest

from kvbench.errors import ConfigError
from kvbench.metrics import bootstrap_ci
from kvbench.models.chat import ChatFormat
from kvbench.requests import GenerateRequest, Output, join_segments
from kvbench.tasks import create_task
from kvbench.tasks.longbench_protocol import DATASETS as LONGBENCH
from kvbench.tasks.rag import DATASETS, normalize_question, split_articles, template_frame

from .conftest import SHARED_DATA

CB = SHARED_DATA / "cacheblend"
LB = SHARED_DATA / "longbench"
needs_cb = pytest.mark.skipif(not CB.exists(), reason="needs ../shared/data/cacheblend")
needs_lb = pytest.mark.skipif(not LB.exists(), reason="needs ../shared/data/longbench")

PASSAGES = [
    "The harvest festival in the valley lasts three days and features apple pies.",
    "Ada Lovelace was born in London in 1815, the daughter of the poet Lord Byron.",
    "Volcanic rock cools into basalt columns along the northern coast.",
    "Charles Babbage designed the Analytical Engine, for which Lovelace wrote notes.",
    "The river delta floods every spring, renewing the soil of the rice fields.",
    "A chess opening that sacrifices a pawn for quick development is called a gambit.",
]


@pytest.fixture
def qa_dir(tmp_path):
    """A musique_s.json in CacheBlend's format: two questions over the four passages."""
    rows = [
        {
            "question": "Where was Ada Lovelace born",
            "answers": ["London"],
            "ctxs": [{"title": "", "text": p} for p in PASSAGES],
        },
        {
            "question": "What did Babbage design?",
            "answers": ["the Analytical Engine"],
            "ctxs": [{"title": "T", "text": p} for p in PASSAGES[:2]],
        },
    ]
    (tmp_path / "musique_s.json").write_text(json.dumps(rows))
    return tmp_path


def rag(**cfg):
    return create_task({"name": "rag", **cfg})


def test_question_normalisation_as_in_cacheblend():
    assert normalize_question("Where was he born") == "where was he born?"
    assert normalize_question("Who?") == "who?"


def test_segments_rebuild_the_templated_prompt(tiny_llama, qa_dir):
    task = rag(dataset="musique", data_dir=str(qa_dir))
    assert task.sample_ids() == ["musique-0", "musique-1"]
    sample, second = list(task.samples(tiny_llama))
    roles = [s.role for s in sample.segments]
    assert roles == ["prefix"] + ["chunk"] * 6 + ["query"]
    tok, data = tiny_llama.tokenizer, DATASETS["musique"]
    # byte tokenizer: the pieces decode to exactly the template around prefix prompt + passages + query
    passages = [f"\n\n{p}\n\n" for p in PASSAGES]
    query = data.query_prompt + "where was Ada Lovelace born?" + "\nAnswer:"
    assert tok.decode(join_segments(sample.segments)) == tiny_llama.chat.render(
        data.prefix_prompt + "".join(passages) + query
    )
    assert [tok.decode(s.ids) for s in sample.segments[1:-1]] == passages
    assert tok.decode(sample.segments[0].ids).endswith("<|im_start|>user\n" + data.prefix_prompt)
    assert tok.decode(sample.segments[-1].ids) == query + "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(second.segments[1].ids) == f"T\n\n{PASSAGES[0]}\n\n"  # title + blank line + text
    (request,) = task.requests(sample, tiny_llama)
    assert isinstance(request, GenerateRequest) and request.max_new_tokens == 32
    assert request.input_ids == join_segments(sample.segments) and request.segments == tuple(sample.segments)
    assert sample.meta["prompt_tokens"] == len(request.input_ids) and sample.meta["chunks"] == 6
    assert sample.reference == {"answers": ["London"]}


def test_f1_score_over_the_model_ids(tiny_llama, qa_dir):
    task = rag(dataset="musique", data_dir=str(qa_dir))
    sample = next(iter(task.samples(tiny_llama)))
    assert task.result(sample, [Output(text="London\nmore")]).score == pytest.approx(100.0)
    # byte ids of "lond" vs "london": 4 common bytes, P = 4/4, R = 4/6 -> 0.8
    assert task.result(sample, [Output(text="Lond")]).score == pytest.approx(80.0)


def test_rechunking_and_retrieval(tiny_llama, qa_dir):
    task = rag(dataset="musique", data_dir=str(qa_dir), chunk_tokens=64, limit=1)
    sample = next(iter(task.samples(tiny_llama)))
    chunks = [s.ids for s in sample.segments if s.role == "chunk"]
    everything = "".join(f"\n\n{p}\n\n" for p in PASSAGES).encode()
    assert all(len(c) == 64 for c in chunks[:-1]) and 0 < len(chunks[-1]) <= 64
    assert bytes(tiny_llama.tokenizer.decode([i for c in chunks for i in c]), "utf-8") == everything
    task = rag(dataset="musique", data_dir=str(qa_dir), top_k=2, retriever="bm25", limit=1)
    sample = next(iter(task.samples(tiny_llama)))
    kept = [tiny_llama.tokenizer.decode(s.ids).strip() for s in sample.segments if s.role == "chunk"]
    assert kept == [PASSAGES[1], PASSAGES[3]] and sample.meta["retrieved"] == [1, 3]  # original order
    ordered = {}
    for order in ("nearest_first", "nearest_last"):
        task = rag(dataset="musique", data_dir=str(qa_dir), top_k=2, retriever="bm25", limit=1, retrieved_order=order)
        ordered[order] = next(iter(task.samples(tiny_llama))).meta["retrieved"]
    assert sorted(ordered["nearest_first"]) == [1, 3] and ordered["nearest_last"] == ordered["nearest_first"][::-1]
    from kvbench.tasks.rag_retrieval import retriever

    distances = retriever("bm25").distances("where was Ada Lovelace born?", [f"\n\n{p}\n\n" for p in PASSAGES])
    assert distances[ordered["nearest_first"][0]] <= distances[ordered["nearest_first"][1]]


def test_a_long_prompt_loses_middle_chunks(tiny_llama, qa_dir):
    full = next(iter(rag(dataset="musique", data_dir=str(qa_dir)).samples(tiny_llama)))
    lengths = full.meta["chunk_lengths"]
    limit = full.meta["prompt_tokens"] - lengths[3] - 1  # dropping the middle chunk (index 3 of 6) is not enough
    sample = next(iter(rag(dataset="musique", data_dir=str(qa_dir), max_length=limit).samples(tiny_llama)))
    kept = [lengths[i] for i in (0, 1, 4, 5)]  # then index 2 of the remaining five goes
    assert sample.meta["dropped_chunks"] == 2 and sample.meta["chunk_lengths"] == kept
    assert sample.meta["prompt_tokens"] <= limit and not sample.meta["truncated"]


@pytest.mark.parametrize("scheme", ["always", "first"])
def test_sentencepiece_junctions_keep_no_lone_space_token(scheme):
    """Mistral-style tokenizers mark every piece's start with "▁": the template's "[INST] " space is
    dropped at the junction, so the prefix is <s> [INST] ▁You …, with no extra "▁" token."""
    from tokenizers import SentencePieceBPETokenizer, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = SentencePieceBPETokenizer()
    core.train_from_iterator(
        ["[INST] You will be asked [/INST] Answer: hello world"] * 3,
        vocab_size=120,
        min_frequency=1,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    core._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    core._tokenizer.decoder = decoders.Metaspace(prepend_scheme=scheme)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    chat = ChatFormat(
        tok, template="{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"
    )
    head, tail = template_frame(tok, chat)
    ids = head + tok("You will", add_special_tokens=False).input_ids + tail
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0] == "<s>" and "▁" not in pieces  # no token is a bare word-boundary marker
    assert tok.decode(ids, skip_special_tokens=True).strip() == "[INST] You will [/INST]"


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"dataset": "nq"}, "unknown task.dataset 'nq'"),
        ({"dataset": "musique"}, "needs task.data_dir"),
        ({"dataset": "musique", "data_dir": "/no/such/folder"}, "is not a folder"),
        ({"dataset": "wikimqa", "data_dir": "."}, "wikimqa_s_clean.json not found"),
        ({"dataset": "multi_news", "data_dir": ".", "top_k": 6}, "multi_news has none"),
        ({"dataset": "musique", "data_dir": ".", "chunk_tokens": 0}, "task.chunk_tokens=0"),
        ({"dataset": "musique", "data_dir": ".", "retriever": "tfidf"}, "task.retriever=tfidf is not one of"),
        ({"dataset": "musique", "data_dir": ".", "question_position": "start"}, "after the passages"),
    ],
)
def test_bad_config_is_refused_before_any_model(cfg, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        rag(**cfg)


# ---------------------------------------------------------------------- the staged data sets
@needs_cb
def test_musique_has_ten_passage_chunks(tiny_llama):
    task = rag(dataset="musique", data_dir=str(CB), limit=2, max_length=10**6)
    assert task.sample_ids() == ["musique-0", "musique-1"]
    assert len(rag(dataset="musique", data_dir=str(CB)).sample_ids()) == 150
    rows = json.loads((CB / "musique_s.json").read_text())
    for sample, row in zip(task.samples(tiny_llama), rows):
        assert [s.role for s in sample.segments] == ["prefix"] + ["chunk"] * 10 + ["query"]
        texts = [tiny_llama.tokenizer.decode(s.ids) for s in sample.segments]
        assert texts[1:-1] == [f"{c['title']}\n\n{c['text']}\n\n" for c in row["ctxs"]]
        assert normalize_question(row["question"]) + "\nAnswer:<|im_end|>" in texts[-1]
        (request,) = task.requests(sample, tiny_llama)
        assert request.input_ids == join_segments(sample.segments)
    default = next(iter(rag(dataset="musique", data_dir=str(CB), limit=1).samples(tiny_llama)))
    assert default.meta["prompt_tokens"] <= tiny_llama.spec.max_length - 32  # tiny_llama's bytes: chunks dropped
    assert default.meta["dropped_chunks"] == 10 - default.meta["chunks"] > 0


@needs_cb
def test_wikimqa_scores_the_first_alias_of_each_answer():
    task = rag(dataset="wikimqa", data_dir=str(CB))
    assert len(task.sample_ids()) == 102
    first = next(iter(task._records()))
    assert first.answers == ["Croatia"] and first.query.endswith(
        "Question: where was the wife of Francis I Rákóczi born?\nAnswer:"
    )


@needs_cb
def test_example_inputs_have_no_score(tiny_llama):
    task = rag(dataset="example", data_dir=str(CB / "example_inputs"))
    assert task.sample_ids() == [f"example-{i}" for i in range(1, 11)]
    sample = next(iter(task.samples(tiny_llama)))
    row = json.loads((CB / "example_inputs" / "1.json").read_text())
    texts = [tiny_llama.tokenizer.decode(s.ids) for s in sample.segments]
    assert texts[1:-1] == [row[str(i)] for i in range(6)] and texts[-1].startswith(row["query"])
    assert task.protocol()["prefix_prompt"] == ""
    result = task.result(sample, [Output(text="Harvard")])
    assert result.score is None and task.aggregate([result.to_record()] * 3)["score"] is None
    assert bootstrap_ci([None, None, None]) is None and bootstrap_ci([None, 1.0, 3.0]) is not None


@needs_lb
def test_multi_news_articles_are_chunks_of_longbench_prompt(tiny_llama):
    rows = [json.loads(line) for line in (LB / "full" / "multi_news.jsonl").open()][:2]
    for row in rows:
        articles = split_articles(row["context"])
        assert "".join(articles) == row["context"] and all(a.startswith("Passage ") for a in articles)
        assert len(articles) == row["context"].count("Passage ") or len(articles) > 1
    official = json.loads((LB / "config" / "dataset2prompt.json").read_text())["multi_news"]
    data = DATASETS["multi_news"]
    assert data.prefix_prompt + "{context}" + data.query_prompt == official == LONGBENCH["multi_news"].prompt
    task = rag(dataset="multi_news", data_dir=str(LB), limit=1, max_length=10**6)
    sample = next(iter(task.samples(tiny_llama)))
    text = tiny_llama.tokenizer.decode(join_segments(sample.segments))
    assert text == tiny_llama.chat.render(
        official.format(context=rows[0]["context"])
    )  # LongBench's prompt, untruncated
    assert sample.max_new_tokens == 128 and sample.meta["chunks"] == len(split_articles(rows[0]["context"]))
    ref = rows[0]["answers"][0]
    assert task.score(sample, ref) == pytest.approx(100.0) and 0 < task.score(sample, ref[: len(ref) // 2]) < 100


# ---------------------------------------------------------------------- end to end
@needs_cb
def test_kvbench_run_rag_musique(tmp_path):
    """`kvbench run method=full task=rag task.dataset=musique ... task.limit=2 model=tiny_llama`, with the
    prompt capped at 3,000 tokens (tiny_llama's tokens are bytes: one passage stays) to keep it fast."""
    args = [
        sys.executable,
        "-m",
        "kvbench",
        "run",
        "method=full",
        "task=rag",
        "task.dataset=musique",
        f"task.data_dir={CB}",
        "task.limit=2",
        "task.max_length=3000",
        "model=tiny_llama",
        f"output_dir={tmp_path}",
        "progress=false",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (run_dir,) = list(tmp_path.iterdir())
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert ids == ["musique-0", "musique-1"]
    for record in records:
        assert 0 <= record["score"] <= 100 and record["reference"]["answers"] and record["prediction"] is not None
        assert record["meta"]["chunks"] + record["meta"]["dropped_chunks"] == 10
        assert record["meta"]["prompt_tokens"] <= 3000 and record["protocol"]["dataset"] == "musique"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["n"] == 2 and metrics["per_subset"]["musique"] == metrics["score"]
    # the ids are known without a model, so a second run resumes without loading one
    assert rag(dataset="musique", data_dir=str(CB), limit=2).sample_ids() == ids


def test_cli_refuses_an_unknown_dataset_in_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
            "run",
            "task=rag",
            "task.dataset=hotpot",
            "model=tiny_llama",
            f"output_dir={tmp_path / 'runs'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1 and "task.dataset" in lines[0] and "fix:" in lines[0]
    assert not (tmp_path / "runs").exists()
