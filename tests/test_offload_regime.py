"""The offload regime (issue 42, item 3): the device tier really holds the sinks, the window and the block
cache's blocks, only misses come from the host tier, and nothing else changes.

``legacy_gather`` below is the store's gather as it was before the device tier (every selected row taken
from the host tier; the counting of ``_account_fetch`` and ``BlockCache.serve``), kept verbatim as the
reference. The tests compare the two on random selections and cache states (K/V bit for bit, every
counter), then end to end on the tiny models for every offloading method (tokens, selection digests and
counts of a run with the legacy gather patched in), count the syncs of a steady offloaded step (one per
offloaded layer: the read of the selection), and, on CUDA, check that misses come from pinned memory and
resident and cached rows from the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict

import pytest
import torch

from kvbench.kv.block_cache import BlockCache
from kvbench.kv.store import KVStore, LayerKV
from tests.static_helpers import digest_run, recorded_steps

# ---------------------------------------------------------------------------------------------- reference
# kvbench/kv/store.py (LayerKV.gather, _distinct, _account_fetch) and kvbench/kv/block_cache.py
# (BlockCache.serve) before the device tier, verbatim but for `self` → `kv` / `cache`.


def legacy_gather(kv: LayerKV, slots: torch.Tensor, cached: torch.Tensor | None = None):
    rows = slots.shape[0]
    if rows % kv.n_kv_heads:
        raise ValueError(f"cannot map {rows} selection rows onto {kv.n_kv_heads} KV heads")
    group = rows // kv.n_kv_heads
    home_slots = slots if slots.device == kv.home else slots.to(kv.home)
    flat = (home_slots + kv._row_base(rows, group, kv.capacity)).view(-1)
    k = kv._rows(kv._k, flat).view(rows, -1, kv.head_dim)
    v = kv._rows(kv._v, flat).view(rows, -1, kv.head_dim)
    if kv.offload:
        pairs = home_slots + kv._row_base(rows, group, kv.n)  # (kv head, slot) as h * n + s
        _legacy_account_fetch(kv, pairs, None if cached is None else cached.to(kv.home))
    if k.device != kv.device:
        k = k.to(kv.device, non_blocking=True)
        v = v.to(kv.device, non_blocking=True)
    return k, v


def _legacy_distinct(kv: LayerKV, pairs: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    size = kv.n_kv_heads * kv.n
    mask = torch.zeros(size + 1, dtype=torch.bool, device=kv.home)
    index = pairs if where is None else torch.where(where, pairs, size)
    mask.index_fill_(0, index.reshape(-1), True)
    return mask[:size].view(kv.n_kv_heads, kv.n)


def _legacy_account_fetch(kv: LayerKV, pairs: torch.Tensor, cached: torch.Tensor | None) -> None:
    low = min(kv.resident_sink, kv.n)
    high = max(low, kv.n - kv.resident_recent)
    if cached is not None:
        held = int(_legacy_distinct(kv, pairs, cached)[:, low:high].sum())
        kv.stats.cache_lookups += held
        kv.stats.cache_hits += held
        middle = _legacy_distinct(kv, pairs, ~cached)[:, low:high]
    else:
        middle = _legacy_distinct(kv, pairs)[:, low:high]
    if kv.cache is None:
        wanted = int(middle.sum())
        kv.stats.cache_lookups += wanted
        kv.stats.bytes_h2d_fetch += wanted * kv.token_bytes()
        return
    slot = torch.nonzero(middle)[:, 1] + low
    wanted = int(slot.numel())
    if wanted == 0:
        return
    kv.stats.cache_lookups += wanted
    hits, admitted = legacy_serve(kv.cache, kv.cache.block_of(slot))
    kv.stats.cache_hits += hits
    kv.stats.bytes_h2d_fetch += (wanted - hits) * kv.token_bytes()
    kv.stats.bytes_h2d_cache_fill += admitted * kv.cache.block_size * kv.n_kv_heads * kv.token_bytes()


def legacy_serve(cache: BlockCache, blocks: torch.Tensor) -> tuple[int, int]:
    if blocks.numel() == 0:
        return 0, 0
    low = int(blocks.min())
    counts = torch.bincount(blocks - low).tolist()
    hits = 0
    touched = []
    for block in sorted(cache._order):
        i = block - low
        if 0 <= i < len(counts) and counts[i]:
            hits += counts[i]
            touched.append(block)
    cache._touch(touched)
    if cache.capacity == 0:
        return hits, 0
    requested = sorted((-c, low + i) for i, c in enumerate(counts) if c)
    return hits, len(cache._admit(block for _, block in requested[: cache.update_blocks]))


@contextmanager
def legacy_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runs inside gather as before the device tier (the writes still fill a tier nobody reads)."""
    with monkeypatch.context() as patch:
        patch.setattr(LayerKV, "gather", legacy_gather)
        yield


