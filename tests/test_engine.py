"""The engine and the three foundation methods: equivalence, invariants, guards."""

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate, teacher_force
from kvbench.engine.protocol import Selection
from kvbench.errors import CompressionNotApplied, ContextTooLongError
from kvbench.methods import create_method, register
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.profile import Profile

NEW = 24


def hf_greedy(loaded, ids, n=NEW):
    out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def run(loaded, name, ids, n=NEW, profile=None, **budget):
    return generate(
        loaded,
        create_method({"name": name}),
        ids,
        max_new_tokens=n,
        min_new_tokens=n,
        budget=BudgetConfig(**budget),
        profile=profile,
    )


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_full_is_token_identical_to_model_generate(fixture, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(300, seed=1)
    expected = hf_greedy(loaded, ids)
    assert len(set(expected)) > 3, "the reference output should vary, or the test has no teeth"
    assert run(loaded, "full", ids).tokens == expected


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_small_budget_changes_the_output_and_attends_exactly_the_budget(fixture, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(600, seed=3)
    reference = run(loaded, "full", ids).tokens
    oracle = run(loaded, "oracle", ids, token_ratio=0.1)
    b = oracle.budget
    assert (b.sink, b.budget) == (32, int(0.1 * (600 - 32)))
    # every layer, every step: sink + local + top-k + the current token
    assert all(a == b.total + 1 for a in oracle.telemetry["attended_per_layer"])
    stream = run(loaded, "streamingllm", ids, token_ratio=0.1)
    s = stream.budget
    assert s.sink == 4 and s.local == int(0.1 * (600 - 4)) and s.select == 0
    assert stream.telemetry["kept_per_layer"] == [s.total] * loaded.spec.n_layers
    assert all(a == s.total + 1 for a in stream.telemetry["attended_per_layer"])
    assert stream.telemetry["kv_bytes_ratio"] == pytest.approx(s.total / 600)
    assert oracle.tokens != reference or stream.tokens != reference


def test_oracle_recall_is_one_and_streaming_window_is_what_it_keeps(tiny_llama, random_ids):
    ids = random_ids(500, seed=4)
    # the earlier, chosen-part rule (the default is now the attended-set rule: tests/test_recall.py)
    out = run(tiny_llama, "oracle", ids, n=8, profile=Profile(recall=True, recall_rule="softmax_sum"), token_ratio=0.1)
    assert out.telemetry["recall"] == pytest.approx(1.0)
    assert all(r == pytest.approx(1.0) for r in out.telemetry["recall_per_layer"])


def test_oracle_selects_the_exact_top_k_of_a_planted_pattern(tiny_llama, random_ids):
    """Make layer-0 keys at chosen positions align with every query: the oracle must pick them."""
    loaded = tiny_llama
    method = create_method({"name": "oracle"})
    planted = [100, 150, 222, 333]
    seen: list[torch.Tensor] = []

    original = method.select

    def spy(layer, query, kv):
        if layer == 0 and not seen:
            # overwrite the keys of the planted slots with a huge multiple of the query group mean
            q = query[0, :, 0, :].view(kv.n_kv_heads, -1, kv.head_dim).mean(dim=1)
            for slot in planted:
                kv.keys[:, slot] = 50 * q / q.norm(dim=-1, keepdim=True)
            sel = original(layer, query, kv)
            seen.append(sel.selected)
            return sel
        return original(layer, query, kv)

    method.select = spy
    generate(loaded, method, random_ids(400, seed=5), max_new_tokens=2, budget=BudgetConfig(tokens=8, local=4))
    chosen = seen[0]
    assert chosen.shape == (loaded.spec.n_kv_heads, 4)
    assert all(row == planted for row in chosen.tolist())


class _Lazy(RetrievalMethod):
    """A broken retrieval method that attends everything while asked to compress."""

    name = "_lazy_for_test"

    def select(self, layer, query, kv):
        return Selection(slots=torch.arange(kv.n).expand(kv.n_kv_heads, -1))


class _LazyEvictor(EvictionMethod):
    """A broken eviction method that keeps everything."""

    name = "_lazy_evictor_for_test"


def test_silent_compression_failures_are_loud(tiny_llama, random_ids):
    register(_Lazy)
    register(_LazyEvictor)
    ids = random_ids(200, seed=6)
    for name in (_Lazy.name, _LazyEvictor.name):
        with pytest.raises(CompressionNotApplied, match="attended all|kept all"):
            generate(
                tiny_llama,
                create_method({"name": name}),
                ids,
                max_new_tokens=4,
                min_new_tokens=4,
                budget=BudgetConfig(token_ratio=0.1),
            )


def test_context_longer_than_the_model_is_an_error(tiny_llama):
    with pytest.raises(ContextTooLongError, match="maximum"):
        generate(tiny_llama, create_method({"name": "full"}), [1] * 16380, max_new_tokens=8)


def test_stop_ids_and_min_new_tokens(tiny_llama, random_ids):
    ids = random_ids(100, seed=7)
    free = run(tiny_llama, "full", ids, n=12).tokens
    stop = free[3]
    first = free.index(stop)
    out = generate(tiny_llama, create_method({"name": "full"}), ids, max_new_tokens=12, stop_ids=[stop])
    assert out.stop_reason == "stop" and out.tokens == free[: first + 1]
    late = generate(
        tiny_llama, create_method({"name": "full"}), ids, max_new_tokens=12, stop_ids=[stop], min_new_tokens=first + 1
    )
    assert len(late.tokens) > first + 1


def test_teacher_forced_full_matches_the_model_loss(tiny_llama, random_ids):
    ids = random_ids(160, seed=8)
    nll = teacher_force(tiny_llama, create_method({"name": "full"}), ids[:100], ids[100:]).nll
    with torch.no_grad():
        logits = tiny_llama.model(torch.tensor([ids], device=tiny_llama.model.device)).logits[0, 99:-1].float().cpu()
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[100:]), reduction="none")
    assert torch.allclose(torch.tensor(nll), expected, atol=1e-4)


