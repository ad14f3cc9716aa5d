"""The real SmolLM2-135M-Instruct (from its PyPI wheel): equivalence and a needle found."""

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import create_method
from kvbench.runner import run_sample
from kvbench.tasks import create_task

pytestmark = pytest.mark.integration
NEW = 32


@pytest.fixture(scope="module")
def niah_prompt(smollm2):
    task = create_task({"name": "niah", "lengths": [1200], "depths": [0.3]})
    return next(iter(task.samples(smollm2))).input_ids


@pytest.fixture(scope="module")
def full_run(smollm2, niah_prompt):
    """``full``'s NEW tokens on the prompt, generated once for the tests of this module (each compares
    another generation with it; generation is deterministic)."""
    return generate(smollm2, create_method({"name": "full"}), niah_prompt, max_new_tokens=NEW, min_new_tokens=NEW)


def test_full_is_token_identical_to_generate(smollm2, niah_prompt, full_run):
    out = smollm2.model.generate(torch.tensor([niah_prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = out[0, len(niah_prompt) :].tolist()
    assert full_run.tokens == expected
    assert "Dolores Park" in full_run.text


@pytest.mark.parametrize("name", ["oracle", "streamingllm"])
def test_covering_budget_matches_full_and_small_budget_attends_the_budget(smollm2, niah_prompt, full_run, name):
    cover = generate(
        smollm2,
        create_method({"name": name}),
        niah_prompt,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        budget=BudgetConfig(tokens=len(niah_prompt) + NEW),
    )
    assert cover.tokens == full_run.tokens
    small = generate(
        smollm2, create_method({"name": name}), niah_prompt, max_new_tokens=4, budget=BudgetConfig(token_ratio=0.1)
    )
    assert all(a == small.budget.total + 1 for a in small.telemetry["attended_per_layer"])


def test_needle_at_2k_is_found(smollm2):
    task = create_task({"name": "niah", "lengths": [2048], "depths": [0.5]})
    sample = next(iter(task.samples(smollm2)))
    from kvbench.profile import Profile

    result = run_sample(task, sample, smollm2, create_method({"name": "full"}), BudgetConfig(), Profile())
    assert result.score == 100.0
    assert result.telemetry["prompt_tokens"] == 2048