@pytest.fixture
def stores(monkeypatch) -> list[KVStore]:
    """Every KVStore made while the test runs."""
    made: list[KVStore] = []
    original = KVStore.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(KVStore, "__init__", recording)
    return made


# ---------------------------------------------------------------------------------------------- gather level
def twins(heads=2, dim=8, n=300, sink=4, recent=17, cache=(4, 16, "lfu", 2, 0), chunks=(120, 180), seed=0):
    """Two offloaded layers in the same state (the legacy gather reads one, the new one the other)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, dim, generator=generator)
    values = torch.randn(heads, n, dim, generator=generator)
    made = []
    for _ in range(2):
        kv = LayerKV(heads, dim, dtype=torch.float32, device=torch.device("cpu"), offload=True, capacity=n)
        kv.set_residency(sink, recent)
        if cache is not None:
            capacity, block, policy, update, offset = cache
            kv.attach_cache(BlockCache(capacity, block_size=block, policy=policy, update_blocks=update, offset=offset))
        at = 0
        for size in chunks:  # a prefill in pieces
            kv.append(keys[:, at : at + size], values[:, at : at + size])
            at += size
        made.append(kv)
    return made[0], made[1], generator


def decode_token(layers: list[LayerKV], generator: torch.Generator, static: bool) -> None:
    """One new token in every layer, the static step's way (``n`` first, then ``write_slot``) or appended."""
    heads, dim = layers[0]._k.shape[0], layers[0].head_dim
    key, value = torch.randn(heads, 1, dim, generator=generator), torch.randn(heads, 1, dim, generator=generator)
    for kv in layers:
        if static:
            kv.reserve(1)
            kv.n += 1
            kv.seen += 1
            kv.write_slot(kv.n - 1, key, value, torch.tensor([kv.n - 1]))
        else:
            kv.append(key, value)


def random_selection(kv: LayerKV, rows: int, width: int, generator: torch.Generator, hot: int) -> torch.Tensor:
    """``[rows, width]`` slots: sinks, the window, a hot range (blocks that come back: cache hits) and any
    middle slot; repeated across rows (rows of one KV head share half their slots) and within rows."""
    n = kv.n

    def pick(size: int) -> torch.Tensor:
        kind = torch.randint(0, 4, (size,), generator=generator)
        sink = torch.randint(0, max(1, kv.resident_sink), (size,), generator=generator)
        window = n - 1 - torch.randint(0, max(1, kv.resident_recent), (size,), generator=generator)
        hot_slots = torch.randint(hot, hot + 48, (size,), generator=generator).clamp_max(n - 1)
        anywhere = torch.randint(0, n, (size,), generator=generator)
        return torch.stack([sink, window, hot_slots, anywhere])[kind, torch.arange(size)]

    group = rows // kv.n_kv_heads
    shared = pick(width).expand(rows, -1).clone()
    own = torch.stack([pick(width) for _ in range(rows)])
    mine = torch.rand(rows, width, generator=generator) < 0.5
    slots = torch.where(mine, own, shared)
    if group > 1:  # one query head of each group repeats its neighbour's row exactly
        slots.view(kv.n_kv_heads, group, width)[:, -1] = slots.view(kv.n_kv_heads, group, width)[:, 0]
    return slots.clamp(0, n - 1)


