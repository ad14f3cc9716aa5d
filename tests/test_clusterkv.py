import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import create_method
from kvbench.methods.clusterkv import ClusterIndex, select_by_clusters


def fig8_index():
    # ClusterKV Fig. 8: k1 -> cluster 0; k2, k3, k4 -> cluster 1; k0, k5 -> cluster 2
    labels = torch.tensor([[2, 0, 1, 1, 1, 2]])
    return ClusterIndex.build(torch.arange(6), labels, torch.zeros(1, 3, 4))


def test_fig8_index_arrays():
    index = fig8_index()
    assert index.sizes.tolist() == [[1, 3, 2]]
    assert index.prefix.tolist() == [[1, 4, 6]]
    assert index.sorted_slots.tolist() == [[1, 2, 3, 4, 0, 5]]


def test_fig8_selection_takes_clusters_in_score_order_and_trims_the_last():
    index = fig8_index()
    scores_20 = torch.tensor([[2.0, 0.0, 3.0]])  # cluster 2 first, then 0: sizes 2 + 1 = budget 3
    selected, clusters = select_by_clusters(scores_20, index.labels, index.slots, 3)
    assert selected.tolist() == [[0, 1, 5]] and clusters.tolist() == [[True, False, True]]
    scores_1 = torch.tensor([[0.0, 5.0, 1.0]])  # cluster 1 (3 tokens) first: budget 2 keeps its lowest positions
    selected, clusters = select_by_clusters(scores_1, index.labels, index.slots, 2)
    assert selected.tolist() == [[2, 3]] and clusters.tolist() == [[False, True, False]]
    selected, _ = select_by_clusters(scores_1, index.labels, index.slots, 5)  # 3 + 2 (cluster 2), cut from 2
    assert selected.tolist() == [[0, 2, 3, 4, 5]]


def test_decode_time_clustering_grows_the_index(tiny_llama, random_ids):
    """Every ``recluster_every`` generated tokens become ``new_clusters`` (4) clusters of the index. A period
    of 32 with 16-slot attention buckets (each recluster spans two buckets, as the default 320 spans the
    default 256-slot buckets) keeps the run at 70 steps instead of 700."""
    from kvbench.engine.settings import EngineSettings

    method = create_method({"name": "clusterkv", "clusters": 25, "recluster_every": 32})
    out = generate(
        tiny_llama,
        method,
        random_ids(2000, seed=32),
        max_new_tokens=70,
        min_new_tokens=70,
        budget=BudgetConfig(tokens=256),
        engine=EngineSettings(bucket_tokens=16),
    )
    assert out.telemetry["new_tokens"] == 70
    for layer in range(2, tiny_llama.spec.n_layers):
        index = method.index[layer]
        assert index.centroids.shape[1] == 25 + 4 * 2  # 70 steps: two blocks of 32 generated tokens
        assert index.slots.numel() == 2000 - 16 + 64
        assert index.clustered_end == 2000 + 64
    # attended per step: 16 sinks + 256 selected + the unclustered recent tokens (1..32) + current
    attended = out.telemetry["attended_per_layer"][2]
    assert 16 + 256 + 1 < attended < 16 + 256 + 33
    assert 0 <= out.telemetry["method"]["cluster_hit_rate"] <= 1


def test_cluster_count_follows_the_context(tiny_llama, random_ids):
    method = create_method({"name": "clusterkv"})
    generate(tiny_llama, method, random_ids(816, seed=33), max_new_tokens=2, budget=BudgetConfig(tokens=128))
    assert method.index[2].centroids.shape[1] == 10  # (816 - 16) / 80


def test_only_selected_clustered_tokens_cross_the_link(tiny_qwen2, random_ids):
    """Bytes fetched = the distinct (KV head, token) pairs the query heads selected, minus cached
    clusters; sinks and the unclustered recent tokens never move (they stay on the device)."""
    method = create_method({"name": "clusterkv", "cache_steps": 0, "recluster_every": 1000})
    expected = []
    select = method.select

    def recording(layer, query, kv):
        selection = select(layer, query, kv)
        if selection is not None and selection.selected is not None:
            group = selection.rows // kv.n_kv_heads
            heads = torch.arange(selection.rows)[:, None] // group
            expected.append(torch.unique(heads * kv.n + selection.selected).numel() * kv.token_bytes())
        return selection

    method.select = recording
    out = generate(
        tiny_qwen2,
        method,
        random_ids(600, seed=34),
        max_new_tokens=24,
        min_new_tokens=24,
        budget=BudgetConfig(tokens=64),
    )
    assert len(expected) == 23 * (tiny_qwen2.spec.n_layers - 2)
    assert out.telemetry["bytes_h2d_fetch"] == sum(expected)
    assert out.telemetry["cache_hits"] == 0
