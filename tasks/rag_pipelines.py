"""RAG pipelines that read the chunks one at a time: CacheBlend's MapReduce and MapRerank baselines (Fig. 13).

CacheBlend feeds every retrieved chunk into one prompt ("stuff" mode, the rag task's default). Its
paper compares that with two LangChain chains that process chunks separately (§2, §7.2):

* ``mapreduce`` — LangChain's ``MapReduceDocumentsChain`` as built for question answering: the *map*
  step runs the model on each chunk alone with the question and keeps what it writes (here: a short
  summary of what in the passage helps answer the question); the *reduce* step (a
  ``StuffDocumentsChain``) puts every map output, in chunk order, into one prompt and asks the
  question. LangChain first collapses map outputs that exceed its ``token_max`` (3000 tokens); with
  at most ``map_tokens`` tokens per chunk the outputs here stay below it, so there is no collapse.
* ``maprerank`` — LangChain's ``MapRerankDocumentsChain``: each chunk alone produces an answer and a
  confidence score, parsed by a regular expression (LangChain's ``RegexParser`` with
  ``Answer … \\nScore: <n>``); the answer with the highest score wins, ties to the earliest chunk
  (LangChain's stable sort on ``-int(score)``). LangChain raises on an output that does not parse;
  here such an output ranks below every parsed one, with its first line as the answer, so one bad
  generation does not end the run (how many did not parse is recorded). ``task.rerank_score``:
  ``free`` (default, LangChain's) leaves the score line to the model; ``cued`` — a documented deviation
  for small models, which answer and end their turn without it — ends the answer at its first line
  (or the model's stop token) and feeds ``"\nScore:"`` after it in the same cache, then lets the model
  write the number (≤ 4 tokens): one prefill per chunk still, a few more decode steps. The map step is
  then a two-turn :class:`~kvbench.requests.MultiQueryRequest` (the answer kept), and its time is the
  prefill plus both turns.

The prompts are kvbench's own, written from those chains' documented behaviour (not LangChain's
text): the map prompts carry the question and ask for a summary (mapreduce) or an answer with a 0–100
score (maprerank); the reduce prompt is the dataset's own CacheBlend prompt (its prefix instruction
and its query prompt with "Answer within 5 words") with the summaries in place of the passages, so
the final answer has the same form as in stuff mode and is scored by the same scorer (F1 over the
model tokenizer's ids). Every prompt is wrapped in the model's chat template, like the stuff prompt,
and is described as prefix / chunk / query segments, so reuse methods can run the map steps too.

**Requests.** Each map step is one :class:`~kvbench.requests.GenerateRequest` (``map_tokens`` new
tokens: 64 for summaries, 32 for an answer and its score, unless ``task.map_tokens`` says otherwise);
mapreduce's reduce step is a :class:`~kvbench.requests.FollowUp` that builds the reduce request from
the map outputs — the task never calls the engine.

**TTFT** is request to the first token of the final answer, the map steps included: kvbench's engine
runs one request at a time, so the map steps run one after another and ``ttft_s`` = the sum of the map
steps' times (prefill + decode) + the reduce prefill (mapreduce), or the sum of the map steps' times
(maprerank: the final answer is known once every chunk has been answered and scored). LangChain runs
the map calls concurrently; ``pipeline.ttft_parallel_s`` is the same with the longest map step in place
of their sum — an idealised bound for a server that runs the map steps in parallel at no slowdown,
not a measurement.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError, note
from kvbench.requests import FollowUp, GenerateRequest, MultiQueryRequest, Output, Query, Segment

if TYPE_CHECKING:
    from kvbench.tasks.base import Sample, SampleResult
    from kvbench.tasks.rag import Rag

#: the pipelines and who writes maprerank's score line: the choices RagParams declares (and checks;
#: tests/test_task_params.py checks they agree)
PIPELINES = ("stuff", "mapreduce", "maprerank")
RERANK_SCORES = ("free", "cued")
MAP_TOKENS = {"mapreduce": 64, "maprerank": 32}

MAP_SUMMARY = (
    "Read the passage below, then write a short summary of whatever in it helps answer the question "
    'that follows. If nothing in it is relevant, write "Nothing relevant."\n\nPassage:\n'
)
MAP_SUMMARY_QUERY = "\n\nQuestion: {question}\nSummary of the relevant information:"
REDUCE_SUMMARY = "Summary {index}: {text}\n\n"
MAP_RERANK = (
    "Answer the question below using only the passage. Reply with the answer in at most 5 words on "
    "the first line, then on a second line how confident you are, from 0 to 100, that the passage "
    "answers the question, exactly as:\nAnswer: <answer>\nScore: <number>\n\nPassage:\n"
)
MAP_RERANK_QUERY = "\n\nQuestion: {question}"
RERANK_CUE = "Answer:"
SCORE_CUE = "\nScore:"  # task.rerank_score=cued: fed after the answer's first line
SCORE_TOKENS = 4
#: LangChain's map-rerank parser shape: the answer, a newline, "Score:" and an integer
RERANK_PATTERN = re.compile(r"(?s)^\s*(?:Answer:\s*)?(.*?)\s*\n\s*Score:\s*(\d+)")


def check(pipeline: str, dataset: str) -> None:
    """Refuse a pipeline the data set cannot run (one line, before any model loads). The pipeline's name,
    ``map_tokens`` and ``rerank_score`` are checked by their declarations (:class:`~kvbench.tasks.rag.RagParams`)."""
    if pipeline != "stuff" and dataset == "multi_news":
        raise ConfigError(
            f"task.pipeline={pipeline} asks a question of every chunk, and multi_news has none",
            "use task.pipeline=stuff for multi_news",
        )


def protocol(task: Rag) -> dict[str, Any]:
    pipeline = task.params.pipeline
    if pipeline == "stuff":
        return {"pipeline": "stuff"}
    out: dict[str, Any] = {
        "pipeline": pipeline,
        "map_tokens": map_tokens(task),
        "ttft": "sum of the map steps (prefill + decode), run one at a time"
        + (", + the reduce prefill" if pipeline == "mapreduce" else ""),
    }
    if pipeline == "mapreduce":
        out.update(
            map_prompt=MAP_SUMMARY + "{chunk}" + MAP_SUMMARY_QUERY,
            reduce_chunk=REDUCE_SUMMARY,
            reduce_prompt="the dataset's prefix prompt + summaries + its query prompt",
        )
    else:
        out.update(
            map_prompt=MAP_RERANK + "{chunk}" + MAP_RERANK_QUERY,
            assistant_cue=RERANK_CUE,
            parser=RERANK_PATTERN.pattern,
            ranking="highest score, ties to the earliest chunk; unparsed outputs rank last",
            score_line="written by the model"
            if task.rerank_score == "free"
            else f"cued: the answer's first line, then {SCORE_CUE!r} fed, then <= {SCORE_TOKENS} tokens",
        )
    return out


def map_tokens(task: Rag) -> int:
    """New tokens per map step: ``task.map_tokens``, else the pipeline's (:data:`MAP_TOKENS`)."""
    return task.params.map_tokens or MAP_TOKENS[task.params.pipeline]


