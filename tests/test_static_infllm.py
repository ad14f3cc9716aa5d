"""InfLLM on the static decode step: the positions, tokens and bytes of its earlier implementation.

``tests/legacy_infllm.py`` keeps the pre-conversion decode code; every test here compares the two at every
decode step and layer (the selection digest), across the settings that change the selection: the model's
GQA group (4:1 Llama, 7:1 Qwen2), small blocks that complete during the generation (new representative
keys built at decode steps from the attention the tokens received), ``reps`` from the
extra-communication budget or ``method.reps``, the host tier with its block cache, a budget that takes no
block (``select`` = 0), a budget that takes every block (the dense step) and one that stops taking every
block mid-generation. The last tests check the static properties of a steady step and the state the
static step keeps (representative keys and received attention).
"""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import create_method
from tests.legacy_infllm import LegacyInfLLM
from tests.static_helpers import assert_same_as_legacy, assert_static_step, registered

LEGACY = LegacyInfLLM.name


@pytest.fixture(scope="module", autouse=True)
def _legacy_registered():
    with registered(LegacyInfLLM):
        yield


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "params, budget",
    [
        ({"offload": False, "block_size": 16}, {"tokens": 96, "comm_ratio": 1 / 64}),
        ({"offload": False, "block_size": 32, "reps": 3}, {"tokens": 160, "local": 40}),
        ({"offload": True, "block_size": 16}, {"tokens": 96, "comm_ratio": 1 / 8}),
        ({"offload": True, "block_size": 16, "cache_tokens": 64}, {"token_ratio": 0.2, "comm_ratio": 1 / 16}),
    ],
    ids=["device", "reps3", "offload", "offload_cache"],
)
def test_static_infllm_attends_what_the_earlier_infllm_attended(fixture, params, budget, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    assert_same_as_legacy(loaded, "infllm", LEGACY, random_ids(700, seed=41), n=40, params=params, **budget)


@pytest.mark.parametrize("offload", [False, True])
def test_the_default_blocks_across_a_length_bucket(offload, tiny_llama, random_ids):
    """128-token blocks (none completes in 40 steps) and a generation across the 512-slot bucket boundary."""
    assert_same_as_legacy(
        tiny_llama, "infllm", LEGACY, random_ids(500, seed=42), n=40, params={"offload": offload}, tokens=200
    )


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_that_takes_no_block(offload, tiny_llama, random_ids):
    """``select`` = 0 (the whole budget is the local window): sinks and the tail only, no block built."""
    static, _ = assert_same_as_legacy(
        tiny_llama,
        "infllm",
        LEGACY,
        random_ids(600, seed=43),
        n=40,
        params={"offload": offload, "block_size": 16},
        tokens=64,
        local=64,
    )
    assert static.telemetry["bytes_h2d_index"] == 0


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_that_stops_taking_every_block(offload, tiny_qwen2, random_ids):
    """Every full block taken (the dense step) until a block completes during the generation."""
    static, _ = assert_same_as_legacy(
        tiny_qwen2,
        "infllm",
        LEGACY,
        random_ids(540, seed=44),
        n=40,
        params={"offload": offload, "block_size": 16},
        tokens=540,
        local=32,
    )
    dense = 541  # the first step attends the whole prompt and the current token
    assert static.telemetry["attended_first_step"] == [dense] * tiny_qwen2.spec.n_layers
    assert all(a < dense + 20 for a in static.telemetry["attended_per_layer"])


def test_a_covering_budget_is_the_dense_step(tiny_llama, random_ids):
    assert_same_as_legacy(tiny_llama, "infllm", LEGACY, random_ids(500, seed=45), n=16, tokens=600)


def test_a_steady_step_is_static(tiny_llama, random_ids):
    assert_static_step(tiny_llama, "infllm", random_ids(700, seed=46), {"offload": False}, tokens=96, comm_ratio=1 / 64)


def _state(loaded, name: str, ids: list[int], **budget):
    method = create_method({"name": name, "offload": False, "block_size": 16})
    out = generate(loaded, method, ids, max_new_tokens=40, min_new_tokens=40, budget=BudgetConfig(**budget))
    layers = range(loaded.spec.n_layers)
    built = [method._block_keys[layer].shape[1] if name == LEGACY else method._built[layer] for layer in layers]
    blocks = [method._block_keys[layer][:, : built[layer]] for layer in layers]
    received = [method._received[layer][:, : len(ids) + 40] for layer in layers]
    return out, built, blocks, received


def test_the_state_follows_the_earlier_state(tiny_llama, random_ids):
    """The blocks built and, to float rounding, their representative keys and the attention received.

    Not bit for bit: a padded selection's attention (SDPA over the masked, fixed-width selection) rounds
    differently from the earlier exact-width one, and so do the queries and keys of the later layers and
    tokens. The representative keys of blocks made of prompt tokens from the prefill's attention alone
    are exact."""
    ids = random_ids(700, seed=47)
    budget = {"tokens": 40, "local": 8, "comm_ratio": 1 / 8}  # blocks of generated tokens complete too
    static, built, blocks, received = _state(tiny_llama, "infllm", ids, **budget)
    earlier, old_built, old_blocks, old_received = _state(tiny_llama, LEGACY, ids, **budget)
    assert static.tokens == earlier.tokens
    assert built == old_built and built[0] > (700 - 32 - 8) // 16
    for new, old in zip(blocks, old_blocks):
        assert torch.equal(new[:, :41], old[:, :41])  # (the prompt's blocks, built at the first step)
        torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-5)
    for new, old in zip(received, old_received):
        torch.testing.assert_close(new, old, rtol=1e-4, atol=1e-5)
