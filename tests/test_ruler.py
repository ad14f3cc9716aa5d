"""RULER: generators checked against independent parses of what they wrote, the length fit, the
scorers on hand-written cases, reproducibility, and one run through the runner (tiny_llama)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench.cli import conf_dir
from kvbench.compose import task_node
from kvbench.errors import ConfigError
from kvbench.tasks import create_task
from kvbench.tasks.ruler import GENERATOR_VERSION, Ruler, largest_fitting
from kvbench.tasks.ruler_data import NOISE, Draw, Question, ruler_question, zeta
from kvbench.tasks.ruler_protocol import TASKS, render, score, string_match_all, string_match_part
from tests.conftest import SHARED_DATA

SYNTHETIC = [t for t in TASKS if not t.startswith("qa")]
NIAH = [t for t in TASKS if t.startswith("niah")]
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (.+?) is: ([0-9a-f-]+)\.")


@pytest.fixture(scope="module")
def essay_dir(tmp_path_factory) -> Path:
    """kvbench's essays (shared/data), or a stand-in with the same shape when they are absent."""
    real = SHARED_DATA / "paul_graham_essays"
    if real.is_dir():
        return real
    folder = tmp_path_factory.mktemp("essays")
    (folder / "e.txt").write_text(" ".join(f"Essay sentence {i} is about startups and hackers." for i in range(4000)))
    return folder


def ruler(essay_dir: Path, **cfg) -> Ruler:
    return create_task({"name": "ruler", "haystack": str(essay_dir), "num_samples": 2, **cfg})


_CACHE: dict = {}


def built(tiny_llama, essay_dir, task: str, length: int, index: int = 0):
    """(sample, draw, prompt text) of one sample, generated once per module."""
    key = (task, length, index)
    if key not in _CACHE:
        maker = ruler(essay_dir, subsets=[task], lengths=[length])
        draw, units, segments = maker.build(task, length, index, tiny_llama)
        sample = maker.make_sample(task, length, index, tiny_llama)
        assert sample.input_ids == [i for s in segments for i in s.ids]
        _CACHE[key] = (sample, draw, tiny_llama.tokenizer.decode(sample.input_ids))
    return _CACHE[key]


# ----------------------------------------------------------------------------------------------- scorers
def test_string_match_all_and_part_on_hand_written_cases():
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert string_match_all("the number is 1234567", ["1234567", "7654321", "1111111", "2222222"]) == 0.25
    assert string_match_all("SAD-Succotash", ["sad-succotash"]) == 1.0  # case-insensitive
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_part("It was Denver Broncos.", ["Denver Broncos", "Broncos", "Carolina"]) == 1.0
    assert string_match_part("carolina panthers", ["Denver Broncos"]) == 0.0
    # the task picks RULER's metric: all-of for the synthetic tasks, any-of for QA, on 0-100
    assert score("niah_multivalue", "1 and 3", ["1", "2", "3", "4"]) == 50.0
    assert score("qa_1", "blue", ["red", "blue"]) == 100.0
    assert score("vt", " ABCDE FGHIJ", ["abcde", "fghij", "KLMNO"]) == pytest.approx(200 / 3)


def test_aggregate_per_task_per_length_and_grid(essay_dir):
    task = ruler(essay_dir, subsets=["vt", "cwe"], lengths=[1024, 2048])
    records = [
        {"score": s, "subset": t, "meta": {"task": t, "length": n}}
        for t, n, s in [
            ("vt", 1024, 100.0),
            ("vt", 1024, 50.0),
            ("vt", 2048, 0.0),
            ("cwe", 1024, 20.0),
            ("cwe", 2048, 40.0),
        ]
    ]
    metrics = task.aggregate(records)
    assert metrics["task_length"] == {"vt": {"1024": 75.0, "2048": 0.0}, "cwe": {"1024": 20.0, "2048": 40.0}}
    assert metrics["per_subset"] == {"vt": 37.5, "cwe": 30.0, "len1024": 47.5, "len2048": 20.0}
    assert metrics["score"] == 33.75  # the mean of the four cells
    assert metrics["n"] == 5