def requests(task: Rag, sample: Sample, model: Any) -> list[Any]:
    """The sample's map requests (one per chunk), then for mapreduce the reduce step as a FollowUp."""
    from kvbench.tasks.rag import _piece_encoder, template_frame

    pipeline = task.params.pipeline
    encode = _piece_encoder(model.tokenizer)
    head, tail = template_frame(model.tokenizer, model.chat)
    segments = sample.segments or []
    chunks = [s for s in segments if s.role == "chunk"]
    question = str(sample.meta["question"])
    new_tokens = map_tokens(task)
    if pipeline == "mapreduce":
        prefix, query = head + encode(MAP_SUMMARY), encode(MAP_SUMMARY_QUERY.format(question=question)) + tail
    else:
        prefix = head + encode(MAP_RERANK)
        query = encode(MAP_RERANK_QUERY.format(question=question)) + tail + encode(RERANK_CUE)
    if pipeline == "maprerank" and task.rerank_score == "cued":
        return [_cued(Segment(prefix, "prefix"), chunk, query, new_tokens, encode(SCORE_CUE)) for chunk in chunks]
    maps: list[Any] = [
        _generate([Segment(prefix, "prefix"), chunk, Segment(query, "query")], new_tokens) for chunk in chunks
    ]
    if pipeline == "maprerank":
        return maps
    dataset = task.dataset
    reduce_prefix = head + encode(dataset.prefix_prompt)
    final_query = next(s for s in segments if s.role == "query")

    def reduce(outputs: list[Output]) -> list[GenerateRequest]:
        summaries = [
            Segment(encode(REDUCE_SUMMARY.format(index=i + 1, text=out.text.strip())), "chunk")
            for i, out in enumerate(outputs)
        ]
        return [_generate([Segment(reduce_prefix, "prefix"), *summaries, final_query], sample.max_new_tokens)]

    return maps + [FollowUp(reduce)]


