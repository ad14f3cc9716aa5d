import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import create_method
from kvbench.methods.pqcache import default_pq
from kvbench.profile import Profile


def first_step_selection(loaded, cfg, ids, budget, layer=1):
    method = create_method(cfg)
    captured = []
    original = method.select

    def spy(index, query, kv):
        sel = original(index, query, kv)
        if index == layer and not captured:
            captured.append(sel.selected.cpu().clone())  # (host tier or device)
        return sel

    method.select = spy
    generate(loaded, method, ids, max_new_tokens=2, budget=budget)
    return captured[0]


@pytest.mark.parametrize("rule", ["logit_sum", "max"])
def test_exact_codes_select_what_the_oracle_selects(tiny_llama, random_ids, rule):
    """m = d_h one-dimensional sub-spaces with more centroids than distinct values: codes are exact."""
    ids = random_ids(200, seed=22)
    budget = BudgetConfig(tokens=60)
    pq = first_step_selection(
        tiny_llama,
        {"name": "pqcache", "m": 32, "b": 8, "kmeans_iters": 30, "init": "kmeans++", "gqa": rule},
        ids,
        budget,
    )
    oracle = first_step_selection(tiny_llama, {"name": "oracle", "gqa": rule}, ids, budget)
    assert torch.equal(pq, oracle)
    coarse = first_step_selection(tiny_llama, {"name": "pqcache", "m": 2, "b": 2, "gqa": rule}, ids, budget)
    assert not torch.equal(coarse, oracle)


def test_budget_bytes_and_cache(tiny_llama, random_ids):
    ids = random_ids(1500, seed=23)
    out = generate(
        tiny_llama,
        create_method({"name": "pqcache", "cache_tokens": 512}),
        ids,
        max_new_tokens=8,
        min_new_tokens=8,
        budget=BudgetConfig(token_ratio=0.2, comm_ratio=1 / 64),
        profile=Profile(recall=True),
    )
    t, b = out.telemetry, out.budget
    assert all(a == b.total + 1 for a in t["attended_per_layer"])
    m, bits = t["method"]["m"], t["method"]["b"]
    assert (m, bits) == default_pq(1 / 64, 32) == (2, 4)
    assert t["method"]["comm_ratio_used"] == pytest.approx(m * bits / (16 * 32))
    # codes of the middle tokens move every step: middle * heads * m * b / 8 bytes per layer and step
    steps = t["decode_steps"]
    middle_first = 1500 + 1 - 1 - b.local - b.sink
    per_step = [(middle_first + i) * 2 * m * bits // 8 for i in range(steps)]
    assert t["bytes_h2d_index"] == sum(per_step) * tiny_llama.spec.n_layers
    assert t["bytes_h2d_index_per_step"] == pytest.approx(t["bytes_h2d_index"] / steps)
    assert t["bytes_h2d_kv_per_step"] == pytest.approx((t["bytes_h2d_fetch"] + t["bytes_h2d_cache_fill"]) / steps)
    # the decode time splits into selection (PQ search), fetch and the rest
    assert t["select_s"] >= t["method"]["pq_search_s"] > 0 and t["fetch_s"] > 0 and t["compute_s"] > 0
    assert t["select_s"] + t["fetch_s"] + t["compute_s"] == pytest.approx(t["decode_s"])
    assert t["cache_lookups"] > 0 and t["hit_rate"] is not None and 0 <= t["hit_rate"] <= 1
    assert 0 < t["recall"] <= 1


def test_default_pq_configs():
    assert default_pq(1 / 128, 128) == (2, 6) and default_pq(1 / 64, 128) == (4, 8)
    assert default_pq(1 / 128, 64) == (2, 4)


def test_adaptive_iterations_follow_the_cost_model(tiny_llama, random_ids, tmp_path, monkeypatch):
    from kvbench.methods.pqcache_cost import iterations_for

    # t_layer = 1e-6 s^2; base3 = 1e-3 s; per_iter = 1e-4 s  ->  T = (1e-6 s^2 - 1e-3 s) / 1e-4 s + 3 = 0.01 s - 7
    fitted = {"layer_coefficients": [1e-6, 0, 0], "base3_coefficients": [1e-3, 0], "per_iter_coefficients": [1e-4, 0]}
    assert iterations_for(fitted, 2000) == 13
    assert iterations_for(fitted, 100) == 3  # clipped below
    assert iterations_for(fitted, 10**6) == 300  # clipped above
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path))
    out = generate(
        tiny_llama,
        create_method({"name": "pqcache", "kmeans_iters": "adaptive"}),
        random_ids(600, seed=24),
        max_new_tokens=3,
        budget=BudgetConfig(token_ratio=0.2, comm_ratio=1 / 64),
    )
    used = out.telemetry["method"]["kmeans_iters"]
    assert 3 <= used <= 300
    device = tiny_llama.spec.device.replace(":", "")  # (the model's device: cpu here, cuda on a GPU)
    assert list((tmp_path / "cost_models").glob(f"tiny_llama-{device}-*.json"))


def test_new_token_codes_are_written_in_place(tiny_llama, random_ids):
    """Decode appends the codes of tokens leaving the local window into one preallocated buffer (no
    per-step reallocation, so a pinned buffer stays pinned on CUDA); the codes equal a fresh encoding
    of the keys, and a buffer that must grow keeps its contents."""
    from kvbench.methods.pqcache import CodeBuffer
    from kvbench.methods.primitives.pq import pq_encode

    method = create_method({"name": "pqcache"})
    generate(
        tiny_llama,
        method,
        random_ids(200, seed=5),
        max_new_tokens=12,
        min_new_tokens=12,
        budget=BudgetConfig(tokens=48, sink=4, local=8),
    )
    checked = 0
    for layer, state in method.layers.items():
        if state.buffer is None:
            continue
        buffer, book = state.buffer, state.book
        assert state.coded_end - 4 == buffer.n > 200 - 8 - 4  # the prompt's middle plus tokens that left the window
        assert buffer.data.shape[1] > buffer.n  # one allocation for the whole generation
        assert book.codes.data_ptr() == buffer.data.data_ptr()
        keys = method.ctx.store[layer].keys[:, 4 : state.coded_end].float()
        fresh = pq_encode(keys, book.centroids, metric=book.metric, phi=book.phi, extra=book.extra)
        assert torch.equal(book.codes.long(), fresh.long())
        checked += 1
    assert checked
    buffer = CodeBuffer(torch.arange(6).view(1, 3, 2), spare=1, pin=False)
    buffer.append(torch.full((1, 4, 2), 9))
    assert buffer.codes.shape == (1, 7, 2) and buffer.codes[0, :3].flatten().tolist() == list(range(6))
    assert buffer.codes[0, 3:].unique().tolist() == [9]
    assert buffer.truncate(2).shape == (1, 2, 2)
