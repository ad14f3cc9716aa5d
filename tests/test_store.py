import torch

from kvbench.kv.block_cache import BlockCache
from kvbench.kv.store import KVStore, LayerKV


def filled(n=300, heads=2, dim=4, offload=False):
    kv = LayerKV(heads, dim, dtype=torch.float32, device=torch.device("cpu"), offload=offload)
    keys = torch.arange(heads * n * dim, dtype=torch.float32).view(heads, n, dim)
    kv.append(keys, -keys)
    return kv, keys


def test_append_grows_and_tracks_positions():
    kv, keys = filled(n=10)
    kv.append(torch.ones(2, 3, 4), torch.ones(2, 3, 4))
    assert kv.n == 13 and kv.seen == 13
    assert torch.equal(kv.keys[:, :10], keys)
    assert kv.positions[0].tolist() == list(range(13))


def test_keep_evicts_per_head_and_keeps_positions():
    kv, keys = filled(n=10)
    kv.keep(torch.tensor([[7, 1, 3], [0, 9, 5]]))
    assert kv.n == 3 and kv.seen == 10
    assert kv.positions.tolist() == [[1, 3, 7], [0, 5, 9]]
    assert torch.equal(kv.keys[1, 2], keys[1, 9])
    assert kv.nbytes() == 3 * 2 * 2 * 4 * 4  # slots * heads * (K+V) * dim * fp32