def _generate(segments: list[Segment], max_new_tokens: int) -> GenerateRequest:
    segments = [s for s in segments if len(s) or s.role == "query"]
    return GenerateRequest(
        input_ids=[i for s in segments for i in s.ids], max_new_tokens=max_new_tokens, segments=tuple(segments)
    )


def _cued(prefix: Segment, chunk: Segment, query: list[int], new_tokens: int, cue: list[int]) -> MultiQueryRequest:
    """A map-rerank step with its score line cued: the answer (to its first line), then ``cue`` and the
    score, in one cache (``keep_answers``: the score follows the answer)."""
    context = [s for s in (prefix, chunk) if len(s)]
    return MultiQueryRequest(
        context_ids=[i for s in context for i in s.ids],
        context_segments=tuple(context),
        queries=(
            Query(ids=tuple(query), max_new_tokens=new_tokens, stop_texts=("\n",)),
            Query(ids=tuple(cue), max_new_tokens=SCORE_TOKENS, stop_texts=("\n",)),
        ),
        compression="question_aware",
        keep_answers=True,
    )


def map_text(out: Output) -> str:
    """A map step's text: the generation, or for a cued rerank step the answer, the cue and the score."""
    if not out.turns:
        return out.text
    answer, score = out.turns[0].text.strip(), out.turns[1].text.strip() if len(out.turns) > 1 else ""
    return f"{answer}{SCORE_CUE} {score}"


def parse_rerank(text: str) -> tuple[str, int | None]:
    """A map-rerank output as (answer, score); score None when the output does not parse."""
    match = RERANK_PATTERN.match(text)
    if match is None:
        first = text.strip().splitlines()[0] if text.strip() else ""
        return first.removeprefix("Answer:").strip(), None
    return match.group(1).strip(), int(match.group(2))


def rerank(outputs: list[Output]) -> tuple[int, list[tuple[str, int | None]]]:
    """The index of the winning map output (highest score, ties to the earliest, unparsed last) and
    every output parsed."""
    parsed = [parse_rerank(map_text(out)) for out in outputs]
    scores = [-1 if score is None else score for _, score in parsed]
    order = sorted(range(len(parsed)), key=lambda i: -scores[i])
    return order[0], parsed


#: below this share of parsed map outputs, a maprerank run says that its ranking is mostly chunk order
PARSED_WARN = 0.5


