"""The reuse family on the per-layer prefill plan: re-rotation, equivalences, invariants, the chunk store."""

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate, prefill_kv
from kvbench.engine.rope import rerotate
from kvbench.errors import ConfigError
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkStore, StoreConfig
from kvbench.methods import create_method
from kvbench.models.loading import load_model
from kvbench.requests import Segment, join_segments

from .conftest import model_config

NEW = 12


def segmented(random_ids, sizes=(6, 40, 50, 45, 12), seed=0, bos=None):
    """prefix, chunks..., query segments of random ids (the prefix starts with ``bos`` when given)."""
    ids = random_ids(sum(sizes), seed=seed)
    if bos is not None:
        ids[0] = bos
    out, at = [], 0
    roles = ["prefix"] + ["chunk"] * (len(sizes) - 2) + ["query"]
    for size, role in zip(sizes, roles):
        out.append(Segment(tuple(ids[at : at + size]), role))
        at += size
    return tuple(out)


def run(loaded, name, segments, store=None, n=NEW, **cfg):
    if name == "cacheblend":  # chunks precomputed before the request (miss: prefill: test_cacheblend_miss.py)
        cfg = {"miss": "precompute", **cfg}
    method = create_method({"name": name, **cfg})
    if store is not None:
        method.attach_store(store)
    ids = join_segments(segments)
    return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, segments=segments, budget=BudgetConfig())


# ---------------------------------------------------------------------- re-rotation
def _layer0_keys(loaded, ids, start):
    """Layer-0 post-RoPE keys of ``ids`` placed at positions ``start..`` (computed directly, no reuse)."""
    model = loaded.model
    layer = model.model.layers[0]
    hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids], device=loaded.device)))
    attn = layer.self_attn
    k = attn.k_proj(hidden).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, "k_norm"):
        k = attn.k_norm(k)
    positions = torch.arange(start, start + len(ids), device=loaded.device).view(1, -1)
    cos, sin = model.model.rotary_emb(k, positions)
    import sys

    apply = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    return apply(k, k, cos, sin)[1][0]


ROPE_CONFIGS = {
    "default": {},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}


