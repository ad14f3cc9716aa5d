"""ClusterKV on the static decode step: the same selections, tokens, bytes and cluster hit rate as the
earlier method (``tests/legacy_clusterkv.py``), no host reads and a fixed op stream.

* **the walk** — :func:`~kvbench.methods.clusterkv.cluster_walk` (sorted clusters, prefix sums,
  ``searchsorted``) takes exactly the tokens and clusters of :func:`~kvbench.methods.clusterkv.cluster_take`
  (masks over every clustered token), ties and empty clusters included; the buffers append in place as
  the earlier index rebuilt itself, and survive a resize and a rollback;
* **equivalence** — every decode step and layer attends the same positions (the selection digest), with
  reclusters inside the generation (``recluster_every`` 16 over 40 new tokens), both GQA modes, a
  cluster cache of 0, 1 and 2 steps, the host tier on and off, and budgets that cover everything at
  first and stop covering after a recluster; the dynamic engine step alike;
* **a static step** — steps 4 and 5 read nothing back and issue the same ops.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.settings import EngineSettings
from kvbench.methods.clusterkv import ClusterBuffers, ClusterIndex, cluster_take, cluster_walk
from tests.legacy_clusterkv import LegacyClusterKV
from tests.static_helpers import assert_same_as_legacy, assert_static_step, digest_run, registered

LEGACY = LegacyClusterKV.name
NEW = 40
FAST = {"recluster_every": 16, "clusters": 12}  # reclusters at new tokens 17 and 33


@pytest.fixture(scope="module", autouse=True)
def _legacy_registered():
    with registered(LegacyClusterKV):
        yield


# ---------------------------------------------------------------------- the walk
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seed", range(6))
def test_the_walk_takes_the_tokens_and_clusters_cluster_take_takes(group, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, clusters, n, sink = 2, 9, 70, 4
    labels = torch.randint(0, clusters - 2, (heads, n), generator=generator)  # the last two clusters stay empty
    labels[:, :3] = clusters - 3  # (and one is larger)
    index = ClusterBuffers.allocate(torch.zeros(heads, clusters, 8), clusters, n, sink, None)
    index.append(labels, torch.zeros(heads, clusters, 8))
    scores = torch.randint(0, 4, (heads, group, clusters), generator=generator).float()  # many ties
    rows_labels = labels.repeat_interleave(group, dim=0)
    rows_sizes = index.sizes.repeat_interleave(group, dim=0)
    for budget in (1, 5, 17, n - 1):
        positions = torch.arange(budget).expand(heads, group, budget).contiguous()
        slots, perm, chosen_of = cluster_walk(scores, index.count_buf, index.sorted_pairs, positions)
        take, chosen = cluster_take(scores.reshape(-1, clusters), rows_labels, budget, rows_sizes)
        assert torch.equal(slots.reshape(-1, budget), take + sink)
        walked = torch.zeros_like(chosen).scatter_(1, chosen_of.reshape(-1, budget), True)
        assert torch.equal(walked, chosen)
        assert torch.equal(perm.sort(dim=-1).values, torch.arange(budget).expand_as(perm))


def test_the_buffers_append_in_place_and_survive_a_resize_and_a_rollback():
    """Appending keeps the earlier tokens' cluster order (the new labels are larger), as rebuilding the
    whole index does; a resized copy and a restored snapshot hold the same arrays, and the ring's columns
    for clusters made after the snapshot are empty again."""
    generator = torch.Generator().manual_seed(7)
    first, second = torch.randint(0, 5, (2, 30), generator=generator), torch.randint(0, 3, (2, 12), generator=generator)
    index = ClusterBuffers.allocate(torch.zeros(2, 5, 4), 8, 50, 16, (1, 3))
    index.append(first, torch.randn(2, 5, 4, generator=generator))
    saved = index.saved()
    index.ring[0, :, :, :5, 0] = 1  # (steps chose every cluster)
    index.append(second, torch.randn(2, 3, 4, generator=generator))
    index.ring[0, :, :, 5:, 0] = 1
    whole = ClusterIndex.build(torch.arange(16, 58), torch.cat([first, second + 5], dim=1), index.centroids)
    for name in ("sizes", "prefix", "sorted_slots", "labels", "slots"):
        assert torch.equal(getattr(index, name), getattr(whole, name)), name
    assert index.clustered_end == whole.clustered_end == 58
    grown = index.resized(12, 80)
    assert grown.room == (12, 80) and torch.equal(grown.ring[..., :8, :], index.ring)
    for name in ("centroids", "sizes", "prefix", "sorted_slots", "labels"):
        assert torch.equal(getattr(grown, name), getattr(index, name)), name
    assert grown.load(saved) and (grown.clusters, grown.clustered) == (5, 30)
    assert not grown.ring[..., 0].any() and grown.ring[..., 1].eq(1).all()
    assert torch.equal(grown.saved().sorted_buf, saved.sorted_buf)
    assert not ClusterBuffers.allocate(torch.zeros(2, 1, 4), 4, 50, 16, (1, 3)).load(saved)  # (too few clusters)


# ---------------------------------------------------------------------- equivalence
def _same(loaded, ids, params, n=NEW, **budget):
    static, earlier = assert_same_as_legacy(loaded, "clusterkv", LEGACY, ids, n, params=params, **budget)
    assert static.telemetry["method"] == earlier.telemetry["method"]  # the hit rate, clusters, k-means iterations
    return static


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"offload": False},
        {"gqa": "shared"},
        {"gqa": "shared", "offload": False, "cache_steps": 2},
        {"cache_steps": 2, "new_clusters": 3},
        {"cache_steps": 0, "offload": False},
    ],
    ids=["default", "device", "shared", "shared-device-R2", "R2-new3", "R0-device"],
)
def test_static_clusterkv_attends_what_the_earlier_one_attended(fixture, params, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    out = _same(loaded, random_ids(600, seed=41), {**FAST, **params}, tokens=64)
    layer = loaded.spec.n_layers - 1
    assert out.telemetry["method"]["clusters"] == {"2": 12 + 2 * params.get("new_clusters", 4)}
    assert 16 + 64 < out.telemetry["attended_per_layer"][layer] < 16 + 64 + 17
    if params.get("cache_steps", 1):
        assert out.telemetry["method"]["cluster_hit_rate"] is not None


@pytest.mark.parametrize("offload", [True, False])
def test_a_budget_that_stops_covering_after_a_recluster(offload, tiny_llama, random_ids):
    """584 clustered prompt tokens: a budget of 590 attends everything (the dense step) until the first
    recluster brings 600; the cluster cache then starts with no history."""
    out = _same(tiny_llama, random_ids(600, seed=42), {**FAST, "offload": offload}, tokens=590)
    assert out.telemetry["method"]["cluster_hit_rate"] is not None


def test_a_covering_budget_is_the_dense_step(tiny_qwen2, random_ids):
    out = _same(tiny_qwen2, random_ids(500, seed=43), FAST, tokens=2000)
    assert out.telemetry["method"]["cluster_hit_rate"] is None


def test_the_default_period_and_cluster_count(tiny_llama, random_ids):
    _same(tiny_llama, random_ids(900, seed=44), {"offload": False}, n=24, tokens=96)


def test_the_dynamic_engine_attends_the_same(tiny_llama, random_ids):
    """``engine.decode=dynamic`` (the host-driven step, with ``before_step``) attends the same."""
    ids = random_ids(600, seed=45)
    params = {**FAST, "cache_steps": 2}
    dynamic = digest_run(tiny_llama, "clusterkv", ids, NEW, params, EngineSettings(decode="dynamic"), tokens=64)
    earlier = digest_run(tiny_llama, LEGACY, ids, NEW, params, tokens=64)
    assert dynamic.tokens == earlier.tokens
    assert dynamic.telemetry["selection_digest"] == earlier.telemetry["selection_digest"]
    assert dynamic.telemetry["method"] == earlier.telemetry["method"]
    assert dynamic.telemetry["bytes_h2d_fetch"] == earlier.telemetry["bytes_h2d_fetch"]


# ---------------------------------------------------------------------- the op stream
@pytest.mark.parametrize(
    "params", [{}, {"gqa": "shared", "cache_steps": 2}, {"cache_steps": 0}], ids=["default", "shared-R2", "R0"]
)
def test_a_steady_step_reads_nothing_back_and_repeats_its_ops(params, tiny_llama, random_ids):
    assert_static_step(tiny_llama, "clusterkv", random_ids(700, seed=46), {"offload": False, **params}, tokens=96)