def assert_same(old: LayerKV, new: LayerKV, slots: torch.Tensor, cached: torch.Tensor | None = None) -> None:
    k_ref, v_ref = legacy_gather(old, slots, cached)
    k, v = new.gather(slots, cached)
    assert k.shape == k_ref.shape and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert asdict(new.stats) == asdict(old.stats)
    if old.cache is not None:
        assert list(new.cache._order.items()) == list(old.cache._order.items())
        assert new.cache._freq == old.cache._freq


@pytest.mark.parametrize(
    "group, cache, flags",
    [
        (1, None, False),
        (4, None, False),
        (2, (4, 16, "lfu", 2, 0), False),
        (4, (3, 8, "lru", 3, 4), False),
        (1, (2, 32, "lfu", 1, 0), False),
        (2, (6, 16, "lfu", 6, 4), True),
        (4, None, True),
    ],
    ids=["mha", "gqa4", "cache_lfu", "cache_lru_offset", "cache_small", "cache_and_flags", "flags"],
)
def test_gather_equals_the_legacy_gather(group, cache, flags):
    """40 decode steps on a 300-token layer (sinks 4, window 17): random selections over sinks, window,
    a hot range and the whole middle, rows per KV head or per query head (GQA, repeated rows), the
    block cache hitting, admitting and evicting, ClusterKV-style ``cached`` flags; a rollback halfway.
    Every gather returns the legacy gather's K/V and counts, the block cache decides alike, and the
    device tier never needed a repair."""
    old, new, generator = twins(cache=cache, seed=group)
    heads = old.n_kv_heads
    snap_old = snap_new = None
    for step in range(40):
        decode_token([old, new], generator, static=step % 3 != 0)
        if step == 10:
            snap_old, snap_new = old.snapshot(), new.snapshot()
        if step == 25:
            old.restore(snap_old)
            new.restore(snap_new)
        slots = random_selection(new, heads * group, 24, generator, hot=40 + 3 * step)
        cached = torch.rand(slots.shape, generator=generator) < 0.3 if flags else None
        assert_same(old, new, slots, cached)
    assert new.tier is not None and new.tier.repairs == 0
    if cache is not None:
        assert new.stats.cache_hits > 0 and new.stats.bytes_h2d_cache_fill > 0
    if not flags:  # every fetched row is a counted miss, and every counted miss was fetched
        assert new.tier.rows_fetched * new.token_bytes() == new.stats.bytes_h2d_fetch
    assert torch.equal(new.keys, old.keys)


def test_resident_rows_and_hits_come_from_the_device_tier():
    """The rows a gather takes from the device tier are its copies: with the host tier's sinks, window
    and cached blocks overwritten behind the store's back, a gather still returns the true K/V; the
    misses, read from the host tier, show the overwrite."""
    old, new, generator = twins(cache=(4, 16, "lfu", 4, 0))
    for _ in range(6):  # warm the cache on blocks 3-4 (slots 48-79)
        decode_token([old, new], generator, static=True)
        assert_same(old, new, torch.arange(48, 80).expand(2, -1).contiguous())
    assert sorted(new.cache.blocks()) == [3, 4]
    n = new.n
    resident = torch.cat([torch.arange(4), torch.arange(50, 70), torch.arange(n - 17, n)]).expand(2, -1)
    expect_k, expect_v = legacy_gather(old, resident)
    new._k.view(-1)[:] = float("nan")  # the host tier as if lost
    new._v.view(-1)[:] = float("nan")
    stats = asdict(new.stats)
    k, v = new.gather(resident.contiguous())
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)
    assert new.stats.bytes_h2d_fetch == stats["bytes_h2d_fetch"]  # nothing fetched: all resident or cached
    k, _ = new.gather(torch.tensor([[120], [130]]))  # a miss crosses from the host tier
    assert bool(k.isnan().all())