@pytest.mark.parametrize("rope", sorted(ROPE_CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_rerotated_keys_equal_keys_computed_at_the_target_positions(arch, rope, random_ids):
    cfg = model_config("tiny_llama", arch=arch)
    cfg["config"] = {**cfg["config"], "num_hidden_layers": 1, **ROPE_CONFIGS[rope]}
    loaded = load_model(cfg)
    ids = random_ids(64, seed=11)
    with torch.no_grad():
        here = _layer0_keys(loaded, ids, 3)
        there = _layer0_keys(loaded, ids, 7000)
        moved = rerotate(loaded.model, here, 7000 - 3)
        back = rerotate(loaded.model, there, torch.full((64,), 3 - 7000))
    # fp32 angles at position 7000 carry ~4e-4 rad of rounding on either path: tolerance ~1e-3 of |k|
    off_by_one = rerotate(loaded.model, here, 7000 - 3 + 1)
    assert not torch.allclose(off_by_one, there, atol=3e-2), "a wrong delta must fail, or the test has no teeth"
    assert torch.allclose(moved, there, atol=3e-3, rtol=1e-3)
    assert torch.allclose(back, here, atol=3e-3, rtol=1e-3)


def test_llama31_8b_shape_rope_scaling_rerotates(random_ids):
    """The real Llama-3.1-8B RoPE (llama3 scaling, theta 5e5, d_h 128) with small random weights."""
    cfg = model_config("llama31_8b_shape")
    cfg["config"] = {
        **cfg["config"],
        "num_hidden_layers": 1,
        "hidden_size": 256,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 300,
    }
    loaded = load_model(cfg)
    assert loaded.model.model.rotary_emb.rope_type == "llama3" and loaded.spec.head_dim == 128
    ids = random_ids(32, seed=12)
    with torch.no_grad():
        moved = rerotate(loaded.model, _layer0_keys(loaded, ids, 1), 100_000)
        there = _layer0_keys(loaded, ids, 100_001)
    assert torch.allclose(moved, there, atol=2e-2, rtol=1e-3)  # fp32 angles at 1e5 lose ~6e-3 rad
    assert not torch.allclose(rerotate(loaded.model, _layer0_keys(loaded, ids, 1), 100_001), there, atol=2e-1)


def test_layer0_of_a_chunk_prefilled_alone_moves_to_its_place_in_the_prompt(tiny_llama, random_ids):
    prefix, chunk = random_ids(30, seed=13), random_ids(50, seed=14)
    alone_k, alone_v = prefill_kv(tiny_llama, chunk)
    whole_k, whole_v = prefill_kv(tiny_llama, prefix + chunk)
    moved = rerotate(tiny_llama.model, alone_k[0], 30)
    assert torch.allclose(moved, whole_k[0][:, 30:], atol=1e-4)
    assert torch.allclose(alone_v[0], whole_v[0][:, 30:], atol=1e-5)  # layer-0 V has no position
    assert not torch.allclose(alone_v[1], whole_v[1][:, 30:], atol=1e-3)  # deeper layers see the prefix


# ---------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_cacheblend_recomputing_everything_is_token_identical_to_full(fixture, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    segments = segmented(random_ids, seed=1)
    full = run(loaded, "full", segments)
    assert len(set(full.tokens)) > 3, "the reference output should vary"
    blend = run(loaded, "cacheblend", segments, recompute_ratio=1.0)
    assert blend.tokens == full.tokens
    assert blend.telemetry["prefill"]["recompute_per_layer"] == [1.0] * loaded.spec.n_layers


@pytest.mark.parametrize("name,cfg", [("full_reuse", {}), ("cacheblend", {"recompute_ratio": 0.0})])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_reusing_a_single_chunk_at_the_start_is_token_identical_to_full(fixture, name, cfg, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    ids = random_ids(120, seed=2)
    segments = (Segment(tuple(ids[:100]), "chunk"), Segment(tuple(ids[100:]), "query"))
    full = run(loaded, "full", segments)
    out = run(loaded, name, segments, chunk_bos=False, **cfg)
    assert out.telemetry["prefill"]["reused_tokens"] == 100
    assert out.tokens == full.tokens


def test_full_reuse_of_several_chunks_changes_the_output_and_computes_only_the_query(tiny_llama, random_ids):
    segments = segmented(random_ids, seed=3)
    full = run(tiny_llama, "full", segments)
    reuse = run(tiny_llama, "full_reuse", segments)
    n = len(join_segments(segments))
    assert reuse.telemetry["prefill"]["recompute_per_layer"] == [12 / n] * tiny_llama.spec.n_layers
    assert reuse.telemetry["prefill"]["reused_tokens"] == n - 12
    assert reuse.tokens != full.tokens, "chunks precomputed alone lose their cross-attention"


def test_prefix_cache_is_exact_and_reuses_the_prefix_and_first_chunk(tiny_llama, random_ids):
    segments = segmented(random_ids, seed=4)
    full = run(tiny_llama, "full", segments)
    cached = run(tiny_llama, "prefix_cache", segments)
    assert cached.tokens == full.tokens
    assert cached.telemetry["prefill"]["reused_tokens"] == 6 + 40
    only_prefix = run(tiny_llama, "prefix_cache", segments, warm="prefix")
    assert only_prefix.telemetry["prefill"]["reused_tokens"] == 6 and only_prefix.tokens == full.tokens


def test_cacheblend_recomputes_the_ratio_after_its_check_layer_and_the_query_always(tiny_llama, random_ids):
    segments = segmented(random_ids, seed=5)
    n = len(join_segments(segments))
    n_ctx = n - 12
    out = run(tiny_llama, "cacheblend", segments, recompute_ratio=0.25)
    per_layer = out.telemetry["prefill"]["recompute_per_layer"]
    expected_after = (int(n_ctx * 0.25) + 12) / n
    assert per_layer == [1.0, 1.0] + [expected_after] * (tiny_llama.spec.n_layers - 2)
    full = run(tiny_llama, "full", segments)
    reuse = run(tiny_llama, "full_reuse", segments)

    def agree(a, b):
        return sum(x == y for x, y in zip(a.tokens, b.tokens))

    assert agree(out, full) >= agree(reuse, full)


def test_gradual_filtering_narrows_nested_sets(tiny_llama, random_ids):
    segments = segmented(random_ids, seed=6)
    n = len(join_segments(segments))
    n_ctx = n - 12
    out = run(tiny_llama, "cacheblend", segments, filter_ratios=[0.6, 0.4, 0.2])
    per_layer = out.telemetry["prefill"]["recompute_per_layer"]
    assert per_layer == [1.0, 1.0] + [(int(n_ctx * r) + 12) / n for r in (0.6, 0.4)]


def test_mask_and_selection_options_change_what_is_computed(tiny_llama, random_ids):
    segments = segmented(random_ids, seed=7)
    base = run(tiny_llama, "cacheblend", segments, n=2, recompute_ratio=0.3)
    code = run(tiny_llama, "cacheblend", segments, n=2, recompute_ratio=0.3, mask="code")
    rand = run(tiny_llama, "cacheblend", segments, n=2, recompute_ratio=0.3, selection="random")
    assert code.telemetry["prefill"]["recompute_per_layer"] == base.telemetry["prefill"]["recompute_per_layer"]
    assert rand.telemetry["prefill"]["recompute_per_layer"] == base.telemetry["prefill"]["recompute_per_layer"]
    exact_full = run(tiny_llama, "cacheblend", segments, n=4, recompute_ratio=1.0, mask="code")
    assert exact_full.tokens == run(tiny_llama, "full", segments, n=4).tokens


# ---------------------------------------------------------------------- errors and guards
def test_reuse_methods_refuse_prompts_without_chunks(tiny_llama, random_ids):
    ids = random_ids(80)
    with pytest.raises(ConfigError, match="not split into chunks"):
        generate(tiny_llama, create_method({"name": "cacheblend"}), ids, max_new_tokens=2)


@pytest.mark.parametrize(
    "bad",
    [
        {"recompute_ratio": 1.5},
        {"recompute_ratio": -0.1},
        {"mask": "fuzzy"},
        {"selection": "best"},
        {"filter_ratios": [0.1, 0.3]},
    ],
)
def test_cacheblend_rejects_bad_parameters(bad):
    with pytest.raises(ConfigError):
        create_method({"name": "cacheblend", **bad})


# ---------------------------------------------------------------------- the chunk store
def _entry(n_tokens, n_layers=3, value=1.0, start=0):
    k = [torch.full((2, n_tokens, 4), float(value + i)) for i in range(n_layers)]
    v = [torch.full((2, n_tokens, 4), float(-value - i)) for i in range(n_layers)]
    return ChunkKV(k, v, start)


def test_ram_tier_evicts_least_recently_used_by_bytes():
    one = _entry(100).nbytes()
    store = ChunkStore(StoreConfig(tier="ram", ram_gb=2.5 * one / 2**30, disk_gb=0))
    keys = [ChunkKey("m", (i,), "alone") for i in range(3)]
    store.put(keys[0], _entry(100, value=0))
    store.put(keys[1], _entry(100, value=1))
    assert store.get(keys[0]) is not None  # 0 is now the most recent
    store.put(keys[2], _entry(100, value=2))
    assert store.contains(keys[1]) is None and store.contains(keys[0]) == "ram" and store.contains(keys[2]) == "ram"
    assert store.stats["ram"].evictions == 1 and store.stats["ram"].hits == 1
    assert store.get(keys[1]) is None and store.stats["ram"].misses == 1


def test_a_request_keeps_its_own_hits_when_storing_its_misses_evicts(tiny_llama, random_ids):
    """A RAM tier exactly one request large: the next request shares the prefix and two chunks and
    brings one new chunk. Storing the new one must evict the old chunk it replaces, not the request's
    own hits that happen to be least recently used (that made a stream run fail with "vanished")."""
    first = segmented(random_ids, seed=11)
    new_chunk = Segment(tuple(random_ids(len(first[1].ids), seed=12)), "chunk")
    second = (first[0], new_chunk, *first[2:])
    sizing = ChunkStore(StoreConfig(tier="ram", disk_gb=0))
    reference = run(tiny_llama, "cacheblend", second, store=sizing)
    exact = ChunkStore(StoreConfig(tier="ram", ram_gb=sizing._ram_bytes / 2**30, disk_gb=0))
    run(tiny_llama, "cacheblend", first, store=exact)
    again = run(tiny_llama, "cacheblend", second, store=exact)
    assert again.tokens == reference.tokens
    assert again.telemetry["prepared"]["precomputed_chunks"] == 1 and exact.stats["ram"].evictions == 1
    too_small = ChunkStore(StoreConfig(tier="ram", ram_gb=sizing._ram_bytes / 2 / 2**30, disk_gb=0))
    with pytest.raises(ConfigError, match=r"cannot hold one request's 4 chunk caches.*raise store.ram_gb"):
        run(tiny_llama, "cacheblend", second, store=too_small)


def test_disk_tier_round_trips_and_evicts(tmp_path):
    one_file = None
    store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path), disk_gb=1.0))
    key = ChunkKey("m", (1, 2, 3), "bos")
    entry = _entry(50, start=1)
    store.put(key, entry)
    one_file = next(tmp_path.rglob("*.safetensors")).stat().st_size
    reloaded = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path), disk_gb=1.0)).get(key)
    assert reloaded is not None and reloaded.start == 1
    assert all(torch.equal(a, b) for a, b in zip(reloaded.keys + reloaded.values, entry.keys + entry.values))
    small = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path / "s"), disk_gb=2.5 * one_file / 2**30))
    keys = [ChunkKey("m", (i,), "alone") for i in range(3)]
    for i, k in enumerate(keys):
        small.put(k, _entry(50, value=i))
    assert small.contains(keys[0]) is None and small.contains(keys[2]) == "disk"
    assert small.stats["disk"].evictions == 1


