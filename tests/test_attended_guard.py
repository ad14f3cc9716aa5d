"""The run-time guard on attended counts: a compressing layer that attends more at the first decode step
than its budget allows (sinks + the layer's budget + the current token; whole pages for Quest, whole
blocks and the remainder for InfLLM) fails the run, so a budget the report names is the one that ran."""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.errors import CompressionNotApplied
from kvbench.methods import create_method, method_node

COMPRESSING = [
    "oracle",
    "quest",
    "clusterkv",
    "pqcache",
    "sparq",
    "infllm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "streamingllm",
]
PROMPT = torch.randint(0, 250, (700,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("name", COMPRESSING)
def test_every_compressing_method_attends_within_its_limit(tiny_llama, name, monkeypatch):
    limits: dict[int, int] = {}
    cls = type(create_method(method_node(name)))
    original = cls.attend_limit

    def recording(self, ctx, layer):
        limits[layer] = original(self, ctx, layer)
        return limits[layer]

    monkeypatch.setattr(cls, "attend_limit", recording)
    out = generate(
        tiny_llama, create_method(method_node(name)), PROMPT, max_new_tokens=2, budget=BudgetConfig(tokens=64)
    )
    first = out.telemetry["attended_first_step"]
    assert limits, "the guard ran"
    for layer, limit in limits.items():
        assert first[layer] <= limit
    if name in ("oracle", "pqcache", "sparq", "clusterkv", "h2o", "snapkv"):
        assert all(first[layer] == limit for layer, limit in limits.items())  # token-exact methods: tight


def test_attending_more_than_the_budget_fails_the_run(tiny_llama, monkeypatch):
    cls = type(create_method(method_node("oracle")))
    original = cls.attend_limit
    monkeypatch.setattr(cls, "attend_limit", lambda self, ctx, layer: original(self, ctx, layer) - 1)
    with pytest.raises(CompressionNotApplied, match=r"attended 97 tokens at layer 0's first decode step, more than"):
        generate(
            tiny_llama, create_method(method_node("oracle")), PROMPT, max_new_tokens=2, budget=BudgetConfig(tokens=64)
        )


def test_a_covering_budget_is_not_guarded(tiny_llama):
    out = generate(
        tiny_llama, create_method(method_node("oracle")), PROMPT, max_new_tokens=2, budget=BudgetConfig(tokens=4096)
    )
    assert out.telemetry["attended_first_step"][0] == out.telemetry["available_first_step"][0]