def test_the_window_follows_the_resident_range_as_it_grows():
    """ClusterKV widens its resident range every step until it reclusters (the unclustered tokens): the
    window grows without losing a row and needs no repair; a resident range that shrinks again is the
    legacy gather's too."""
    old, new, generator = twins(recent=3, cache=None)
    clustered_end = new.n
    for step in range(30):
        for kv in (old, new):
            kv.set_residency(4, kv.n + 1 - clustered_end)  # before the step's token is written (before_step)
        decode_token([old, new], generator, static=True)
        if step == 20:  # a recluster: the resident range shrinks to the tokens after it
            clustered_end = new.n - 2
        n = new.n
        slots = torch.cat([torch.arange(4), torch.arange(clustered_end - 5, n)]).expand(4, -1).contiguous()
        assert_same(old, new, slots)
    assert new.tier.repairs == 0 and new.tier.window >= 21


def test_stale_copies_are_repaired_after_an_in_place_rewrite():
    """Eviction rewrites the host tier in place: the device tier's copies are dropped and refilled from
    the host tier when read (counted in ``repairs``), and the K/V stay exact."""
    old, new, generator = twins(cache=(4, 16, "lfu", 4, 0))
    for _ in range(4):
        decode_token([old, new], generator, static=True)
        assert_same(old, new, torch.arange(40, 90).expand(2, -1).contiguous())
    dst = torch.tensor([[10, 60], [11, 61]])
    for kv in (old, new):
        kv.swap_remove(dst)
    assert_same(old, new, torch.cat([torch.arange(0, 6), torch.arange(40, 90), torch.arange(290, 302)]).expand(2, -1))
    assert new.tier.repairs > 0


# ---------------------------------------------------------------------------------------------- end to end
E2E = {  # method: (params, budget) — offload on, block caches smaller than the prompt, ClusterKV's cache
    "pqcache": ({"kmeans_iters": 5, "cache_tokens": 256}, {"tokens": 96, "local": 8, "comm_ratio": 1 / 128}),
    "infllm": ({"block_size": 16, "cache_tokens": 128, "cache_block": 16}, {"token_ratio": 0.2, "comm_ratio": 1 / 16}),
    "quest": ({"gqa": "shared", "cache_tokens": 128, "cache_block": 16}, {"token_ratio": 0.2}),
    "clusterkv": ({"recluster_every": 16, "clusters": 12, "cache_tokens": 96, "cache_block": 16}, {"tokens": 96}),
    "sparq": ({"cache_tokens": 128, "cache_block": 32}, {"tokens": 96}),
}
COUNTS = ("bytes_h2d", "bytes_h2d_fetch", "bytes_h2d_cache_fill", "bytes_h2d_index", "bytes_d2h")
COUNTS += ("cache_hits", "cache_lookups", "hit_rate")


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("name", sorted(E2E))
def test_offloaded_runs_are_the_legacy_runs(name, fixture, request, random_ids, monkeypatch, stores):
    """36 new tokens on a 700-token prompt with ``offload: true``: the same tokens, the same positions
    attended at every step and layer, the same bytes and hits as with the legacy gather; the block cache
    hit, and no device-tier copy needed a repair."""
    loaded = request.getfixturevalue(fixture)
    params, budget = E2E[name]
    ids = random_ids(700, seed=51)
    with legacy_store(monkeypatch):
        before = digest_run(loaded, name, ids, 36, {"offload": True, **params}, **budget)
    after = digest_run(loaded, name, ids, 36, {"offload": True, **params}, **budget)
    assert after.tokens == before.tokens
    assert after.telemetry["selection_digest"] == before.telemetry["selection_digest"]
    assert after.telemetry["attended_per_layer"] == before.telemetry["attended_per_layer"]
    for key in COUNTS:
        assert after.telemetry[key] == before.telemetry[key], key
    assert after.telemetry["bytes_h2d_fetch"] > 0 and after.telemetry["cache_hits"] > 0
    tiers = [kv.tier for kv in stores[-1].layers if kv.offload]
    assert tiers and all(tier is not None and tier.repairs == 0 for tier in tiers)
    if name != "clusterkv":  # (ClusterKV's cached rows cross too, counted as hits)
        fetched = sum(tier.rows_fetched for tier in tiers) * stores[-1][0].token_bytes()
        assert fetched == after.telemetry["bytes_h2d_fetch"]


