"""The reuse prefill on the static step's rules (issue 42, item 5): bit-identical to the earlier plan,
no host read inside its layers but the one a device-side shrink costs, one attention layout (masks
included) per set of active rows, and the RAM tier in host memory.

The digests below were recorded from the plan before this change (commit c7341fdb: masks built per
layer, positions read back per layer and block, CacheBlend's deviations read to the host) on
torch 2.13 CPU with two threads; every reuse method and mask setting must reproduce them bit for bit:
K, V and positions of every layer after the prefill, and the last token's logits. One digest was
re-recorded since, on purpose: ``cacheblend-last-random-large``, whose query segment is now cached like
a chunk under ``suffix: last_token`` (the query rows the check layer drops held never-written slots).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine import attention
from kvbench.engine.attention import activate
from kvbench.engine.generate import _new_context
from kvbench.engine.ops import SYNC_OPS, record_ops
from kvbench.engine.reuse import ReusePrefill
from kvbench.kv.chunks import ChunkKey, ChunkKV, ChunkStore, StoreConfig
from kvbench.kv.store import LayerKV
from kvbench.methods import create_method
from kvbench.profile import Profile
from kvbench.requests import Segment, join_segments

SMALL = (6, 40, 50, 45, 12)  # prefix, 3 chunks, query: CacheBlend keeps 33 rows (one rectangle)
LARGE = (6, 200, 200, 200, 70)  # CacheBlend keeps 160 rows (5 blocks); prefix_cache: the padded suffix
LONG_FIRST = (6, 300, 40, 40, 70)  # prefix_cache: 150 rows after a 306-token hit (blocks)
#: CacheBlend's check layer as the plan before ran it (every row through the whole layer); the released
#: code's way (check_rows: selected, the default since) is tested in tests/test_cacheblend_authors.py
ALL = {"check_rows": "all"}
CASES = {
    "cacheblend-exact-small": ({"name": "cacheblend", **ALL}, SMALL),
    "cacheblend-code-small": ({"name": "cacheblend", "mask": "code", **ALL}, SMALL),
    "cacheblend-exact-large": ({"name": "cacheblend", **ALL}, LARGE),
    "cacheblend-code-large": ({"name": "cacheblend", "mask": "code", **ALL}, LARGE),
    "cacheblend-filter-large": ({"name": "cacheblend", "filter_ratios": [0.4, 0.3, 0.15], **ALL}, LARGE),
    "cacheblend-last-random-large": (
        {"name": "cacheblend", "suffix": "last_token", "selection": "random", **ALL},
        LARGE,
    ),
    "cacheblend-r1-small": ({"name": "cacheblend", "recompute_ratio": 1.0, **ALL}, SMALL),
    "full_reuse-small": ({"name": "full_reuse"}, SMALL),
    "full_reuse-large": ({"name": "full_reuse"}, LARGE),
    "full_reuse-code-large": ({"name": "full_reuse", "mask": "code"}, LARGE),
    "prefix_cache-small": ({"name": "prefix_cache"}, SMALL),
    "prefix_cache-large": ({"name": "prefix_cache"}, LARGE),
    "prefix_cache-longfirst": ({"name": "prefix_cache"}, LONG_FIRST),
}
#: sha256 (16 hex) of every layer's K, V, positions and the logits, from the plan before this change, as
#: CI's CPU computes them
DIGESTS = {
    "tiny_llama/cacheblend-exact-small": "b21bbb78f3fb52ba",
    "tiny_llama/cacheblend-code-small": "ffc918600af39a5c",
    "tiny_llama/cacheblend-exact-large": "7b39f9e48cbfa1c8",
    "tiny_llama/cacheblend-code-large": "97fd312dfe426409",
    "tiny_llama/cacheblend-filter-large": "498a71fce1849b4d",
    "tiny_llama/cacheblend-last-random-large": "686747ec79dbaba5",
    "tiny_llama/cacheblend-r1-small": "13fb8194ff5498bb",
    "tiny_llama/full_reuse-small": "feb0587ede280e24",
    "tiny_llama/full_reuse-large": "a38479d4f6d7d30d",
    "tiny_llama/full_reuse-code-large": "a38479d4f6d7d30d",
    "tiny_llama/prefix_cache-small": "12c92a0a36664b90",
    "tiny_llama/prefix_cache-large": "795da98524fa677c",
    "tiny_llama/prefix_cache-longfirst": "5e7d4af471af52b1",
    "tiny_qwen2/cacheblend-exact-small": "64a3c917ba6cad69",
    "tiny_qwen2/cacheblend-code-small": "64a3c917ba6cad69",
    "tiny_qwen2/cacheblend-exact-large": "ad434c71651f95db",
    "tiny_qwen2/cacheblend-code-large": "ad434c71651f95db",
    "tiny_qwen2/cacheblend-filter-large": "05eb225e992dcf11",
    "tiny_qwen2/cacheblend-last-random-large": "086889fb5420bcf6",
    "tiny_qwen2/cacheblend-r1-small": "a4ee84f18b8e8f18",
    "tiny_qwen2/full_reuse-small": "38a731fe84103997",
    "tiny_qwen2/full_reuse-large": "03da0438015b6657",
    "tiny_qwen2/full_reuse-code-large": "03da0438015b6657",
    "tiny_qwen2/prefix_cache-small": "d566fcf8bdaf9f52",
    "tiny_qwen2/prefix_cache-large": "a3e4c469b28fa173",
    "tiny_qwen2/prefix_cache-longfirst": "72b009c2d3acdb12",
}
#: the same on an Intel Xeon development machine (AVX-512; recorded 2026-11-30 at b35ca57c): float kernels
#: sum in another order on another CPU, so each CPU that runs the suite keeps its own set
DIGESTS_AVX512_DEV = {
    "tiny_llama/cacheblend-exact-small": "48ccd7272fcf3fe6",
    "tiny_llama/cacheblend-code-small": "841bae55061a5443",
    "tiny_llama/cacheblend-exact-large": "dc26310194fa558d",
    "tiny_llama/cacheblend-code-large": "cf11ab04938635f6",
    "tiny_llama/cacheblend-filter-large": "8f5874a24c56ca47",
    "tiny_llama/cacheblend-last-random-large": "a4c324f1b7053588",
    "tiny_llama/cacheblend-r1-small": "00d6b7d0a7dc7602",
    "tiny_llama/full_reuse-small": "4ed439765e78bf92",
    "tiny_llama/full_reuse-large": "8c7b494deffd089b",
    "tiny_llama/full_reuse-code-large": "8c7b494deffd089b",
    "tiny_llama/prefix_cache-small": "96d2f362c203384c",
    "tiny_llama/prefix_cache-large": "a7ce8d1de90852fd",
    "tiny_llama/prefix_cache-longfirst": "f47b81515e610508",
    "tiny_qwen2/cacheblend-exact-small": "905580246d629288",
    "tiny_qwen2/cacheblend-code-small": "905580246d629288",
    "tiny_qwen2/cacheblend-exact-large": "aaea9eb7fa8fc9f6",
    "tiny_qwen2/cacheblend-code-large": "aaea9eb7fa8fc9f6",
    "tiny_qwen2/cacheblend-filter-large": "14ad2b88dee8d51e",
    "tiny_qwen2/cacheblend-last-random-large": "204c39baa2d1a85b",
    "tiny_qwen2/cacheblend-r1-small": "f0aab510c5259daf",
    "tiny_qwen2/full_reuse-small": "e672efd2a11a5176",
    "tiny_qwen2/full_reuse-large": "6579b59cc3cc1b5b",
    "tiny_qwen2/full_reuse-code-large": "6579b59cc3cc1b5b",
    "tiny_qwen2/prefix_cache-small": "0923488288691e1a",
    "tiny_qwen2/prefix_cache-large": "f0cbc9d90c711da4",
    "tiny_qwen2/prefix_cache-longfirst": "156f310b9f0d2ddb",
}
#: every recorded set: the prefill must reproduce one of them exactly, entry for entry
RECORDED = (DIGESTS, DIGESTS_AVX512_DEV)


def segmented(sizes, seed=0, vocab=250):
    """prefix, chunks..., query segments of seeded random ids."""
    ids = torch.randint(0, vocab, (sum(sizes),), generator=torch.Generator().manual_seed(seed)).tolist()
    roles = ["prefix"] + ["chunk"] * (len(sizes) - 2) + ["query"]
    out, at = [], 0
    for size, role in zip(sizes, roles):
        out.append(Segment(tuple(ids[at : at + size]), role))
        at += size
    return tuple(out)


def prefill(loaded, cfg, segments, store=None, recorded=False):
    """The method's prefill of ``segments`` (chunks precomputed before it): (context, logits, ops or None).
    CacheBlend's chunks are precomputed (``miss: precompute``) unless ``cfg`` says otherwise: its default,
    ``prefill``, would compute them in this prefill (tests/test_cacheblend_miss.py)."""
    if cfg.get("name") == "cacheblend":
        cfg = {"miss": "precompute", **cfg}
    method = create_method(dict(cfg))
    method.attach_store(store or ChunkStore(StoreConfig(tier="ram")))
    ids = torch.tensor(join_segments(segments), dtype=torch.long)
    ctx = _new_context(loaded, method, BudgetConfig(), ids.numel(), 1, Profile())
    ops = None
    try:
        with torch.inference_mode():
            method.prepare(ctx, ids, segments)
        with torch.inference_mode(), activate(ctx):
            if recorded:
                with record_ops() as ops:
                    logits = ctx.prefill(ids, segments)
            else:
                logits = ctx.prefill(ids, segments)
    finally:
        method.release()
    return ctx, logits, ops


@contextmanager
def recorded_threads():
    """Two intra-op threads, the count the digests were recorded at (a float sum splits differently across
    another count: make test's xdist workers run one thread each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def digest(ctx, logits) -> str:
    h = hashlib.sha256()
    for kv in ctx.store.layers:
        for t in (kv.keys, kv.values, kv.positions):
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update(logits.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------- bit for bit
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_the_prefill_is_bit_identical_to_the_plan_before(model, request):
    loaded = request.getfixturevalue(model)
    if loaded.spec.device != "cpu" or not torch.__version__.startswith("2.13"):
        pytest.skip("the digests were recorded on torch 2.13 on a CPU")
    got = {}
    with recorded_threads():
        for name, (cfg, sizes) in CASES.items():
            ctx, logits, _ = prefill(loaded, cfg, segmented(sizes))
            got[f"{model}/{name}"] = digest(ctx, logits)
    sets = [{key: value for key, value in each.items() if key.startswith(f"{model}/")} for each in RECORDED]
    assert got in sets, (
        "the prefill's K/V/logits differ from every recorded set (a CPU not recorded yet computes other "
        "digests: compute this CPU's set at the commit before your change and add it to RECORDED)"
    )


# ---------------------------------------------------------------------- host reads
@contextmanager
def classified(monkeypatch):
    """Sync-prone ops and host reads of a recorded prefill, split by where they ran: ``store`` (inside
    LayerKV.write/append, which read the slots and positions the plan hands them on the host: CPU
    tensors, checked here), ``plan`` (building the ReusePrefill: host planning from the request), and
    the rest (the layers' own work)."""
    found = {"store": Counter(), "plan": Counter(), "host_args": []}
    holder = {}

    def wrap(owner, name, bucket):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            step = holder.get("step")
            if bucket == "store":
                given = [a for a in args[1:] if isinstance(a, torch.Tensor) and a.dtype == torch.long]
                found["host_args"].extend(a.device.type for a in given)
            if step is None:
                return original(*args, **kwargs)
            ops, reads = len(step.ops), Counter(step.host_reads)
            try:
                return original(*args, **kwargs)
            finally:
                for op, _ in step.ops[ops:]:
                    if op.split(".")[0] in SYNC_OPS:
                        found[bucket][op.split(".")[0]] += 1
                for method, calls in (step.host_reads - reads).items():
                    found[bucket][f"Tensor.{method}"] += calls

        monkeypatch.setattr(owner, name, wrapper)

    wrap(LayerKV, "write", "store")
    wrap(LayerKV, "append", "store")
    wrap(ReusePrefill, "__init__", "plan")
    yield holder, found


def layer_syncs(loaded, cfg, sizes, monkeypatch):
    if cfg.get("name") == "cacheblend":  # (chunks precomputed, as in prefill())
        cfg = {"miss": "precompute", **cfg}
    with classified(monkeypatch) as (holder, found):
        method = create_method(dict(cfg))
        method.attach_store(ChunkStore(StoreConfig(tier="ram")))
        segments = segmented(sizes)
        ids = torch.tensor(join_segments(segments), dtype=torch.long)
        ctx = _new_context(loaded, method, BudgetConfig(), ids.numel(), 1, Profile())
        try:
            with torch.inference_mode():
                method.prepare(ctx, ids, segments)
            with torch.inference_mode(), activate(ctx), record_ops() as ops:
                holder["step"] = ops
                ctx.prefill(ids, segments)
        finally:
            holder.pop("step", None)
            method.release()
    layers = Counter(ops.syncs)
    layers.subtract(found["store"])
    layers.subtract(found["plan"])
    return +layers, found, ops, ctx


@pytest.mark.parametrize(
    "name, reads",
    [
        # one read a shrink decided on the device: CacheBlend's kept rows, once per check layer
        ("cacheblend-exact-large", {"Tensor.tolist": 1}),
        ("cacheblend-code-large", {"Tensor.tolist": 1}),
        ("cacheblend-filter-large", {"Tensor.tolist": 3}),
        ("full_reuse-large", {}),
        ("prefix_cache-large", {}),
        ("prefix_cache-longfirst", {}),
    ],
)
def test_the_layers_read_nothing_back_but_a_shrinks_rows(tiny_llama, monkeypatch, name, reads):
    """Before this change a CacheBlend prefill of LARGE on tiny_llama issued 41 sync-prone ops (nonzero,
    item, is_nonzero, .cpu()): per layer a read of the key positions, one per attention block, the
    deviations read to the host. Now the layers issue none but the kept rows' one read per check layer;
    LayerKV.write/append read only the CPU slot and position tensors the plan hands them."""
    cfg, sizes = CASES[name]
    layers, found, _, _ = layer_syncs(tiny_llama, cfg, sizes, monkeypatch)
    assert dict(layers) == reads
    assert found["host_args"] and set(found["host_args"]) == {"cpu"}  # slots and positions stay on the host


def test_the_counter_sees_a_read_in_the_layers(tiny_llama, monkeypatch):
    """The test has teeth: a host read reintroduced in a layer's attention is counted there."""
    original = attention.PastLayout.attend

    def reading(self, query, *args, **kwargs):
        query.sum().item()
        return original(self, query, *args, **kwargs)

    monkeypatch.setattr(attention.PastLayout, "attend", reading)
    cfg, sizes = CASES["cacheblend-exact-large"]
    layers, _, _, _ = layer_syncs(tiny_llama, cfg, sizes, monkeypatch)
    assert layers["item"] == tiny_llama.spec.n_layers - 2  # the layers after the check layer


def test_one_attention_layout_per_set_of_active_rows(tiny_llama, monkeypatch):
    """CacheBlend's kept rows attend from the layer after the check layer on, through one layout whose
    masks are made once: as many mask fills as the layout has blocks, not that many per layer."""
    cfg, sizes = CASES["cacheblend-exact-large"]
    _, _, ops, ctx = layer_syncs(tiny_llama, cfg, sizes, monkeypatch)
    plan = ctx.telemetry.prefill_plan
    kept = round(plan["recompute_per_layer"][-1] * plan["tokens"])
    assert plan["attention_layouts"] == 1
    blocks = len(attention._block_bounds(kept))
    assert kept >= 2 * attention.BLOCK_ROWS and blocks > 1  # (the blocked path, several masks)
    assert sum(1 for op in ops.names if op.startswith("masked_fill_")) == blocks
    assert tiny_llama.spec.n_layers - 2 > 1  # (so that a per-layer mask would show)


# ---------------------------------------------------------------------- the planned attention
@pytest.mark.parametrize("t", [3, 40, 64, 102, 300, 399])
def test_a_planned_layout_is_with_past_bit_for_bit(t):
    """past_layout (host positions, no read) gives with_past's result exactly, on its three paths
    (rectangle, blocks, padded suffix), and issues no sync-prone op when attending."""
    gen = torch.Generator().manual_seed(t)
    n, heads, kv_heads, d = 400, 8, 2, 16
    keys, values = torch.randn(kv_heads, n, d, generator=gen), torch.randn(kv_heads, n, d, generator=gen)
    for positions in (
        sorted(torch.randperm(n, generator=gen)[:t].tolist()),
        torch.randperm(n, generator=gen)[:t].tolist(),  # unsorted rows
        list(range(n - t, n)),  # a suffix (padded when t >= n - t)
    ):
        query = torch.randn(1, heads, t, d, generator=gen)
        layout = attention.past_layout(n, positions, dtype=query.dtype, device=query.device)
        with record_ops() as ops:
            planned = attention.with_past(query, keys, values, None, None, 0.25, layout=layout)
        assert dict(ops.syncs) == {}
        read = attention.with_past(query, keys, values, torch.arange(n), torch.tensor(positions), 0.25)
        assert torch.equal(planned, read)
        repeated = layout.attend(query, keys, values, 0.25, repeat_heads=True)  # (the CUDA path's GQA)
        torch.testing.assert_close(repeated, planned, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------- the RAM tier
def test_the_ram_tier_holds_host_tensors(tiny_llama):
    """Entries put in RAM are host tensors (pinned where CUDA is available), wherever the model runs, so
    a load from RAM is a host-to-device copy on a GPU; a CacheBlend prefill served from RAM is the one
    served from those tensors."""
    store = ChunkStore(StoreConfig(tier="ram"))
    segments = segmented(SMALL)
    prefill(tiny_llama, {"name": "cacheblend"}, segments, store=store)
    entries = list(store._ram.values())
    assert len(entries) == 4  # the prefix and three chunks
    pinned = torch.cuda.is_available()
    for entry in entries:
        for t in (*entry.keys, *entry.values):
            assert t.device.type == "cpu" and t.is_pinned() == pinned
    device = torch.device(tiny_llama.spec.device)
    ram = ChunkStore(StoreConfig(tier="ram"))
    key = ChunkKey("m", (1, 2), "alone")
    made = ChunkKV([torch.randn(2, 5, 4, device=device)], [torch.randn(2, 5, 4, device=device)], 1)
    ram.put(key, made)
    held = ram.get(key)
    assert held is not None and held.keys[0].device.type == "cpu" and torch.equal(held.keys[0], made.keys[0].cpu())


def test_an_entry_in_one_host_buffer_round_trips_through_the_disk_tier(tmp_path):
    """A RAM entry's tensors may be views into one pinned buffer (ChunkKV.on_host): the disk tier, whose
    safetensors writer refuses shared storage, stores them as their own tensors."""
    buffer = torch.randn(4 * 2 * 5 * 4)
    views = [buffer[i * 40 : (i + 1) * 40].view(2, 5, 4) for i in range(4)]
    entry = ChunkKV(views[:2], views[2:], 0)
    store = ChunkStore(StoreConfig(tier="disk", dir=str(tmp_path)))
    key = ChunkKey("m", (3,), "alone")
    store.put(key, entry)
    got = store.get(key)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got.keys + got.values, views))


# ---------------------------------------------------------------------- the bench's long prompts
def test_reuse_ttft_makes_one_prompt_of_each_length(tiny_llama):
    from kvbench.bench.reuse import _configs, _prompts
    from kvbench.errors import ConfigError

    prompts, _ = _prompts(tiny_llama, 3, lengths=(700, 6144))
    assert [len(join_segments(p)) for p in prompts] == [700, 6144]
    assert all([s.role for s in p] == ["prefix"] + ["chunk"] * 10 + ["query"] for p in prompts)
    assert [(label, tier) for label, _, tier in _configs(("cacheblend:ram", "full_reuse"))] == [
        ("full", None),
        ("cacheblend@0.15", "ram"),
        ("cacheblend@0.15 check_rows=all", "ram"),
        ("full_reuse", "ram"),
        ("full_reuse", "disk"),
    ]
    with pytest.raises(ConfigError, match="--methods"):
        _configs(("quest",))