def test_timings_are_recorded(tiny_llama, random_ids):
    out = run(tiny_llama, "full", random_ids(200), n=6)
    t = out.telemetry
    assert t["ttft_s"] > 0 and t["tt2t_s"] > t["ttft_s"] and t["tpot_s"] > 0
    assert t["decode_steps"] == 5 and t["new_tokens"] == 6
    assert t["fetch_s"] == 0 and t["bytes_h2d_kv_per_step"] == 0  # full neither selects nor fetches
    assert 0 < t["compute_s"] <= t["decode_s"]


def test_stop_texts_cut_the_output_and_change_nothing_before(tiny_llama, random_ids):
    ids = random_ids(120, seed=9)
    free = run(tiny_llama, "full", ids, n=20)
    text = free.text
    marker = text[6:9]
    assert marker and text.find(marker) == 6
    out = generate(tiny_llama, create_method({"name": "full"}), ids, max_new_tokens=20, stop_texts=[marker])
    assert out.stop_reason == "stop_text" and out.text == text[:6]
    assert free.tokens[: len(out.tokens)] == out.tokens


@pytest.mark.parametrize("t", [5, 97, 300])
def test_rows_attending_held_keys_match_exact_attention(t):
    """attention.with_past (blocked by position when the keys are in position order, one rectangle
    otherwise) equals softmax attention written out, GQA included, for rows spread over the prompt."""
    from kvbench.engine import attention

    gen = torch.Generator().manual_seed(t)
    n, heads, kv_heads, d = 400, 6, 2, 16
    keys, values = torch.randn(kv_heads, n, d, generator=gen), torch.randn(kv_heads, n, d, generator=gen)
    rows = torch.sort(torch.randperm(n, generator=gen)[:t]).values[torch.randperm(t, generator=gen)]  # unsorted rows
    query = torch.randn(1, heads, t, d, generator=gen)
    positions = torch.arange(n)

    def exact(key_positions):
        k = keys.repeat_interleave(heads // kv_heads, 0)
        v = values.repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("htd,hnd->htn", query[0], k) * 0.25
        scores = scores.masked_fill(key_positions[None, None, :] > rows[None, :, None], float("-inf"))
        return torch.einsum("htn,hnd->thd", scores.softmax(-1), v)[None]

    blocked = attention.with_past(query, keys, values, positions, rows, 0.25)
    torch.testing.assert_close(blocked, exact(positions), atol=1e-5, rtol=1e-4)
    shuffle = torch.randperm(n, generator=gen)  # keys not in position order: the one-rectangle path
    held = attention.with_past(query, keys[:, shuffle], values[:, shuffle], positions[shuffle], rows, 0.25)
    torch.testing.assert_close(held, exact(positions), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("t", [100, 200, 399])
def test_a_query_suffix_over_its_whole_prefix_matches_exact_attention(t):
    """The prefix-cache shape (queries at the last t positions, keys at 0..n-1): with t >= n - t it runs
    the padded causal kernel and equals the dense causal prefill's last rows bit for bit; with a longer
    prefix it takes the blocked path. Either way it equals softmax attention written out."""
    import torch.nn.functional as F

    from kvbench.engine import attention

    gen = torch.Generator().manual_seed(t)
    n, heads, kv_heads, d = 400, 6, 2, 16
    keys, values = torch.randn(kv_heads, n, d, generator=gen), torch.randn(kv_heads, n, d, generator=gen)
    every = torch.randn(1, heads, n, d, generator=gen)
    positions, rows = torch.arange(n), torch.arange(n - t, n)
    assert attention._is_causal_suffix(positions, rows) == (2 * t >= n)
    assert not attention._is_causal_suffix(positions + 1, rows + 1)  # keys must start at position 0
    assert not attention._is_causal_suffix(positions, rows.flip(0))  # rows in order
    out = attention.with_past(every[:, :, n - t :], keys, values, positions, rows, 0.25)
    k, v = keys.repeat_interleave(heads // kv_heads, 0), values.repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("htd,hnd->htn", every[0, :, n - t :], k) * 0.25
    scores = scores.masked_fill(positions[None, None, :] > rows[None, :, None], float("-inf"))
    torch.testing.assert_close(out, torch.einsum("htn,hnd->thd", scores.softmax(-1), v)[None], atol=1e-5, rtol=1e-4)
    dense = F.scaled_dot_product_attention(every, k[None], v[None], is_causal=True, scale=0.25)
    if 2 * t >= n:
        assert torch.equal(out, dense[:, :, n - t :].transpose(1, 2))
