"""SparQ on the static decode step: the positions, tokens and bytes of its earlier implementation.

``tests/legacy_sparq.py`` keeps the pre-conversion ``select``; every test here compares the two at every
decode step and layer (the selection digest), across the settings that change the selection: the model's
GQA group (4:1 Llama, 7:1 Qwen2), ``r`` from the extra-communication budget or ``method.r``, the budget,
the host tier with and without a block cache, a generation that crosses a length bucket, and a budget
that covers the cache (the dense step). The last test checks the static properties of a steady step.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.sparq import sparq_scores
from tests.legacy_sparq import LegacySparQ
from tests.legacy_sparq import sparq_scores as earlier_scores
from tests.static_helpers import assert_same_as_legacy, assert_static_step, registered

LEGACY = LegacySparQ.name


@pytest.fixture(scope="module", autouse=True)
def _legacy_registered():
    with registered(LegacySparQ):
        yield


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "params, budget",
    [
        ({"offload": False}, {"tokens": 96, "comm_ratio": 1 / 64}),
        ({"offload": False, "r": 5}, {"tokens": 160}),
        ({"offload": True}, {"tokens": 96, "comm_ratio": 1 / 128}),
        ({"offload": True, "cache_tokens": 128, "cache_block": 16}, {"token_ratio": 0.2, "comm_ratio": 1 / 64}),
    ],
    ids=["device", "r5", "offload", "offload_cache"],
)
def test_static_sparq_attends_what_the_earlier_sparq_attended(fixture, params, budget, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    assert_same_as_legacy(loaded, "sparq", LEGACY, random_ids(700, seed=31), n=24, params=params, **budget)


@pytest.mark.parametrize("offload", [False, True])
def test_a_generation_across_a_length_bucket(offload, tiny_llama, random_ids):
    """A 500-token prompt and 40 new tokens cross the 512-slot bucket boundary mid-generation."""
    assert_same_as_legacy(
        tiny_llama, "sparq", LEGACY, random_ids(500, seed=32), n=40, params={"offload": offload}, tokens=64
    )


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_that_becomes_selective_during_the_generation(offload, tiny_llama, random_ids):
    """A budget that covers the prompt and stops covering it after a few new tokens: dense steps, then
    selective ones (the regime changes mid-generation)."""
    ids = random_ids(600, seed=33)
    static, _ = assert_same_as_legacy(
        tiny_llama, "sparq", LEGACY, ids, n=30, params={"offload": offload}, tokens=584, local=8
    )
    assert static.telemetry["attended_first_step"] == [601] * tiny_llama.spec.n_layers  # dense at first
    assert all(a < 615 for a in static.telemetry["attended_per_layer"])  # (dense: 601..629, mean 615)


def test_a_covering_budget_is_the_dense_step(tiny_qwen2, random_ids):
    assert_same_as_legacy(tiny_qwen2, "sparq", LEGACY, random_ids(500, seed=34), n=16, tokens=600)


def test_a_steady_step_is_static(tiny_llama, random_ids):
    assert_static_step(tiny_llama, "sparq", random_ids(700, seed=35), {"offload": False}, tokens=96, comm_ratio=1 / 64)


@pytest.mark.parametrize("r", [1, 2, 5])
def test_the_scores_are_the_earlier_scores_bit_for_bit(r):
    """Same components (ties included: equal magnitudes), same scores; keys in bf16 give the scores of
    the same keys converted to float32 first."""
    generator = torch.Generator().manual_seed(r)
    query = torch.randn(2, 4, 16, generator=generator)
    query[0, :, :8] = 1.0  # eight components of equal magnitude: topk's tie rule decides
    keys = torch.randn(2, 300, 16, generator=generator)
    scores, components = sparq_scores(query, keys, r)
    old_scores, old_components = earlier_scores(query, keys, r)
    assert torch.equal(components, old_components) and torch.equal(scores, old_scores)
    low = keys.bfloat16()
    assert torch.equal(sparq_scores(query, low, r)[0], earlier_scores(query, low.float(), r)[0])
