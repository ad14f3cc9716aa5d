"""PyramidKV's per-layer counts are the authors' (KVCache-Factory ``PyramidKVCluster.update_kv``) at every
window, pinned against a transcription of their integer arithmetic: with ``C = max_capacity_prompt -
window``, ``min = C // beta``, ``max = 2C - min`` (capped at ``q_len - window``, then ``min = 2C - max``),
``step = (max - min) // (L - 1)``, layer ``l`` keeps its ``max - l·step`` top tokens and the window;
a prompt shorter than ``max_capacity_prompt`` keeps everything and one shorter than ``2C`` the uniform
``C``. kvbench runs without sinks here (the authors' code has none)."""

from __future__ import annotations

import pytest

from kvbench.budget import BudgetConfig
from kvbench.methods.pyramidkv import PyramidKV


def authors_counts(q_len: int, max_capacity_prompt: int, window: int, layers: int, beta: int = 20) -> list[int]:
    """Tokens kept per layer (selected + window) as the authors' code keeps them."""
    c = max_capacity_prompt - window
    min_num = c // beta
    max_num = c * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = c * 2 - max_num
    steps = (max_num - min_num) // (layers - 1)
    if q_len < max_capacity_prompt:
        return [q_len] * layers
    if q_len < c * 2:
        return [c + window] * layers
    return [max_num - layer * steps + window for layer in range(layers)]


@pytest.mark.parametrize("window", [8, 16, 32, 64])
@pytest.mark.parametrize("q_len", [700, 1500, 4096, 16000])
@pytest.mark.parametrize(("capacity", "layers"), [(128, 30), (512, 24), (2048, 32)])
def test_per_layer_counts_are_the_authors(window, q_len, capacity, layers):
    if capacity <= window or q_len < capacity:
        pytest.skip("the authors' code requires max_capacity_prompt > window and keeps a short prompt whole")
    method = PyramidKV({"window": window, "sink": 0})
    budget = method.resolve_budget(BudgetConfig(tokens=capacity), q_len, q_len + 16, layers)
    assert budget.sink == 0 and budget.local == window
    ours = [budget.layer_budget(layer) for layer in range(layers)]
    assert ours == authors_counts(q_len, capacity, window, layers)


def test_the_window_64_case_keeps_a_pyramid():
    """Where kvpress falls back to SnapKV (its own guard, min < window), the authors' code and kvbench
    keep the pyramid: 30 layers, a 4096-token prompt, a 512-token capacity, window 64."""
    method = PyramidKV({"window": 64, "sink": 0})
    budget = method.resolve_budget(BudgetConfig(tokens=512), 4096, 4112, 30)
    counts = [budget.layer_budget(layer) for layer in range(30)]
    assert counts[0] == 448 * 2 - 448 // 20 + 64 and counts[0] > counts[-1]
    assert counts == authors_counts(4096, 512, 64, 30)