@pytest.mark.parametrize("name", sorted(E2E))
def test_a_steady_offloaded_step_syncs_once_per_offloaded_layer(name, tiny_llama, random_ids, stores):
    """The one host read of an offloaded layer's step is its selection (to plan what misses)."""
    params, budget = E2E[name]
    steps = recorded_steps(tiny_llama, name, random_ids(700, seed=46), params={"offload": True, **params}, **budget)
    offloaded = sum(kv.offload for kv in stores[-1].layers)
    assert offloaded
    for step in (steps[4], steps[5]):
        assert sum(step.syncs.values()) <= offloaded, dict(step.syncs)
        assert set(step.syncs) <= {"Tensor.numpy", "Tensor.cpu"}, dict(step.syncs)


def test_a_conversation_rolls_the_device_tier_back(tiny_llama, random_ids, monkeypatch, stores):
    """Shared-context questions (a snapshot after the context, a rollback after each answer): the same
    answers and counts as with the legacy gather, and no repair (the window comes back from the device)."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.conversation import converse
    from kvbench.methods import create_method
    from kvbench.requests import MultiQueryRequest, Query

    def ask(name: str):
        params, budget = E2E[name]
        queries = tuple(Query(tuple(random_ids(12, seed=s)), 12, min_new_tokens=12) for s in (60, 61, 60))
        request = MultiQueryRequest(tuple(random_ids(500, seed=59)), queries, compression="question_agnostic")
        return converse(tiny_llama, create_method({"name": name, **params}), request, budget=BudgetConfig(**budget))

    for name in ("pqcache", "clusterkv"):
        with legacy_store(monkeypatch):
            before = ask(name)
        after = ask(name)
        assert [turn.tokens for turn in after.turns] == [turn.tokens for turn in before.turns]
        for key in COUNTS:
            assert after.telemetry[key] == before.telemetry[key], key
        assert all(kv.tier.repairs == 0 for kv in stores[-1].layers if kv.offload and kv.tier is not None)


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_misses_cross_from_pinned_memory_and_resident_rows_are_on_the_device():
    """On CUDA the host tier is pinned, the misses are gathered into pinned memory (an asynchronous copy),
    the device tier (sinks, window, cached blocks) is device memory, and the K/V are the legacy gather's."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2):
        kv = LayerKV(2, 8, dtype=torch.float32, device=torch.device("cuda"), offload=True, capacity=400)
        kv.set_residency(4, 17)
        kv.attach_cache(BlockCache(4, block_size=16, policy="lfu", update_blocks=4))
        layers.append(kv)
    keys = torch.randn(2, 300, 8, generator=generator).cuda()
    for kv in layers:
        kv.append(keys, -keys)
    old, new = layers
    for _ in range(8):
        decode_token(layers, generator, static=True)  # (host tensors: copied in by write_slot)
        slots = torch.cat([torch.arange(4), torch.arange(40, 90), torch.arange(new.n - 17, new.n)])
        slots = slots.expand(4, -1).contiguous().cuda()
        k_ref, v_ref = legacy_gather(old, slots)
        k, v = new.gather(slots)
        assert k.is_cuda and torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert asdict(new.stats) == asdict(old.stats)
    tier = new.tier
    assert new._k.is_pinned() and tier.k.is_cuda and tier.v.is_cuda
    assert tier.last_staging is not None and tier.last_staging.is_pinned()
    assert new.cache.blocks() and tier.filled.any() and tier.repairs == 0
    assert tier.rows_fetched * new.token_bytes() == new.stats.bytes_h2d_fetch
