"""The covering-budget contract, for every registered method that compresses.

A budget that holds the whole prompt and every generated token leaves nothing out, so the method must
generate exactly ``full``'s tokens and keep the whole cache. The methods come from the registry (every
class with ``needs_budget``): a method is under the contract the moment it is registered, with no list
to extend. Tiny Llama and tiny Qwen2 (GQA) with random prompts, and the real SmolLM2 on a text prompt.

Reuse methods have their own form of the contract (recomputing every row is ``full``:
``tests/test_recompute_rules.py``, ``tests/test_integration_reuse.py``).
"""

from __future__ import annotations

import pytest

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import REGISTRY, create_method

NEW = 16
PROMPT = 400
COMPRESSING = sorted(name for name in REGISTRY.names() if REGISTRY.get(name).needs_budget)


def test_the_contract_reaches_every_compressing_family():
    families = {REGISTRY.get(name).family for name in COMPRESSING}
    assert families == {"eviction", "retrieval"}, families
    assert len(COMPRESSING) >= 10, COMPRESSING


@pytest.fixture(scope="module")
def full_tokens():
    """``full``'s tokens per model and prompt, generated once for the module."""
    found: dict = {}

    def get(loaded, key, ids, n):
        if key not in found:
            found[key] = generate(loaded, create_method({"name": "full"}), ids, max_new_tokens=n, min_new_tokens=n)
            assert len(set(found[key].tokens)) > 3, "the reference output should vary, or the test has no teeth"
        return found[key].tokens

    return get


def _covered(loaded, name, ids, n):
    return generate(
        loaded,
        create_method({"name": name}),
        ids,
        max_new_tokens=n,
        min_new_tokens=n,
        budget=BudgetConfig(tokens=len(ids) + n),
    )


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("name", COMPRESSING)
def test_a_covering_budget_is_token_identical_to_full(fixture, name, request, random_ids, full_tokens):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(PROMPT, seed=41)
    out = _covered(loaded, name, ids, NEW)
    assert out.tokens == full_tokens(loaded, fixture, ids, NEW)
    assert out.telemetry["kv_bytes_ratio"] == pytest.approx(1.0)  # nothing was evicted


@pytest.mark.integration
@pytest.mark.parametrize("name", COMPRESSING)
def test_a_covering_budget_on_smollm2_is_token_identical_to_full(name, smollm2, full_tokens):
    prompt = ("The quick brown fox jumps over the lazy dog. " * 30) + "Summarise the text above in one sentence."
    ids = smollm2.chat.encode(prompt)
    assert _covered(smollm2, name, ids, 12).tokens == full_tokens(smollm2, "smollm2", ids, 12)
