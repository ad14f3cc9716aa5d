"""The shared dense prefill of a sweep (kvbench/engine/prefill_cache.py).

Every shipped method whose prefill is the dense one is driven from the method registry: its
predictions and what it kept/attended must be identical with and without the cache, the second
generation must be a hit that runs no model layer, and no method's replay may change the cached
tensors the next method reads. Methods that change their prefill never receive a cached one. The
byte caps evict (and refuse) as documented, and the disk tier reloads bit-exact, strides included.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine import prefill_cache
from kvbench.engine.attention import activate
from kvbench.engine.context import GenerationContext
from kvbench.engine.generate import _new_context, generate
from kvbench.engine.prefill import DensePrefill
from kvbench.engine.prefill_cache import PrefillCache, PrefillEntry, PrefillSharing
from kvbench.engine.protocol import KVMethod
from kvbench.errors import ConfigError
from kvbench.methods import REGISTRY, available_methods, create_method
from kvbench.params import Params as NoParams
from kvbench.profile import Profile
from kvbench.shared import Sweep

MB = 1024**2
BUDGET = BudgetConfig(token_ratio=0.1)
NEW = 8
#: parameters that make a method share (PQCache's overlapped k-means keeps its own prefill)
SHARING_CONFIG = {"pqcache": {"overlap": False}}
SHIPPED = [n for n in available_methods() if REGISTRY.get(n).__module__.startswith("kvbench.methods.")]


def method(name: str, **extra) -> KVMethod:
    return create_method({"name": name, **SHARING_CONFIG.get(name, {}), **extra})


SHARING = [n for n in SHIPPED if method(n).shares_prefill]
OWN_PREFILL = [n for n in SHIPPED if not create_method({"name": n}).shares_prefill]


def prompt(n: int = 600, seed: int = 3) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def prefills(monkeypatch):
    """Counts the model prefills that run (shared captures and own prefills alike)."""
    calls: list[str] = []
    original = GenerationContext.run_prefill

    def counted(self, plan):
        calls.append(type(plan).__name__)
        return original(self, plan)

    monkeypatch.setattr(GenerationContext, "run_prefill", counted)
    return calls


def test_the_sharing_rule_follows_the_prefill_plan():
    """Every method with the stock dense plan shares (the issue's list included), every method with its
    own plan does not, and PQCache shares only without k-means overlapped with the prefill."""
    assert {
        "full",
        "oracle",
        "quest",
        "sparq",
        "infllm",
        "pqcache",
        "clusterkv",
        "streamingllm",
        "snapkv",
        "pyramidkv",
        "h2o",
    } <= set(SHARING)
    for name in SHIPPED:
        overrides = type(create_method({"name": name})).prefill_plan is not KVMethod.prefill_plan
        assert not (overrides and method(name).shares_prefill), name
    assert {"cacheblend", "full_reuse", "prefix_cache", "pqcache"} <= set(OWN_PREFILL)


@pytest.fixture(scope="module")
def caches():
    """One cache per model for the whole module: methods reuse the entries earlier methods made."""
    return {}


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("name", SHARING)
def test_shared_prefill_is_token_identical_and_hit(name, model, request, caches, prefills):
    loaded = request.getfixturevalue(model)
    cache = caches.setdefault(model, PrefillCache(ram_bytes=512 * MB, disk_bytes=0))
    ids = prompt()
    own = generate(loaded, method(name), ids, max_new_tokens=NEW, budget=BUDGET)
    assert own.telemetry["prefill_shared"] is False and prefills == ["DensePrefill"]
    shared = PrefillSharing(cache)
    first = generate(loaded, method(name), ids, max_new_tokens=NEW, budget=BUDGET, sharing=shared)
    key = cache.key(loaded, torch.tensor(ids))
    slot = cache._slots[key]
    before = [t.clone() for t in slot.entry.tensors()]
    hits, calls = cache.counts.hits, len(prefills)
    second = generate(loaded, method(name), ids, max_new_tokens=NEW, budget=BUDGET, sharing=shared)
    assert cache.counts.hits == hits + 1 and len(prefills) == calls, "the second generation must not prefill"
    assert second.telemetry["prefill_shared"] is True
    assert prefills[1:] in ([], ["CapturePrefill"])  # a first use of this prompt (or of a statistic) captures
    for shared in (first, second):
        assert shared.tokens == own.tokens
        for figure in ("kept_per_layer", "attended_per_layer", "attended_first_step", "kv_bytes_after_prefill"):
            assert shared.telemetry[figure] == own.telemetry[figure], figure
    after = list(cache._slots[key].entry.tensors())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)), (
        f"{name} changed the shared K/V or statistics in place"
    )
    # the timing rule: the dense time measured when the entry was made, plus this method's own work
    assert second.telemetry["prefill_s"] >= slot.dense_s > 0


def test_statistics_are_computed_once_and_added_to_the_entry(tiny_llama, prefills):
    """A method asking for a statistic the entry lacks misses (its prefill computes it), and the entry
    then serves both the methods without it and the ones with it."""
    cache = PrefillCache(ram_bytes=512 * MB, disk_bytes=0)
    ids = prompt(seed=5)
    shared = PrefillSharing(cache)
    for name in ("full", "snapkv", "oracle", "snapkv", "h2o", "full", "h2o"):
        generate(tiny_llama, method(name), ids, max_new_tokens=2, budget=BUDGET, sharing=shared)
    assert prefills == ["CapturePrefill"] * 3  # full, snapkv's votes, h2o's accumulated attention
    assert (cache.counts.misses, cache.counts.hits, len(cache)) == (3, 4, 1)
    slot = next(iter(cache._slots.values()))
    assert {stat.function.__name__ for stat in slot.stat_s} == {"window_votes", "accumulated_attention"}


def test_a_sweep_anticipates_its_later_methods_statistics(niah_config, tmp_path, prefills):
    """Given the sweep's points, the first method's capture also computes the statistics the later
    methods read (SnapKV's votes, H2O's accumulated attention, InfLLM's local attention received): they
    hit on every prompt, predict what they predict alone, and the first method's ``prefill_s`` counts
    none of those statistics (each is timed apart in the entry)."""
    from kvbench.results import RunDir
    from kvbench.runner import run

    names = ("full", "snapkv", "h2o", "infllm")
    configs = {m: {**niah_config(m, budget__token_ratio=0.1), "output_dir": str(tmp_path / "swept")} for m in names}
    sweep = Sweep.of(list(configs.values()))
    swept = {m: run(configs[m], sweep=sweep) for m in names}
    assert prefills == ["CapturePrefill"] * 4  # full's four prompts, once each
    for m in names[1:]:
        assert swept[m].metrics["prefill_shared"] == 1.0, m
    cache = sweep.prefill_cache()
    entries = [slot.entry for slot in cache._slots.values() if slot.entry is not None]
    assert len(entries) == 4  # in RAM
    for entry in entries:  # every statistic of the sweep, each timed apart from the dense prefill
        assert {stat.function.__name__ for stat in entry.stat_s} == {
            "window_votes",
            "accumulated_attention",
            "received_from_kv_heads",
        }
        assert entry.dense_s > 0
    prefills.clear()
    for m in names[1:]:  # each alone: its own dense prefill, the same predictions
        alone = run({**configs[m], "prefill_cache": False, "output_dir": str(tmp_path / "alone")})
        got = [sorted((r["id"], r["prediction"]) for r in RunDir(x.run_dir).records()) for x in (alone, swept[m])]
        assert got[0] == got[1] and len(got[0]) == 4, m
    cache.clear()


class OwnPlan(KVMethod):
    """A method with its own prefill plan (the dense one, subclassed to record that it ran)."""

    name = "test_own_plan"
    Params = NoParams
    used = 0

    def prefill_plan(self, ctx, input_ids, segments):
        OwnPlan.used += 1
        return DensePrefill(ctx, input_ids, torch.arange(input_ids.numel()))


@pytest.mark.parametrize(
    "make", [lambda: OwnPlan(), lambda: create_method({"name": "pqcache"})], ids=["own_plan", "pqcache_overlap"]
)
def test_a_method_that_changes_its_prefill_never_gets_a_shared_one(make, tiny_llama, prefills):
    cache = PrefillCache(ram_bytes=512 * MB, disk_bytes=0)
    ids = prompt(seed=7)
    shared = PrefillSharing(cache)
    full = generate(tiny_llama, method("full"), ids, max_new_tokens=NEW, sharing=shared)
    lookups = cache.counts.hits + cache.counts.misses
    used = OwnPlan.used
    own = generate(tiny_llama, make(), ids, max_new_tokens=NEW, budget=BUDGET, sharing=shared)
    assert cache.counts.hits + cache.counts.misses == lookups and len(cache) == 1
    assert own.telemetry["prefill_shared"] is False and prefills == ["CapturePrefill", "DensePrefill"]
    if isinstance(make(), OwnPlan):
        assert OwnPlan.used == used + 1 and own.tokens == full.tokens


def fake_entry(megabytes: int, layers: int = 2) -> PrefillEntry:
    per = megabytes * MB // (2 * layers * 4)
    return PrefillEntry(
        keys=[torch.zeros(1, 1, per, 1) for _ in range(layers)],
        values=[torch.zeros(1, 1, per, 1) for _ in range(layers)],
        logits=torch.zeros(1, 0),
        dense_s=1.0,
    )


def test_ram_cap_refuses_within_a_run_and_evicts_earlier_runs_lru():
    cache = PrefillCache(ram_bytes=2 * MB, disk_bytes=0)
    cache.begin_run()
    for key in "abc":
        cache.put(("m", key), fake_entry(1))
    assert cache.tier_of(("m", "c")) is None and cache.counts.refused == 1  # a and b are this run's
    assert cache.get(("m", "a"), (), torch.device("cpu")) is not None  # a: most recently used
    cache.begin_run()
    cache.put(("m", "c"), fake_entry(1))
    assert [cache.tier_of(("m", k)) for k in "abc"] == ["ram", None, "ram"]  # b, least recently used, went
    assert cache.counts.ram_evictions == 1 and cache.held_bytes("ram") <= 2 * MB
    cache.put(("m", "d"), fake_entry(3))  # larger than the cap
    assert cache.tier_of(("m", "d")) is None and cache.held_bytes("ram") == 2 * MB


def test_ram_spills_to_disk_and_disk_evicts_under_its_cap(tmp_path):
    cache = PrefillCache(ram_bytes=1 * MB, disk_bytes=2 * MB, folder=tmp_path)
    cache.begin_run()
    cache.put(("m", "a"), fake_entry(1))
    cache.put(("m", "b"), fake_entry(1))  # RAM holds this run's a: b goes to disk
    assert (cache.tier_of(("m", "a")), cache.tier_of(("m", "b"))) == ("ram", "disk")
    cache.begin_run()
    cache.put(("m", "c"), fake_entry(1))  # a spills to disk beside b
    assert [cache.tier_of(("m", k)) for k in "abc"] == ["disk", "disk", "ram"] and cache.counts.spills == 1
    cache.begin_run()
    cache.put(("m", "d"), fake_entry(1))  # c spills; disk evicts its least recently used (a)
    assert [cache.tier_of(("m", k)) for k in "abcd"] == [None, "disk", "disk", "ram"]
    assert cache.held_bytes("disk") <= 2 * MB and len(list(tmp_path.glob("*.safetensors"))) == 2
    entry = cache.get(("m", "b"), (), torch.device("cpu"))
    assert entry is not None and cache.counts.disk_loads == 1 and entry.nbytes() == 1 * MB


def test_disk_tier_reloads_bit_exact_with_strides(tiny_llama, tmp_path, prefills):
    """An entry written to disk and read back is the same bits and layout, and a generation from it is
    token-identical (K from the model has its heads and positions transposed in memory)."""
    ids = prompt(seed=11)
    name = "snapkv"  # reads a statistic, so the statistics round-trip too
    own = generate(tiny_llama, method(name), ids, max_new_tokens=NEW, budget=BUDGET)
    cache = PrefillCache(ram_bytes=0, disk_bytes=512 * MB, folder=tmp_path)
    via = PrefillSharing(cache)
    generate(tiny_llama, method(name), ids, max_new_tokens=NEW, budget=BUDGET, sharing=via)
    key = cache.key(tiny_llama, torch.tensor(ids))
    assert cache.tier_of(key) == "disk"
    shared = generate(tiny_llama, method(name), ids, max_new_tokens=NEW, budget=BUDGET, sharing=via)
    assert shared.telemetry["prefill_shared"] and shared.tokens == own.tokens and cache.counts.disk_loads == 1
    # the reference: capture the same prefill again and compare with what the disk gives back
    ctx_method = method(name)
    ctx = _new_context(tiny_llama, ctx_method, BUDGET, len(ids), 0, Profile())
    with torch.inference_mode(), activate(ctx):
        fresh = prefill_cache.capture(ctx, torch.tensor(ids), ctx_method.prefill_statistics())
    loaded = cache.get(key, ctx_method.prefill_statistics(), torch.device(tiny_llama.spec.device))
    pairs = list(zip(fresh.tensors(), loaded.tensors()))
    assert len(pairs) == 2 * 4 + 1 + 4
    assert any(not t.is_contiguous() for t, _ in pairs), "the model's K/V layout should be exercised"
    for a, b in pairs:
        assert torch.equal(a, b) and a.dtype == b.dtype
        assert [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]


def test_runner_sweeps_share_and_config_controls_it(niah_config, tmp_path):
    """Inside a sweep (``prefill_cache: null``) the second method's run takes every prompt from the
    first's and predicts the same as with ``prefill_cache=false``; the key is not part of the run id."""
    from kvbench.results import RunDir, run_id_for
    from kvbench.runner import plan, run
    from kvbench.validate import validate

    def config(name, **top):
        return {**niah_config(name, budget__token_ratio=0.1), **top}

    own = [run(config(m, prefill_cache=False)) for m in ("full", "oracle")]
    with Sweep() as sweep:
        swept = [run(config(m, output_dir=str(tmp_path / "swept")), sweep=sweep) for m in ("full", "oracle")]
    for a, b in zip(own, swept):
        predictions = [sorted((r["id"], r["prediction"]) for r in RunDir(x.run_dir).records()) for x in (a, b)]
        assert predictions[0] == predictions[1] and len(predictions[0]) == 4
    assert own[1].metrics["prefill_shared"] == 0.0
    assert swept[1].metrics["prefill_shared"] == 1.0  # every prompt came from full's run
    # outside a sweep (null) nothing is shared, also not with an earlier run of this process
    alone = [run(config(m, output_dir=str(tmp_path / "alone"))) for m in ("full", "oracle")]
    assert [a.metrics["prefill_shared"] for a in alone] == [0.0, 0.0]
    assert len({run_id_for(plan(config("full", prefill_cache=v)).resolved) for v in (None, True, False)}) == 1
    with pytest.raises(ConfigError, match="prefill_cache"):
        validate(config("full", prefill_cache="yes"))