# ------------------------------------------------------------------------------------------- the needles
def needles(context: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for _, key, value in NEEDLE_RE.findall(context):
        found.setdefault(key, []).append(value)
    return found


@pytest.mark.parametrize("task", NIAH)
def test_needles_are_in_the_context_and_the_answer_is_what_is_asked(tiny_llama, essay_dir, task):
    args = TASKS[task][1]
    num_keys = max(args.get("num_keys", 1), args.get("num_queries", 1))
    num_values, num_queries = args.get("num_values", 1), args.get("num_queries", 1)
    for index in range(2):
        sample, draw, text = built(tiny_llama, essay_dir, task, 2048, index)
        found = needles(draw.context)
        (asked,) = re.findall(r"special magic \w+ for (.+) mentioned in the provided text\?", text)
        keys = asked.replace(", and ", ", ").split(", ")
        assert len(keys) == num_queries and len(set(keys)) == num_queries
        expected = [v for k in keys for v in found[k]]
        assert sorted(sample.reference) == sorted(expected)  # the queried keys' values, nothing else
        assert all(len(found[k]) == num_values for k in keys)
        if args["haystack"] == "needle":  # every line is a needle; the other keys are distractors
            assert all(NEEDLE_RE.fullmatch(line) for line in draw.context.split("\n"))
            assert len(found) == len(draw.context.split("\n"))
        else:
            assert sum(map(len, found.values())) == num_keys * num_values
        if args["value_type"] == "uuids":
            assert all(
                re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
                for v in sample.reference
            )
        else:
            assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in sample.reference)
        # RULER's wording: singular when one value is asked for, the answer prefix opening the reply
        if num_values * num_queries == 1:
            assert "What is the special magic" in text and text.endswith("mentioned in the provided text is")
        else:
            assert "What are all the special magic" in text and text.endswith("mentioned in the provided text are")
        assert text.rstrip().endswith(tuple(f"for {asked} mentioned in the provided text {w}" for w in ("is", "are")))


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue"])
def test_essay_needles_sit_between_sentences(tiny_llama, essay_dir, task):
    """Needles go between sentences, or after the last (cut) one: depth 100 appends."""
    _, draw, _ = built(tiny_llama, essay_dir, task, 2048)
    for match in NEEDLE_RE.finditer(draw.context):
        start, end = match.span()
        at_end = not NEEDLE_RE.sub("", draw.context[start:]).strip()
        assert start == 0 or at_end or (draw.context[start - 1] == " " and draw.context[start - 2] in ".!?\"')]")
        assert end == len(draw.context) or draw.context[end] == " "


def test_noise_haystack_is_rulers_paragraph(tiny_llama, essay_dir):
    _, draw, _ = built(tiny_llama, essay_dir, "niah_single_1", 2048)
    lines = draw.context.split("\n")
    assert sum(line == NOISE for line in lines) == len(lines) - 1


def test_draws_keep_every_question_for_multi_query(tiny_llama, essay_dir):
    """A context's questions are all answerable on their own: multikey's distractor keys too."""
    _, draw, _ = built(tiny_llama, essay_dir, "niah_multikey_1", 2048)
    found = needles(draw.context)
    assert len(draw.questions) == 4 and len(draw.asked) == 1
    assert {q.query: list(q.answers) for q in draw.questions} == found
    question = ruler_question(draw)
    assert question == draw.questions[draw.asked[0]]
    joined = ruler_question(Draw("", (Question("a", ("1",)), Question("b", ("2",)), Question("c", ("3",))), (2, 0, 1)))
    assert joined == Question("c, a, and b", ("3", "1", "2"))


# ---------------------------------------------------------------------------------- variable tracking
def resolve(context: str) -> dict[str, str]:
    """Each variable's value, following the chain of assignments in the order the lines come."""
    values: dict[str, str] = {}
    for line in context.split("\n"):
        if line == NOISE:
            continue
        direct = re.fullmatch(r"VAR ([A-Z]+) = (\d+)", line)
        link = re.fullmatch(r"VAR ([A-Z]+) = VAR ([A-Z]+) ", line)
        assert direct or link, line
        if direct:
            values[direct.group(1)] = direct.group(2)
        else:
            assert link.group(2) in values, "a link comes after the variable it reads"
            values[link.group(1)] = values[link.group(2)]
    return values


