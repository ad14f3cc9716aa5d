import math

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.errors import ConfigError
from kvbench.methods import create_method
from kvbench.profile import Profile
from kvbench.runner import run_sample
from kvbench.tasks import create_task
from kvbench.tasks.pg19 import cumulative_curve

from .conftest import SHARED_DATA


@pytest.fixture
def books(tmp_path):
    (tmp_path / "0001.txt").write_text("It was a dark and stormy night.\r\nThe rain fell. " * 200)
    return tmp_path


def model_nll(loaded, ids, start):
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids], device=loaded.model.device)).logits[0].float().cpu()
    return torch.nn.functional.cross_entropy(logits[start - 1 : -1], torch.tensor(ids[start:]), reduction="none")


def test_sweep_full_perplexity_is_the_models_own_loss(tiny_llama, books):
    task = create_task({"name": "pg19", "data_dir": str(books), "lengths": [300], "prefix": 40, "eval_every": 50})
    sample = next(iter(task.samples(tiny_llama)))
    result = run_sample(task, sample, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    expected = model_nll(tiny_llama, sample.input_ids, 40)
    assert len(result.prediction["nll"]) == 260
    assert torch.allclose(torch.tensor(result.prediction["nll"]), expected, atol=1e-3)
    assert result.score == pytest.approx(math.exp(expected.mean().item()), rel=1e-4)
    assert [p for p, _ in result.prediction["curve"]][:2] == [89, 139] and result.prediction["curve"][-1][0] == 299
    assert "\r" not in tiny_llama.tokenizer.decode(sample.input_ids)


def test_a_budget_changes_perplexity_and_fresh_prefill_samples_positions(tiny_llama, books):
    cfg = {"name": "pg19", "data_dir": str(books), "lengths": [400], "prefix": 20}
    task = create_task(cfg)
    sample = next(iter(task.samples(tiny_llama)))
    full = run_sample(task, sample, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    stream = run_sample(
        task, sample, tiny_llama, create_method({"name": "streamingllm"}), BudgetConfig(tokens=64), Profile()
    )
    assert stream.score != full.score
    # sink 4 + window 64 = 68 held tokens: decode step i attends the prefix (20) + i tokens, all of them
    # until step 50, the first after an eviction
    assert stream.prediction["nll"][:50] == full.prediction["nll"][:50]
    assert stream.prediction["nll"][50] != full.prediction["nll"][50]
    fresh = create_task({**cfg, "mode": "fresh_prefill", "eval_every": 100})
    out = run_sample(fresh, sample, tiny_llama, create_method({"name": "full"}), BudgetConfig(), Profile())
    assert out.meta["scored_tokens"] == 4  # positions 20, 120, 220, 320
    expected = model_nll(tiny_llama, sample.input_ids, 1)
    assert out.prediction["nll"] == pytest.approx([expected[i - 1].item() for i in (21, 121, 221, 321)], abs=1e-3)


def test_curve_and_aggregate():
    assert cumulative_curve([5, 6, 7], [0.0, math.log(4), math.log(4)], 2) == [[6, 2.0], [7, round(4 ** (2 / 3), 4)]]
    task = create_task({"name": "pg19", "data_dir": "."})
    records = [
        {"subset": "len8", "prediction": {"nll": [0.0, math.log(9)]}},
        {"subset": "len9", "prediction": {"nll": [0.0]}},
    ]
    metrics = task.aggregate(records)
    assert metrics["per_subset"] == {"len8": 3.0, "len9": 1.0} and metrics["score"] == pytest.approx(
        9 ** (1 / 3), abs=1e-3
    )


def test_bad_options():
    with pytest.raises(ConfigError):
        create_task({"name": "pg19", "lengths": [10], "prefix": 10})
    with pytest.raises(ConfigError, match="no question"):
        create_task({"name": "pg19", "question_position": "start"})


@pytest.mark.integration
@pytest.mark.skipif(not (SHARED_DATA / "pg19").exists(), reason="needs ../shared/data/pg19")
def test_book_10146_on_smollm2(smollm2):
    task = create_task({"name": "pg19", "data_dir": str(SHARED_DATA / "pg19"), "lengths": [256], "prefix": 1})
    sample = next(iter(task.samples(smollm2)))
    result = run_sample(task, sample, smollm2, create_method({"name": "full"}), BudgetConfig(), Profile())
    expected = model_nll(smollm2, sample.input_ids, 1)
    assert torch.allclose(torch.tensor(result.prediction["nll"]), expected, atol=2e-3)
    assert 2 < result.score < 100


def test_comparison_figure_overlays_the_runs_curves(tmp_path):
    from kvbench.errors import ConfigError
    from kvbench.tasks import REGISTRY

    record = {"id": "book-len64", "prediction": {"curve": [[16, 30.0], [32, 25.0], [63, 22.0]]}}
    slower = {"id": "book-len64", "prediction": {"curve": [[16, 30.0], [32, 40.0], [63, 45.0]]}}
    out = REGISTRY.get("pg19").comparison_figure([("full", [record]), ("streamingllm", [slower])], tmp_path / "c.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="no comparison figure"):
        REGISTRY.get("gsm8k_cot").comparison_figure([("full", [])], tmp_path / "g.png")
