"""Batched k-means and product quantization, checked against structure and against faiss."""

import numpy as np
import pytest
import torch

from kvbench.methods.primitives.kmeans import assign, kmeans
from kvbench.methods.primitives.pq import comm_ratio, exact_scores, pq_encode, pq_fit, pq_scores
from kvbench.methods.selection import aggregate, topk_sorted


def blobs(problems=3, per=40, k=4, d=8, spread=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(problems, k, d, generator=g) * 5
    points = centers.repeat_interleave(per, dim=1) + spread * torch.randn(problems, k * per, d, generator=g)
    truth = torch.arange(k).repeat_interleave(per).expand(problems, -1)
    return points, truth


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(len(set(zip(x.tolist(), y.tolist()))) == len(set(x.tolist())) == len(set(y.tolist())) for x, y in zip(a, b))


def test_l2_recovers_separated_clusters_in_every_problem():
    x, truth = blobs()
    result = kmeans(x, 4, iters=30, seed=3, init="kmeans++", stop_when_stable=True)
    assert same_partition(result.labels, truth)
    assert result.iterations < 30
    assert torch.equal(assign(x, result.centroids), result.labels)


def test_cosine_groups_directions_whatever_the_magnitude():
    g = torch.Generator().manual_seed(1)
    directions = torch.nn.functional.normalize(torch.randn(3, 6, generator=g), dim=-1)
    labels = torch.arange(3).repeat(30)
    scale = torch.rand(90, generator=g) * 20 + 0.1  # magnitudes from 0.1 to 20: L2 would mix them
    x = (directions[labels] + 0.02 * torch.randn(90, 6, generator=g)) * scale[:, None]
    cos = kmeans(x[None], 3, iters=30, metric="cosine", seed=0, init="kmeans++", stop_when_stable=True)
    assert same_partition(cos.labels, labels[None])
    l2 = kmeans(x[None], 3, iters=30, metric="l2", seed=0, init="kmeans++")
    assert not same_partition(l2.labels, labels[None])
    # centroids are plain means of the assigned raw vectors (not renormalised)
    member = x[cos.labels[0] == cos.labels[0, 0]]
    assert torch.allclose(cos.centroids[0, cos.labels[0, 0]], member.mean(0), atol=1e-5)


def test_batched_equals_one_by_one():
    x, _ = blobs(problems=4, seed=2)
    together = kmeans(x, 5, iters=7, seed=11)
    for p in range(4):
        alone = kmeans(x[p : p + 1], 5, iters=7, seed=11)
        assert torch.equal(alone.labels[0], together.labels[p])
        assert torch.allclose(alone.centroids[0], together.centroids[p])


def test_empty_cluster_keeps_its_centroid_and_ip_metric_runs():
    x = torch.tensor([[[0.0], [0.1], [0.2], [10.0]]])
    start = torch.tensor([[[0.0], [10.0], [100.0]]])
    result = kmeans(x, 3, iters=3, init="given", init_centroids=start)
    assert result.centroids[0, 2].item() == 100.0
    ip = kmeans(blobs()[0], 4, iters=5, metric="ip", seed=0)
    assert ip.centroids.shape == (3, 4, 8)


def test_kmeans_objective_close_to_faiss():
    faiss = pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2000, 16, generator=g)
    ours = kmeans(x, 32, iters=20, seed=0)
    km = faiss.Kmeans(16, 32, niter=20, seed=1, verbose=False)
    km.train(x[0].numpy())
    distances, _ = km.index.search(x[0].numpy(), 1)
    assert float(ours.inertia[0]) <= 1.05 * float(distances.sum())


def test_pq_scores_equal_faiss_adc_for_the_same_codebooks():
    faiss = pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(2, 600, 16, generator=g)
    book = pq_fit(keys, 4, 8, iters=8, seed=0)
    queries = torch.randn(2, 3, 16, generator=g)
    ours = pq_scores(queries, book.centroids, book.codes)
    for head in range(2):
        pq = faiss.ProductQuantizer(16, 4, 8)
        faiss.copy_array_to_vector(book.centroids[head].numpy().astype(np.float32).ravel(), pq.centroids)
        codes = pq.compute_codes(keys[head].numpy())  # 8-bit codes: one byte per sub-space
        assert np.array_equal(codes, book.codes[head].numpy())
        q = np.ascontiguousarray(queries[head].numpy())
        tables = np.zeros((3, 4 * 256), dtype=np.float32)
        pq.compute_inner_prod_tables(3, faiss.swig_ptr(q), faiss.swig_ptr(tables))
        adc = tables.reshape(3, 4, 256)[:, np.arange(4)[None, :], codes.astype(np.int64)].sum(-1)  # [3, 600]
        assert np.allclose(ours[head].numpy(), adc, atol=1e-4)


def test_exact_codes_give_exact_scores_and_the_same_top_k():
    g = torch.Generator().manual_seed(7)
    keys = torch.randint(0, 4, (2, 200, 8), generator=g).float()  # 4 levels per dimension
    book = pq_fit(keys, 8, 2, iters=25, seed=0, init="kmeans++")  # m = d, 2**b = 4 levels: exact codes
    queries = torch.randn(2, 3, 8, generator=g)
    approx, exact = pq_scores(queries, book.centroids, book.codes), exact_scores(queries, keys)
    assert torch.allclose(approx, exact, atol=1e-4)
    pick = lambda s: topk_sorted(aggregate(s, "softmax_sum", 8**-0.5), 10)  # noqa: E731
    assert torch.equal(pick(approx), pick(exact))
    assert torch.equal(pq_encode(keys, book.centroids), book.codes)


def test_comm_ratio_of_the_papers_configs():
    assert comm_ratio(2, 6, 128) == 3 / 512
    assert comm_ratio(4, 8, 128) == 1 / 64