def test_throttled_disk_reads_take_at_least_bytes_over_rate(tmp_path):
    store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path), read_mbps=2.0))
    key = ChunkKey("m", (7,), "alone")
    entry = _entry(400)
    store.put(key, entry)
    assert store.get(key) is not None
    assert store.stats["disk"].load_s >= entry.nbytes() / 2e6 * 0.95
    assert store.stats["disk"].bytes_loaded == entry.nbytes()


def test_cacheblend_from_disk_equals_cacheblend_from_ram(tiny_llama, random_ids, tmp_path):
    segments = segmented(random_ids, seed=8)
    ram = run(tiny_llama, "cacheblend", segments, store=ChunkStore(StoreConfig(tier="ram")))
    disk_store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path)))
    disk = run(tiny_llama, "cacheblend", segments, store=disk_store)
    assert disk.tokens == ram.tokens
    assert disk_store.stats["disk"].hits == 4 and disk_store.stats["disk"].bytes_loaded > 0
    assert disk.telemetry["prepared"]["precomputed_chunks"] == 4
    again = run(tiny_llama, "cacheblend", segments, store=disk_store)
    assert again.telemetry["prepared"]["precomputed_chunks"] == 0 and again.tokens == ram.tokens


def test_profile_deviation_measures_reuse_against_a_full_prefill(tiny_llama, random_ids):
    from kvbench.profile import Profile

    segments = segmented(random_ids, seed=9)
    ids = join_segments(segments)

    def deviation(name, **cfg):
        out = generate(
            tiny_llama,
            create_method({"name": name, **cfg, **({"miss": "precompute"} if name == "cacheblend" else {})}),
            ids,
            max_new_tokens=2,
            segments=segments,
            budget=BudgetConfig(),
            profile=Profile(deviation=True),
        )
        return out.telemetry["prefill"]["deviation"]

    exact = deviation("cacheblend", recompute_ratio=1.0)
    reuse = deviation("full_reuse")
    blend = deviation("cacheblend", recompute_ratio=0.3)
    layers = tiny_llama.spec.n_layers
    assert len(reuse["reused_kv_quantiles"]) == layers and len(reuse["spearman"]) == layers - 1
    assert reuse["reused_kv_mean"][0] < 1e-8 < reuse["reused_kv_mean"][1]  # layer 0 cannot deviate
    assert exact["attention_mean"] < 1e-4 and max(exact["blended_kv_mean"]) < 1e-6  # recompute all = full
    assert reuse["attention_mean"] > blend["attention_mean"] > exact["attention_mean"]
    assert all(-1 <= r <= 1 for r in reuse["spearman"] if r is not None)


def test_spearman_matches_scipy_with_ties_and_is_undefined_for_constants():
    scipy = pytest.importorskip("scipy.stats")
    from kvbench.engine.reuse_deviation import _spearman

    a = torch.tensor([1.0, 2, 2, 3, 5, 5, 5, 0, 7])
    b = torch.tensor([3.0, 1, 4, 1, 5, 9, 2, 6, 5])
    assert _spearman(a, b) == pytest.approx(scipy.spearmanr(a, b).statistic, abs=1e-12)
    assert _spearman(torch.zeros(6), b[:6]) is None  # layer 0: no deviation to rank
