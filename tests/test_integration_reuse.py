"""The reuse family on the real SmolLM2-135M-Instruct with real rag prompts (CacheBlend's musique inputs).

Kept affordable: two samples, prompts capped at 1,500 tokens (two or more passages stay as chunks), 32
generated tokens.
"""

import dataclasses

import pytest

from kvbench.budget import BudgetConfig
from kvbench.compose import compose
from kvbench.engine import execute
from kvbench.methods import create_method
from kvbench.profile import Profile
from kvbench.results import RunDir
from kvbench.runner import run
from kvbench.tasks import create_task

from .conftest import SHARED_DATA

CB = SHARED_DATA / "cacheblend"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (CB / "musique_s.json").exists(), reason="needs ../shared/data/cacheblend"),
]
MAX_LENGTH = 1500
TASK = {"name": "rag", "dataset": "musique", "data_dir": str(CB), "limit": 2, "max_length": MAX_LENGTH}


@pytest.fixture(scope="module")
def requests(smollm2):
    """The two samples' generation requests, each forced to its full 32 tokens (a longer comparison)."""
    task = create_task(TASK)
    out = []
    for sample in task.samples(smollm2):
        (request,) = task.requests(sample, smollm2)
        assert sample.meta["chunks"] >= 2 and len(request.input_ids) <= MAX_LENGTH
        out.append(dataclasses.replace(request, min_new_tokens=request.max_new_tokens))
    return out


def test_cacheblend_recomputing_everything_is_token_identical_to_full(smollm2, requests):
    for request in requests:
        full = execute(smollm2, create_method({"name": "full"}), request, BudgetConfig(), Profile())
        blend = execute(
            smollm2, create_method({"name": "cacheblend", "recompute_ratio": 1.0}), request, BudgetConfig(), Profile()
        )
        assert blend.tokens == full.tokens and len(full.tokens) == request.max_new_tokens
        assert blend.telemetry["prefill"]["recompute_per_layer"] == [1.0] * smollm2.spec.n_layers


@pytest.mark.parametrize(
    "method", [["method=full_reuse"], ["method=cacheblend", "method.recompute_ratio=0.15", "method.miss=precompute"]]
)
def test_reuse_runs_through_the_runner_with_the_rag_task(method, tmp_path, smollm2, monkeypatch):
    from kvbench.models import loading

    load = loading.load_model  # the run's model=smollm2_135m is the session's SmolLM2, not a second load of it
    monkeypatch.setattr(loading, "load_model", lambda cfg: smollm2 if cfg["name"] == "smollm2_135m" else load(cfg))
    overrides = [
        "model=smollm2_135m",
        "task=rag",
        *(f"task.{k}={v}" for k, v in TASK.items() if k != "name"),
        f"output_dir={tmp_path}",
        "progress=false",
        *method,
    ]
    run_dir = RunDir(run(compose(overrides)).run_dir)
    records = run_dir.records()
    assert [r["id"] for r in records] == ["musique-0", "musique-1"] and run_dir.state().status == "finished"
    for record in records:
        prefill, n = record["telemetry"]["prefill"], record["meta"]["prompt_tokens"]
        assert 0 <= record["score"] <= 100 and record["telemetry"]["ttft_s"] > 0
        query = record["meta"]["query_tokens"]
        assert prefill["tokens"] == n and prefill["chunks"] == record["meta"]["chunks"] + 1  # the chunks and the prefix
        if method[0] == "method=full_reuse":  # only the query is computed, at every layer
            assert prefill["recompute_per_layer"] == pytest.approx([query / n] * len(prefill["recompute_per_layer"]))
        else:  # every row up to the check layer, then 15 % of the context plus the query
            after = (int(0.15 * (n - query)) + query) / n
            assert prefill["recompute_per_layer"][:2] == [1.0, 1.0]
            assert prefill["recompute_per_layer"][2:] == pytest.approx(
                [after] * (len(prefill["recompute_per_layer"]) - 2)
            )
        assert prefill["reused_tokens"] > 0.5 * n and record["telemetry"]["prepared"]["precompute_s"] >= 0
    first = records[0]["telemetry"]["prepared"]
    assert first["precomputed_chunks"] == records[0]["meta"]["chunks"] + 1 and first["precompute_s"] > 0
    metrics = run_dir.metrics()
    assert (
        metrics["n"] == 2
        and metrics["method"]["family"] == "reuse"
        and metrics["budget"]["label"] == "no budget (reuse)"
    )
