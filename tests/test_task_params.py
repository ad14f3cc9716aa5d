"""Task parameters declared once, in each task's module: the config nodes, the checks, the records.

* every registered task declares its parameters in its own module (``TASK_PARAMS`` maps the names to
  them), its defaults are theirs, and Hydra's ``task=<name>`` node is built from them (there is no
  ``conf/task/*.yaml``); the task modules import nothing heavy;
* the ``Literal`` choices agree with the task modules' own tuples;
* a wrong type, choice or range is one ``ConfigError`` naming the key, before any data or model loads;
* every recorded run (``benchmarks/records``, ``results``) is what today's node gives with the record's
  values: the node adds no key a record lacks (except at a key's legacy value), so no run id moves.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import yaml

from kvbench.compose import compose, task_node
from kvbench.errors import ConfigError
from kvbench.params import defaults
from kvbench.results import run_id_for
from kvbench.tasks import REGISTRY, create_task
from kvbench.tasks.params import TASK_PARAMS

REPO = Path(__file__).resolve().parent.parent


def test_every_task_declares_its_listed_parameters():
    assert sorted(TASK_PARAMS) == REGISTRY.names()
    for name, params in TASK_PARAMS.items():
        cls = REGISTRY.get(name)
        assert cls.Params is params and params.__module__ == cls.__module__  # (declared beside its task)
        assert cls.defaults == defaults(params)
        assert task_node(name) == {"name": name, **defaults(params)}
    assert not (REPO / "conf" / "task").exists()


def test_hydra_composes_the_declared_node():
    resolved = compose(["task=ruler", "task.num_samples=3"])
    assert resolved["task"] == {**task_node("ruler"), "num_samples": 3}


def test_a_task_that_sets_its_defaults_instead_of_params_is_refused():
    from kvbench.tasks.base import Task

    with pytest.raises(TypeError, match="declare its Params"):
        type("Loose", (Task,), {"name": "loose", "defaults": {"x": 1}})


def test_the_choices_agree_with_the_task_modules():
    from kvbench.requests import COMPRESSIONS
    from kvbench.tasks.infinitebench_protocol import PROTOCOLS
    from kvbench.tasks.longbench_protocol import LENGTH_LIMITS
    from kvbench.tasks.metrics_infinitebench import VERSIONS
    from kvbench.tasks.niah import SCORERS
    from kvbench.tasks.rag_pipelines import PIPELINES, RERANK_SCORES
    from kvbench.tasks.rag_retrieval import RETRIEVERS
    from kvbench.tasks.rag_stream import POPULARITIES
    from kvbench.tasks.ruler_protocol import TASKS

    p = TASK_PARAMS
    assert set(get_args(get_type_hints(p["niah"])["scorer"])) == set(SCORERS)
    assert set(get_args(get_type_hints(p["niah"])["compression"])) == set(COMPRESSIONS)
    assert set(get_args(get_type_hints(p["rag"])["retriever"])) == set(RETRIEVERS)
    assert set(get_args(get_type_hints(p["rag"])["pipeline"])) == set(PIPELINES)
    assert set(get_args(get_type_hints(p["rag"])["rerank_score"])) == set(RERANK_SCORES)
    assert set(get_args(get_type_hints(p["rag_stream"])["popularity"])) == set(POPULARITIES)
    assert set(get_args(get_type_hints(p["infinitebench"])["protocol"])) == set(PROTOCOLS)
    assert set(get_args(get_type_hints(p["infinitebench"])["scorer_version"])) == set(VERSIONS)
    assert set(get_args(get_type_hints(p["longbench"])["protocol"])) == set(LENGTH_LIMITS)
    assert tuple(defaults(p["ruler"])["subsets"]) == tuple(TASKS)


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"name": "niah", "scorer": "bleu"}, "task.scorer=bleu is not one of 'rouge1_recall', 'rouge1_f', 'substring'"),
        ({"name": "niah", "depths": [0.5, 1.5]}, "task.depths=1.5 is out of range"),
        ({"name": "niah", "max_new_tokens": 0}, "task.max_new_tokens=0 is out of range"),
        ({"name": "rag", "top_k": "six"}, "task.top_k=six is not an integer or null"),
        ({"name": "pg19", "mode": "fresh"}, "task.mode=fresh is not one of 'sweep', 'fresh_prefill'"),
        ({"name": "ruler", "keep_answers": "yes"}, "task.keep_answers=yes is not true or false"),
        ({"name": "longbench", "protocol": "loose"}, "task.protocol=loose is not one of"),
        ({"name": "gsm8k_cot", "limit": 0}, "task.limit=0 is out of range"),
        # the checks the task code left to the declarations
        ({"name": "niah", "queries_per_context": 0}, "task.queries_per_context=0 is out of range"),
        ({"name": "niah", "queries_per_context": True}, "task.queries_per_context=true is not an integer"),
        ({"name": "niah", "compression": "late"}, "task.compression=late is not one of"),
        ({"name": "niah", "needles": 0}, "task.needles=0 is out of range"),
        ({"name": "niah", "depths": [-0.5]}, "task.depths=-0.5 is out of range"),
        ({"name": "ruler", "num_samples": 0}, "task.num_samples=0 is out of range"),
        ({"name": "pg19", "prefix": 0}, "task.prefix=0 is out of range"),
        ({"name": "pg19", "eval_every": 0}, "task.eval_every=0 is out of range"),
        ({"name": "rag", "pipeline": "refine"}, "task.pipeline=refine is not one of"),
        ({"name": "rag", "map_tokens": 0}, "task.map_tokens=0 is out of range"),
        ({"name": "rag", "rerank_score": "given"}, "task.rerank_score=given is not one of"),
        ({"name": "rag", "question_position": 5}, "task.question_position=5 is not a string or null"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(cfg, message):
    with pytest.raises(ConfigError) as caught:
        create_task(cfg)
    assert message in caught.value.message and "\n" not in caught.value.message
    assert caught.value.fix


def test_the_common_keys_are_typed_also_where_the_params_leave_them_out(tmp_path):
    """``task.limit`` / ``data_dir`` / ``question_position`` are attributes of every task: its parameter's
    value where it declares the key (niah), else the value given, checked (rag has no question_position)."""
    niah = create_task({"name": "niah", "limit": 2, "question_position": "start"})
    assert (niah.limit, niah.data_dir, niah.question_position) == (2, None, "start")
    assert (niah.params.limit, niah.params.data_dir, niah.params.question_position) == (2, None, "start")
    (tmp_path / "musique_s.json").write_text("[]")
    rag = {"name": "rag", "dataset": "musique", "data_dir": str(tmp_path)}
    task = create_task(rag)
    assert (task.limit, task.data_dir, task.question_position) == (None, str(tmp_path), None)
    assert create_task({**rag, "question_position": "end"}).question_position == "end"
    with pytest.raises(ConfigError, match="always asks the question after the passages"):
        create_task({**rag, "question_position": "start"})


def _recorded_configs() -> list[Path]:
    roots = [REPO / "benchmarks" / "records", REPO / "results"]
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("config.yaml"))


def test_every_recorded_run_is_what_todays_node_gives_with_its_values():
    """Today's node with a record's task values (``{**node, **recorded}``) identifies the same run as the
    record: the node holds no key the record lacks, except keys at their legacy value."""
    checked = 0
    for path in _recorded_configs():
        resolved = yaml.safe_load(path.read_text())
        if not isinstance(resolved, dict) or not isinstance(resolved.get("task"), dict):
            continue
        task = resolved["task"]
        if task.get("name") not in TASK_PARAMS:
            continue
        today = {**resolved, "task": {**task_node(task["name"]), **task}}
        assert run_id_for(today) == run_id_for(resolved), path
        checked += 1
    assert checked >= 100, checked  # (the records are there: the test has something to check)


def test_the_tasks_with_exact_prompt_lengths_say_so_in_their_parameters():
    from kvbench.config import TaskConfig
    from kvbench.validate import exact_length_extra

    exact = {name for name, params in TASK_PARAMS.items() if getattr(params, "exact_lengths", False)}
    assert exact == {"niah", "pg19"}
    assert exact_length_extra(TaskConfig.parse(task_node("niah"))) == 48  # its generation on top
    assert exact_length_extra(TaskConfig.parse(task_node("pg19"))) == 0
    assert exact_length_extra(TaskConfig.parse(task_node("ruler"))) is None


def test_identity_reads_the_declared_legacy_values_without_importing_a_task():
    """A key added after runs were recorded is left out of the identity at its declared legacy value (NIAH's
    needles and the multi-query options, RAG's rerank_score, the zipf stream's keys at popularity=repeat),
    and computing an identity imports no task module."""
    import subprocess
    import sys

    from kvbench.results import identity

    niah = task_node("niah")
    assert not {"needles", "queries_per_context", "compression", "keep_answers"} & set(identity({"task": niah})["task"])
    assert identity({"task": {**niah, "needles": 4}})["task"]["needles"] == 4
    assert "rerank_score" not in identity({"task": task_node("rag")})["task"]
    stream = task_node("rag_stream")
    assert "zipf_s" not in identity({"task": stream})["task"]
    assert identity({"task": {**stream, "popularity": "zipf"}})["task"]["zipf_s"] == 2.0  # a zipf run keeps every key
    code = (
        "import sys; from kvbench.results import identity; from kvbench.compose import task_node; "
        "identity({'task': task_node('niah'), 'method': {'name': 'full'}}); "
        "print(sorted({'torch', 'transformers', 'datasets', 'sentence_transformers', 'matplotlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout  # (the task modules, imported for their parameters, are light)