def test_variable_tracking_chain(tiny_llama, essay_dir):
    for index in range(2):
        sample, draw, text = built(tiny_llama, essay_dir, "vt", 2048, index)
        values = resolve(draw.context)
        (query,) = re.findall(r"assigned the value (\d+) in the text above\.<", text)
        assert sorted(sample.reference) == sorted(v for v, x in values.items() if x == query)
        assert len(sample.reference) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in sample.reference)
        assert text.endswith(f"5 variables are assigned the value {query}, they are: ")
        # the few-shot example: a 3-letter chain, answered in the prompt
        (example,) = draw.examples
        example_values = resolve(example.context)
        example_value = example.questions[0].query
        names = [v for v, x in example_values.items() if x == example_value]
        assert len(names) == 5 and all(len(n) == 3 for n in names)
        assert f"assigned the value {example_value}, they are:  {' '.join(names)}\n\nMemorize" in text


# --------------------------------------------------------------------------------- common / frequent words
@pytest.mark.parametrize("length, common, rare", [(2048, 6, 1), (8192, 30, 3)])
def test_common_words_answer_by_counting(tiny_llama, essay_dir, length, common, rare):
    sample, draw, text = built(tiny_llama, essay_dir, "cwe", length)
    entries = re.findall(r"(\d+)\. (.+?)(?= \d+\. |$)", draw.context)
    assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(word for _, word in entries)
    assert {w for w, c in counts.items() if c == common} == set(sample.reference) and len(sample.reference) == 10
    assert set(counts.values()) == {common, rare}
    (example,) = draw.examples
    assert "are: " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example.questions[0].answers)) + "\nBelow" in text


def test_freq_words_answer_by_counting(tiny_llama, essay_dir):
    for length in (2048, 8192):
        sample, draw, _ = built(tiny_llama, essay_dir, "fwe", length)
        counts = Counter(draw.context.split(" "))
        ranked = counts.most_common()
        assert ranked[0][0] == "..."
        assert [w for w, _ in ranked[1:4]] == sample.reference
        assert ranked[1][1] > ranked[2][1] > ranked[3][1] > ranked[4][1]  # the answer is unambiguous


def test_zeta():
    assert zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-12)
    assert zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-12)


# ---------------------------------------------------------------------------------------- length fitting
def test_largest_fitting_finds_the_boundary():
    def measure(n):
        return 100 + 7 * n + (n % 3)  # almost linear, like a prompt

    for budget in (108, 500, 4096, 100000):
        n = largest_fitting(measure, budget, 1)
        assert measure(n) <= budget < measure(n + 1)
    assert largest_fitting(measure, 50, 1) is None
    assert largest_fitting(measure, 10**6, 1, high=40) == 40


def test_prompts_fill_the_length(tiny_llama, essay_dir):
    """prompt + tokens to generate <= L (RULER's max_seq_length), within 5 % of it, and one more unit of
    haystack would not fit."""
    for task in SYNTHETIC:
        sample, _, _ = built(tiny_llama, essay_dir, task, 8192)
        total = sample.meta["prompt_tokens"] + sample.max_new_tokens
        assert 0.95 * 8192 <= total <= 8192, (task, total)
        assert len(sample.input_ids) == sample.meta["prompt_tokens"]
    maker = ruler(essay_dir, lengths=[2048])
    for task in SYNTHETIC:
        sample, draw, _ = built(tiny_llama, essay_dir, task, 2048)
        bigger = maker.drawer(task, 2048, 0, tiny_llama)(sample.meta["units"] + 1)
        size = sum(map(len, maker.segments(render(task, bigger, ruler_question(bigger)), tiny_llama)))
        assert sample.meta["prompt_tokens"] + sample.max_new_tokens <= 2048 < size + sample.max_new_tokens