def test_remove_then_append_continues_positions():
    kv, _ = filled(n=6)
    kv.remove(torch.tensor([[2], [0]]))
    kv.append(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert kv.positions.tolist() == [[0, 1, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]


def test_gather_maps_query_heads_to_kv_heads():
    kv, keys = filled(n=8, heads=2)
    slots = torch.tensor([[1, 2], [3, 4], [5, 6], [0, 7]])  # 4 query heads, group 2
    k, v = kv.gather(slots)
    assert torch.equal(k[0], keys[0, [1, 2]]) and torch.equal(k[3], keys[1, [0, 7]])
    assert torch.equal(v, -k)


def test_device_tier_moves_no_bytes():
    kv, _ = filled(n=100)
    kv.gather(torch.tensor([[50, 60], [70, 80]]))
    assert kv.stats.bytes_h2d == 0 and kv.stats.cache_lookups == 0


def test_offload_counts_only_middle_tokens_once_per_kv_head():
    kv, _ = filled(n=100, offload=True)
    kv.set_residency(sink=4, recent=10)
    # query heads 0,1 -> kv head 0; 2,3 -> kv head 1. Slot 2 is a sink, 95 is recent, others middle.
    slots = torch.tensor([[2, 40, 95], [40, 41, 95], [2, 50, 95], [50, 60, 95]])
    kv.gather(slots)
    # unique middle pairs: head0 {40, 41}, head1 {50, 60} -> 4 (head, token) fetches of K+V
    assert kv.stats.cache_lookups == 4
    assert kv.stats.bytes_h2d_fetch == 4 * 2 * 4 * 4
    assert kv.stats.bytes_d2h == 100 * 2 * 2 * 4 * 4  # the prefill went to the host tier


def test_block_cache_hits_after_admission():
    kv, _ = filled(n=1024, offload=True)
    kv.attach_cache(BlockCache(capacity_blocks=2, block_size=128, policy="lru", update_blocks=1))
    first = torch.tensor([[130, 131], [140, 700]])
    kv.gather(first)  # block 1 holds 3 of the 4 tokens -> admitted
    assert kv.stats.cache_hits == 0 and kv.stats.bytes_h2d_cache_fill == 128 * 2 * (2 * 4 * 4)
    kv.gather(torch.tensor([[132, 133], [150, 900]]))
    assert kv.stats.cache_hits == 3 and kv.stats.cache_lookups == 8
    assert abs(kv.stats.hit_rate - 3 / 8) < 1e-9


def test_lru_and_lfu_evict_different_blocks():
    lru = BlockCache(2, block_size=1, policy="lru", update_blocks=1)
    lfu = BlockCache(2, block_size=1, policy="lfu", update_blocks=1)
    for cache in (lru, lfu):
        cache.update(torch.tensor([1]))
        cache.update(torch.tensor([2]))
        cache.lookup(torch.tensor([1]))  # block 1: used at two steps, but before block 2
        cache.lookup(torch.tensor([1, 1]))
        cache.lookup(torch.tensor([2]))  # block 2: most recent
        cache.update(torch.tensor([3]))
    assert sorted(lru.blocks()) == [2, 3]  # LRU evicts 1 (least recent)
    assert sorted(lfu.blocks()) == [1, 3]  # LFU evicts 2 (least frequent)


def test_store_aggregates_layers():
    store = KVStore(3, 2, 4, dtype=torch.float32, device=torch.device("cpu"), offload=True)
    for layer in store.layers:
        layer.append(torch.zeros(2, 5, 4), torch.zeros(2, 5, 4))
    assert store.held_tokens() == [5, 5, 5]
    assert store.stats().bytes_d2h == 3 * 5 * 2 * 2 * 4 * 4


def test_method_cached_slots_count_as_hits():
    kv, _ = filled(n=100, offload=True)
    kv.set_residency(sink=4, recent=10)
    slots = torch.tensor([[40, 41, 42], [50, 51, 52]])
    cached = torch.tensor([[True, True, False], [False, False, False]])
    kv.gather(slots, cached=cached)
    assert kv.stats.cache_lookups == 6 and kv.stats.cache_hits == 2
    assert kv.stats.bytes_h2d_fetch == 4 * 2 * 4 * 4


def test_block_cache_serve_equals_lookup_then_update():
    """serve() (the decode path: one bincount) makes the decisions lookup() + update() make."""
    generator = torch.Generator().manual_seed(0)
    for policy in ("lru", "lfu"):
        for capacity, update in ((4, 2), (3, 3), (0, 0), (6, 1)):
            served = BlockCache(capacity, block_size=8, policy=policy, update_blocks=update, offset=3)
            stepped = BlockCache(capacity, block_size=8, policy=policy, update_blocks=update, offset=3)
            for _ in range(40):
                count = int(torch.randint(0, 30, (1,), generator=generator))
                blocks = served.block_of(torch.randint(3, 90, (count,), generator=generator))
                hits, admitted = served.serve(blocks)
                assert hits == int(stepped.lookup(blocks).sum())
                assert admitted == stepped.update(blocks)
                assert list(served._order.items()) == list(stepped._order.items())
                assert served._freq == stepped._freq


def test_gather_matches_advanced_indexing_per_query_head_rows():
    """Rows per query head (row h reads KV head h // group) gather the right rows and count each
    (KV head, slot) once however many query heads ask for it."""
    kv, keys = filled(n=50, heads=2, offload=True)
    slots = torch.tensor([[1, 20, 30], [1, 20, 31], [2, 3, 40], [2, 5, 41]])  # 4 rows: group 2
    k, v = kv.gather(slots)
    heads = torch.tensor([0, 0, 1, 1])[:, None]
    assert torch.equal(k, keys[heads, slots]) and torch.equal(v, -keys[heads, slots])
    assert kv.stats.cache_lookups == 4 + 5  # head 0: {1, 20, 30, 31}; head 1: {2, 3, 5, 40, 41}


def test_a_methods_dense_layers_stay_resident_when_the_store_offloads(tiny_llama):
    """Dense layers attend every token at every step: they live on the device, not in the host tier
    (on a GPU, the host tier would hand SDPA host keys); held() is the attended K/V of any layer."""
    from kvbench.budget import BudgetConfig
    from kvbench.engine.generate import _new_context
    from kvbench.methods import create_method

    method = create_method({"name": "clusterkv"})
    assert method.offload and method.dense_layers == (0, 1)
    ctx = _new_context(tiny_llama, method, BudgetConfig(tokens=64), 200, 4, None)
    assert [layer.offload for layer in ctx.store.layers] == [i not in (0, 1) for i in range(tiny_llama.spec.n_layers)]
    store = KVStore(3, 2, 4, dtype=torch.float32, device=torch.device("cpu"), offload=True, resident=(1,))
    assert [layer.offload for layer in store.layers] == [True, False, True]
    layer = store[0]
    layer.append(torch.randn(2, 5, 4), torch.randn(2, 5, 4))
    keys, values = layer.held()
    assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