def aggregate(pipeline: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Run-level facts of a chain for metrics.json. For maprerank, ``rerank_scores_parsed``: the share of
    map outputs that carried a score. A model that does not write the score line leaves the ranking to
    the tie-break (the earliest chunk), so a low share means the run measured "answer from the first
    chunk", not a rerank — said once on stderr as well as recorded."""
    if pipeline != "maprerank":
        return {}
    outputs = sum(len(r.get("meta", {}).get("map_outputs") or []) for r in records)
    unparsed = sum(int(r.get("meta", {}).get("unparsed") or 0) for r in records)
    if not outputs:
        return {"rerank_scores_parsed": None}
    share = (outputs - unparsed) / outputs
    if share < PARSED_WARN:
        note(
            f"maprerank: only {outputs - unparsed} of {outputs} map outputs carried a score line; the rest "
            "ranked by chunk order (the earliest chunk's answer), so this run is mostly not a rerank"
        )
    return {"rerank_scores_parsed": round(share, 4)}


def _step_s(out: Output) -> float:
    """A map step's time: prefill + decode; for a cued rerank step, the prefill + both turns."""
    if out.turns:
        return float(out.telemetry.get("prefill_s") or 0.0) + sum(
            float(t.telemetry.get("turn_s") or 0.0) for t in out.turns
        )
    return float(out.telemetry.get("ttft_s") or 0.0) + float(out.telemetry.get("decode_s") or 0.0)


def result(task: Rag, sample: Sample, outputs: list[Output]) -> SampleResult:
    """The final answer scored by the rag task's scorer, with the pipeline's TTFT and its steps."""
    from kvbench.tasks.base import SampleResult

    pipeline = task.params.pipeline
    n_maps = len([s for s in sample.segments or [] if s.role == "chunk"])
    maps = outputs[:n_maps]
    map_s = sum(_step_s(out) for out in maps)
    longest = max((_step_s(out) for out in maps), default=0.0)
    steps = [
        {
            "step": "map",
            "step_s": _step_s(out),
            "prompt_tokens": out.prompt_tokens,
            "ttft_s": out.telemetry.get("ttft_s"),
            "decode_s": out.telemetry.get("decode_s"),
            "new_tokens": out.telemetry.get("new_tokens"),
        }
        for out in maps
    ]
    meta: dict[str, Any] = {**sample.meta, "pipeline": pipeline, "map_outputs": [map_text(out) for out in maps]}
    if pipeline == "mapreduce":
        final = outputs[n_maps]
        first = float(final.telemetry.get("ttft_s") or 0.0)
        steps.append(
            {
                "step": "reduce",
                "prompt_tokens": final.prompt_tokens,
                "ttft_s": first,
                "decode_s": final.telemetry.get("decode_s"),
                "new_tokens": final.telemetry.get("new_tokens"),
            }
        )
        prediction, stop = final.text, final.stop_reason
        ttft, parallel = map_s + first, longest + first
        telemetry = dict(final.telemetry)
        if telemetry.get("tt2t_s") is not None:
            telemetry["tt2t_s"] = map_s + float(telemetry["tt2t_s"])
    else:
        best, parsed = rerank(maps)
        prediction, stop = parsed[best][0], maps[best].stop_reason
        ttft, parallel = map_s, longest
        telemetry = {key: value for key, value in maps[best].telemetry.items() if key not in ("tt2t_s", "tpot_s")}
        meta.update(
            map_scores=[score for _, score in parsed], chosen=best, unparsed=sum(score is None for _, score in parsed)
        )
    telemetry.update(
        ttft_s=ttft,
        prefill_s=ttft,
        prompt_tokens=sum(out.prompt_tokens for out in outputs),
        pipeline={"steps": steps, "map_s": map_s, "map_parallel_s": longest, "ttft_parallel_s": parallel},
    )
    score = task.score(sample, prediction)
    return SampleResult(
        id=sample.id,
        prediction=prediction,
        reference=sample.reference,
        score=None if score is None else float(score),
        subset=sample.subset,
        meta={**meta, "stop_reason": stop},
        telemetry=telemetry,
        budget=outputs[-1].budget,
    )