def test_segments_are_template_instruction_context_question(tiny_llama, essay_dir):
    sample, draw, text = built(tiny_llama, essay_dir, "niah_single_1", 2048)
    prefix, chunk, query = sample.segments
    assert (prefix.role, chunk.role, query.role) == ("prefix", "chunk", "query")
    assert tiny_llama.tokenizer.decode(list(chunk.ids)) == draw.context
    assert text.startswith("<|im_start|>user\nA special magic number is hidden")
    assert tiny_llama.tokenizer.decode(list(query.ids)).startswith("\nWhat is the special magic number for")


def test_base_template_is_plain_text(tiny_llama, essay_dir):
    """``chat_template=false``: RULER's ``base`` template, the answer prefix right after the question."""
    task = ruler(essay_dir, subsets=["niah_single_1"], lengths=[1024], chat_template=False)
    sample = task.make_sample("niah_single_1", 1024, 0, tiny_llama)
    text = tiny_llama.tokenizer.decode(sample.input_ids)
    assert text.startswith("A special magic number is hidden") and "<|im_start|>" not in text
    assert re.search(r"mentioned in the provided text\? The special magic number for .+ is$", text)
    assert sample.meta["prompt_tokens"] + sample.max_new_tokens <= 1024


# ------------------------------------------------------------------------------------ reproducibility
def test_a_fixed_seed_gives_byte_identical_samples(tiny_llama, essay_dir):
    def digests(**cfg):
        task = ruler(essay_dir, subsets=SYNTHETIC, **cfg)
        return {s.id: s.meta["digest"] for s in task.samples(tiny_llama)}

    first = digests(lengths=[2048], num_samples=2)
    assert first == digests(lengths=[2048], num_samples=2)
    assert len(set(first.values())) == len(first)
    other_seed = digests(lengths=[2048], num_samples=2, seed=7)
    assert all(other_seed[k] != v for k, v in first.items())
    # a sample depends on its own (seed, task, length, index) only
    assert digests(lengths=[2048], num_samples=1) == {k: v for k, v in first.items() if k.endswith("-0")}


def test_golden_digests(tiny_llama, essay_dir):
    """Samples that do not depend on the essays, pinned: a change here must bump GENERATOR_VERSION."""
    assert GENERATOR_VERSION == 1
    got = {t: built(tiny_llama, essay_dir, t, 2048)[0].meta["digest"] for t in GOLDEN}
    assert got == GOLDEN


GOLDEN = {
    "niah_single_1": "c64393754c5eb1d1",
    "niah_multikey_3": "150f84125f6e0e8b",
    "vt": "6b925e55dcb82b7e",
    "fwe": "f945aba3a1a57457",
}


def test_sample_ids_without_a_model(tiny_llama, essay_dir, capsys):
    task = ruler(essay_dir, lengths=[1024, 2048], subsets=["niah_single_1", "qa_1", "fwe"], num_samples=3, limit=2)
    assert "skipping qa_1" in capsys.readouterr().err
    ids = task.sample_ids()
    assert ids == [f"{t}-len{n}-{i}" for t in ("niah_single_1", "fwe") for n in (1024, 2048) for i in range(2)]
    assert [s.id for s in task.samples(tiny_llama)] == ids


def test_every_generator_input_is_in_the_config():
    """The run id hashes the resolved config, so the task's node must carry every input of the generators."""
    node = task_node("ruler")
    inputs = ("seed", "lengths", "num_samples", "subsets", "haystack", "chat_template", "generator_version", "data_dir")
    assert all(key in node for key in inputs)
    assert {k: node[k] for k in Ruler.defaults} == Ruler.defaults
    optional = {"shard"}  # task.shard=i/n is added on the command line (+task.shard) and absent otherwise
    assert set(node) == set(Ruler.defaults) | (set(Ruler.common_keys) - optional)


def test_config_errors(tiny_llama, essay_dir):
    with pytest.raises(ConfigError, match="generator_version"):
        ruler(essay_dir, generator_version=0)
    with pytest.raises(ConfigError, match="unknown RULER task"):
        ruler(essay_dir, subsets=["niah_single_9"])
    with pytest.raises(ConfigError, match="beyond the model"):
        list(ruler(essay_dir, subsets=["fwe"], lengths=[32768]).samples(tiny_llama))
    with pytest.raises(ConfigError, match="too short for vt"):
        list(ruler(essay_dir, subsets=["vt"], lengths=[512]).samples(tiny_llama))


# ------------------------------------------------------------------------------------------------- QA
@pytest.fixture
def qa_dir(tmp_path) -> Path:
    paragraphs = [
        {
            "context": f"Paragraph {a}.{p} says the colour of item {a}{p} is shade{a}{p}.",
            "qas": [
                {
                    "question": f"What colour is item {a}{p}?",
                    "is_impossible": p == 0,
                    "answers": [] if p == 0 else [{"text": f"shade{a}{p}"}],
                }
            ],
        }
        for a in range(3)
        for p in range(3)
    ]
    squad = {"data": [{"paragraphs": paragraphs[3 * a : 3 * a + 3]} for a in range(3)]}
    (tmp_path / "squad.json").write_text(json.dumps(squad))
    hotpot = [
        {
            "question": f"Which town hosts team {q}?",
            "answer": f"town{q}",
            "context": [
                [f"Title {q}-{k}", [f"Team {q} plays in town{q}." if k == 0 else f"Filler {q} {k}."]] for k in range(10)
            ],
        }
        for q in range(3)
    ]
    (tmp_path / "hotpot_dev_distractor_v1.json").write_text(json.dumps(hotpot))
    return tmp_path


def test_qa_tasks_read_rulers_files(tiny_llama, essay_dir, qa_dir, capsys):
    task = ruler(essay_dir, subsets=["qa_1", "qa_2"], lengths=[1024], data_dir=str(qa_dir))
    assert "skipping" not in capsys.readouterr().err
    samples = {s.id: s for s in task.samples(tiny_llama)}
    squad = samples["qa_1-len1024-0"]
    assert squad.reference == ["shade01"]  # the first answerable question (the impossible ones are dropped)
    text = tiny_llama.tokenizer.decode(squad.input_ids)
    assert "Paragraph 0.1 says the colour of item 01 is shade01." in text
    assert "Question: What colour is item 01?<|im_end|>" in text and text.endswith(" Answer:")
    assert squad.meta["prompt_tokens"] + squad.max_new_tokens <= 1024
    hotpot = samples["qa_2-len1024-1"]
    text = tiny_llama.tokenizer.decode(hotpot.input_ids)
    assert hotpot.reference == ["town1"] and "Title 1-0\nTeam 1 plays in town1." in text
    assert len(re.findall(r"Document \d+:\n", text)) >= 10
    assert task.score(hotpot, "It is Town1.") == 100.0


# ------------------------------------------------------------------------------------------ end to end
def test_run_through_the_runner(tiny_llama, essay_dir, tmp_path):
    from kvbench.methods import method_node
    from kvbench.runner import run

    base = OmegaConf.load(conf_dir() / "config.yaml")
    task = task_node("ruler")
    task.update(subsets=["fwe", "qa_1"], lengths=[1024], num_samples=1, haystack=str(essay_dir))  # fwe: 50 new tokens
    cfg = {
        "model": OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "tiny_llama.yaml")),
        "method": method_node("full"),
        "task": task,
        "budget": OmegaConf.to_container(base.budget),
        "profile": OmegaConf.to_container(base.profile),
        "output_dir": str(tmp_path / "runs"),
        "progress": False,
    }
    summary = run(cfg)
    metrics = summary.metrics
    assert set(metrics["per_subset"]) == {"fwe", "len1024"} and set(metrics["task_length"]) == {"fwe"}
    assert metrics["protocol"]["skipped"] == ["qa_1"]
    records = [json.loads(line) for line in (summary.run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["fwe-len1024-0"]
    assert all(len(r["meta"]["digest"]) == 16 for r in records)
    assert all(r["protocol"]["generator_version"] == GENERATOR_VERSION for r in records)
    for record in records:
        assert record["score"] == score(record["subset"], record["prediction"], record["reference"])
