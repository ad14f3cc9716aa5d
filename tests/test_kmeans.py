"""Batched k-means: cluster recovery, batching, empty clusters, early stop, memory chunks, and faiss
as an oracle for the objective."""

from __future__ import annotations

import pytest
import torch

from kvbench.methods.primitives import kmeans as kmeans_module
from kvbench.methods.primitives.kmeans import (
    CPU_CHUNK,
    CPU_DISTANCE_BUDGET,
    DISTANCE_BUDGET,
    MIN_CHUNK,
    SKLEARN,
    _best,
    assign,
    default_chunk,
    group_size,
    kmeans,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These problems are tiny: on a loaded 2-core machine, waking a second thread for every small op
    costs more than the op itself."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def blobs(problems: int = 3, per: int = 40, k: int = 4, d: int = 8, spread: float = 0.05, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(problems, k, d, generator=g) * 5
    points = centers.repeat_interleave(per, dim=1) + spread * torch.randn(problems, k * per, d, generator=g)
    truth = torch.arange(k).repeat_interleave(per).expand(problems, -1)
    return points, truth


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal partitions up to a renaming of the clusters, in every problem."""
    for x, y in zip(a.tolist(), b.tolist()):
        pairs = set(zip(x, y))
        if not len(pairs) == len(set(x)) == len(set(y)):
            return False
    return True


def objective(x: torch.Tensor, centroids: torch.Tensor, labels: torch.Tensor, metric: str) -> torch.Tensor:
    """The k-means objective recomputed naively from labels (reference for ``inertia``)."""
    chosen = torch.gather(centroids, 1, labels[..., None].expand(-1, -1, centroids.shape[-1]))
    if metric == "cosine":
        return (1 - torch.nn.functional.cosine_similarity(x, chosen, dim=-1)).sum(1)
    return ((x - chosen) ** 2).sum(-1).sum(1)


# ----------------------------------------------------------------------------- recovery


def test_l2_recovers_separated_clusters_in_every_problem():
    x, truth = blobs()
    result = kmeans(x, 4, iters=30, seed=3, init="kmeans++", stop_when_stable=True)
    assert same_partition(result.labels, truth)
    assert result.labels.dtype == torch.int64 and result.labels.shape == (3, 160)
    assert torch.equal(result.counts, torch.full((3, 4), 40))
    assert result.iterations < 30
    assert torch.equal(assign(x, result.centroids), result.labels)


def test_cosine_groups_directions_whatever_the_magnitude():
    g = torch.Generator().manual_seed(1)
    directions = torch.nn.functional.normalize(torch.randn(3, 6, generator=g), dim=-1)
    truth = torch.arange(3).repeat(40)
    scale = torch.rand(120, generator=g) * 20 + 0.1  # magnitudes from 0.1 to 20: L2 mixes them up
    x = ((directions[truth] + 0.02 * torch.randn(120, 6, generator=g)) * scale[:, None])[None]
    cos = kmeans(x, 3, iters=30, metric="cosine", seed=0, init="kmeans++", stop_when_stable=True)
    assert same_partition(cos.labels, truth[None])
    l2 = kmeans(x, 3, iters=30, metric="l2", seed=0, init="kmeans++")
    assert not same_partition(l2.labels, truth[None])
    # The centroid is the plain mean of the raw members (not renormalised, not the mean direction).
    for c in range(3):
        members = x[0, cos.labels[0] == c]
        assert torch.allclose(cos.centroids[0, c], members.mean(0), atol=1e-5)
    assert not torch.allclose(cos.centroids.norm(dim=-1), torch.ones(1, 3), atol=0.1)


def test_random_init_uses_distinct_rows_shared_by_all_problems():
    x, _ = blobs(problems=4, per=10)
    start = kmeans(x, 6, iters=0, seed=5)  # no update: the initial centroids
    rows = [[int((x[p] == c).all(-1).nonzero()[0]) for c in start.centroids[p]] for p in range(4)]
    assert len(set(rows[0])) == 6
    assert all(r == rows[0] for r in rows)
    unshared = kmeans(x, 6, iters=0, seed=5, shared_init=False)
    other = [[int((x[p] == c).all(-1).nonzero()[0]) for c in unshared.centroids[p]] for p in range(4)]
    assert all(len(set(r)) == 6 for r in other) and len({tuple(r) for r in other}) > 1
    assert not torch.equal(kmeans(x, 6, iters=0, seed=6).centroids, start.centroids)


def test_fewer_points_than_clusters_reuses_points_and_keeps_k():
    x = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 5.0]]])
    result = kmeans(x, 5, iters=4)
    assert result.centroids.shape == (1, 5, 2)
    assert float(result.inertia[0]) == 0.0  # every point is its own centroid
    assert int(result.counts.sum()) == 3 and int((result.counts > 0).sum()) == 3
    assert torch.equal(assign(x, result.centroids), result.labels)


# ----------------------------------------------------------------------------- batching


@pytest.mark.parametrize(
    "metric, init",
    [("l2", "random"), ("cosine", "random"), ("ip", "random"), ("l2", "kmeans++"), ("cosine", "kmeans++")],
)
def test_batched_equals_one_by_one(metric: str, init: str):
    x, _ = blobs(problems=4, seed=2, spread=1.0)
    together = kmeans(x, 5, iters=6, seed=11, metric=metric, init=init)
    for p in range(4):
        alone = kmeans(x[p : p + 1], 5, iters=6, seed=11, metric=metric, init=init)
        assert torch.equal(alone.labels[0], together.labels[p])
        assert torch.allclose(alone.centroids[0], together.centroids[p], atol=1e-6)
        assert torch.allclose(alone.inertia[0], together.inertia[p], rtol=1e-5)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_chunked_assignment_equals_one_block(metric: str, monkeypatch):
    x, _ = blobs(problems=3, per=50, spread=1.0, seed=4)
    valid = torch.ones(3, 200, dtype=torch.bool)
    valid[1, 150:] = False
    options = dict(iters=8, seed=1, metric=metric, valid=valid, **SKLEARN)
    whole = kmeans(x, 7, chunk=10_000, **options)
    assert len(set(whole.updates.tolist())) > 1  # problems leave the batch at different sweeps
    pieces = kmeans(x, 7, chunk=7, **options)
    monkeypatch.setattr(kmeans_module, "WORK_CACHE_BYTES", 0)  # refill a buffer per chunk instead
    monkeypatch.setattr(kmeans_module, "CPU_DISTANCE_BUDGET", 7 * 7 * 2)  # 2 problems per step
    refilled = kmeans(x, 7, chunk=7, **options)
    for other in (pieces, refilled):
        assert torch.equal(whole.labels, other.labels) and torch.equal(whole.updates, other.updates)
        assert torch.allclose(whole.centroids, other.centroids, atol=1e-5)
        assert torch.allclose(whole.inertia, other.inertia, rtol=1e-5)
    assert torch.equal(assign(x, whole.centroids, metric, chunk=3, phi=whole.phi, extra=whole.extra), whole.labels)


@pytest.mark.parametrize(
    "options",
    [
        {"metric": "l2", **SKLEARN},
        {"metric": "cosine", "stop_when_stable": True},
        {"metric": "ip", "empty": "relocate"},
    ],
)
def test_atomic_sums_give_the_serial_result(options: dict, monkeypatch: pytest.MonkeyPatch):
    """The CUDA default accumulates counts and sums with atomic ``index_add_`` (no host read, no sort);
    forced onto the CPU it gives what ``bincount`` + ``index_put_`` give: same labels, counts and
    updates, centroids to rounding (ragged valid points, several problems per step, chunked)."""
    x, _ = blobs(problems=3, per=50, spread=1.0, seed=9)
    valid = torch.ones(3, 200, dtype=torch.bool)
    valid[2, 120:] = False
    monkeypatch.setattr(kmeans_module, "CPU_DISTANCE_BUDGET", 7 * 9 * 2)  # 2 problems per step
    results = []
    for atomic in (False, True):
        monkeypatch.setattr(kmeans_module, "ATOMIC_SUMS", atomic)
        results.append(kmeans(x, 7, iters=12, seed=3, chunk=9, valid=valid, **options))
    serial, atomic_ = results
    assert torch.equal(serial.labels, atomic_.labels) and torch.equal(serial.counts, atomic_.counts)
    assert torch.equal(serial.updates, atomic_.updates) and int(serial.updates.max()) > 1
    torch.testing.assert_close(serial.centroids, atomic_.centroids, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(serial.inertia, atomic_.inertia, rtol=1e-5, atol=1e-5)
    assert kmeans_module._atomic_sums(torch.device("cpu")) is True  # the forced setting wins
    monkeypatch.setattr(kmeans_module, "ATOMIC_SUMS", None)
    assert not kmeans_module._atomic_sums(torch.device("cpu"))
    assert kmeans_module._atomic_sums(torch.device("cuda"))


def test_default_chunk_bounds_the_distance_block():
    # The PQCache shape of the brief: 16 problems of 131072 points, 64 clusters.
    rows = default_chunk(16, 64, 131072, "cuda")
    assert rows * 16 * 64 == DISTANCE_BUDGET  # 256 MiB of float32 scores at a time on CUDA
    assert rows * 16 * 64 * 4 + rows * 16 * 65 * 4 <= 2**30  # plus one float32 chunk of 65 columns: 1 GiB
    assert group_size(16, 64, rows, "cuda") == 16
    cpu = default_chunk(16, 64, 131072)  # CPU: up to CPU_CHUNK points of as many problems as fit in 4 MiB
    assert cpu == CPU_CHUNK and cpu * group_size(16, 64, cpu) * 64 == CPU_DISTANCE_BUDGET
    assert group_size(32, 256, default_chunk(32, 256)) == 1 and default_chunk(1, 10**6) == MIN_CHUNK
    torch.set_num_threads(2)  # several threads: 4x larger steps (fewer barriers)
    try:
        many = default_chunk(16, 64, 131072)
        assert many == 4 * CPU_CHUNK and many * group_size(16, 64, many) * 64 == 4 * CPU_DISTANCE_BUDGET
    finally:
        torch.set_num_threads(1)
    assert default_chunk(1, 1, 50) == 50 and default_chunk(10**6, 10**6) >= 1


@pytest.mark.skipif(kmeans_module._onednn_linear() is None, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("metric", ["l2", "cosine"])
def test_onednn_steps_give_the_mkl_result(monkeypatch: pytest.MonkeyPatch, metric: str):
    """CPU steps of at least ONEDNN_MIN_PRODUCTS multiply-adds score the points with oneDNN, one call
    per problem, instead of one batched MKL ``bmm``: same labels, same centroids (to rounding)."""
    x = torch.randn(3, 3000, 32, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(kmeans_module, "ONEDNN_MIN_PRODUCTS", 0)
    onednn = kmeans(x, 48, iters=5, metric=metric, chunk=1024)
    monkeypatch.setattr(kmeans_module, "ONEDNN_MIN_PRODUCTS", 1 << 62)
    mkl = kmeans(x, 48, iters=5, metric=metric, chunk=1024)
    assert torch.equal(onednn.labels, mkl.labels) and torch.equal(onednn.counts, mkl.counts)
    torch.testing.assert_close(onednn.centroids, mkl.centroids, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"iters": 6, "init": "random"},
        {"iters": 20, "init": "random", "shared_init": False, **SKLEARN},
        {"iters": 20, "metric": "cosine", "init": "kmeans++", "stop_when_stable": True},
        {"iters": 8, "metric": "ip", "init": "kmeans++", "shared_init": False, "empty": "relocate"},
    ],
)
def test_several_threads_cluster_shares_to_the_single_threaded_result(options: dict):
    """With several CPU threads the problems are split into shares, one single-threaded call per
    thread: the result is the single-threaded one bit for bit (3 problems on 2 threads: uneven
    shares, ragged valid points, problems that stop at different updates), and the caller's thread
    count is unchanged afterwards."""
    x, _ = blobs(problems=3, per=30, k=5, d=6, spread=0.6, seed=4)
    valid = torch.rand(3, x.shape[1], generator=torch.Generator().manual_seed(1)) > 0.2
    alone = kmeans(x, 9, seed=2, valid=valid, **options)
    torch.set_num_threads(2)
    try:
        shared = kmeans(x, 9, seed=2, valid=valid, **options)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    for field in ("centroids", "labels", "inertia", "counts", "phi", "extra", "updates"):
        a, b = getattr(alone, field), getattr(shared, field)
        assert (a is None and b is None) or torch.equal(a, b), field
    assert shared.iterations == alone.iterations
    if options.get("stop_when_stable") or options.get("tol"):
        assert alone.updates is not None and len(set(alone.updates.tolist())) > 1  # they stop apart


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("problems, k, c", [(1, 5, 64), (1, 7, 13), (3, 64, 40)])
def test_best_is_the_first_maximum_over_centroids(threads: int, problems: int, k: int, c: int):
    """The pooled reduction (split into column blocks for the threads when there are few problems)
    equals ``max`` over dim 1, ties included: integer scores tie often, and the first index wins."""
    scores = torch.randint(0, 4, (problems, k, c), generator=torch.Generator().manual_seed(k)).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        value, index = _best(scores)
    finally:
        torch.set_num_threads(before)
    first = (scores == scores.amax(dim=1, keepdim=True)).float().argmax(dim=1)  # first maximum
    assert torch.equal(value, scores.amax(dim=1)) and torch.equal(index, first)


def test_half_precision_input_gives_the_float32_result():
    x, _ = blobs(problems=2, spread=1.0)
    x16 = x.half()
    a = kmeans(x16, 4, iters=5, seed=0)
    b = kmeans(x16.float(), 4, iters=5, seed=0)
    assert a.centroids.dtype == torch.float32
    assert torch.equal(a.labels, b.labels) and torch.allclose(a.centroids, b.centroids)


# ----------------------------------------------------------------------------- update rules


def test_empty_cluster_keeps_its_centroid():
    x = torch.tensor([[[0.0], [0.1], [0.2], [10.0]]])
    start = torch.tensor([[[0.0], [10.0], [100.0]]])
    result = kmeans(x, 3, iters=3, init="given", init_centroids=start)
    assert result.centroids[0, 2].item() == 100.0
    assert result.counts.tolist() == [[3, 1, 0]]
    assert torch.allclose(result.centroids[0, :2, 0], torch.tensor([0.1, 10.0]))
    assert start[0, 2].item() == 100.0  # the caller's tensor is untouched


def test_invalid_points_never_move_a_centroid():
    x, _ = blobs(problems=2, per=30, spread=1.0, seed=8)
    valid = torch.ones(2, 120, dtype=torch.bool)
    valid[0, 90:] = False  # problem 0 is ragged: only its first 90 points count
    start = kmeans(x, 5, iters=0, seed=2).centroids
    masked = kmeans(x, 5, iters=6, init="given", init_centroids=start, valid=valid)
    subset = kmeans(x[:1, :90], 5, iters=6, init="given", init_centroids=start[:1])
    assert torch.allclose(masked.centroids[0], subset.centroids[0], atol=1e-6)
    assert torch.equal(masked.labels[0, :90], subset.labels[0])
    assert int(masked.counts[0].sum()) == 90 and int(masked.counts[1].sum()) == 120
    assert torch.allclose(masked.inertia[0], subset.inertia[0], rtol=1e-5)
    # Random initial rows come from the valid points only, and an all-true mask changes nothing.
    picked = kmeans(x, 5, iters=0, seed=3, valid=valid, shared_init=False).centroids[0]
    assert all(int((x[0] == c).all(-1).nonzero()[0]) < 90 for c in picked)
    full = torch.ones_like(valid)
    assert torch.equal(kmeans(x, 5, iters=3, seed=3, valid=full).labels, kmeans(x, 5, iters=3, seed=3).labels)


def test_stop_when_stable_stops_early_at_the_fixed_point():
    x, _ = blobs(problems=2, spread=0.05)
    early = kmeans(x, 4, iters=50, seed=0, init="kmeans++", stop_when_stable=True)
    fixed = kmeans(x, 4, iters=50, seed=0, init="kmeans++")
    assert 1 <= early.iterations < 10
    assert fixed.iterations == 50
    assert torch.equal(early.labels, fixed.labels)
    assert torch.allclose(early.centroids, fixed.centroids, atol=1e-6)
    noise = torch.randn(1, 400, 4, generator=torch.Generator().manual_seed(0))
    capped = kmeans(noise, 20, iters=2, stop_when_stable=True)
    assert capped.iterations == 2


@pytest.mark.parametrize("metric", ["l2", "cosine", "ip"])
def test_labels_and_inertia_match_the_returned_centroids(metric: str):
    x, _ = blobs(problems=3, spread=2.0, seed=9)
    result = kmeans(x, 6, iters=4, seed=0, metric=metric)
    labels = assign(x, result.centroids, metric, phi=result.phi, extra=result.extra)
    assert torch.equal(labels, result.labels)
    assert torch.equal(result.counts, torch.nn.functional.one_hot(result.labels, 6).sum(1))
    if metric != "ip":
        assert torch.allclose(result.inertia, objective(x, result.centroids, result.labels, metric), rtol=1e-4)


def test_ip_metric_clusters_the_augmented_points():
    x, _ = blobs(problems=2, spread=1.0, seed=3)
    result = kmeans(x, 5, iters=5, metric="ip", seed=1)
    norms = (x**2).sum(-1)
    assert torch.allclose(result.phi, norms.amax(1))
    # Augmented points all have norm² = φ, so the augmented centroid is the mean of those points.
    augmented = torch.cat([x, (result.phi[:, None] - norms).clamp_min(0).sqrt()[..., None]], -1)
    reference = kmeans(augmented, 5, iters=5, metric="l2", seed=1)
    assert torch.equal(reference.labels, result.labels)
    assert torch.allclose(reference.centroids[..., :-1], result.centroids, atol=1e-5)
    assert torch.allclose(reference.centroids[..., -1], result.extra, atol=1e-4)
    with pytest.raises(ValueError, match="phi and extra"):
        assign(x, result.centroids, "ip")


def test_bad_arguments_are_refused():
    x, _ = blobs(problems=1)
    with pytest.raises(ValueError, match="metric"):
        kmeans(x, 2, iters=1, metric="manhattan")
    with pytest.raises(ValueError, match="init"):
        kmeans(x, 2, iters=1, init="nope")
    with pytest.raises(ValueError, match="init_centroids"):
        kmeans(x, 2, iters=1, init="given")


# ----------------------------------------------------------------------------- faiss as an oracle


def test_objective_matches_faiss_from_the_same_start_and_is_close_from_its_own():
    faiss = pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2000, 16, generator=g)
    ours = kmeans(x, 32, iters=20, seed=0)
    start = kmeans(x, 32, iters=0, seed=0).centroids
    for p in range(2):
        data = x[p].numpy()
        same = faiss.Kmeans(
            16, 32, niter=20, seed=1, verbose=False, min_points_per_centroid=1, max_points_per_centroid=10**6
        )
        same.train(data, init_centroids=start[p].numpy())
        d_same, _ = same.index.search(data, 1)
        assert float(ours.inertia[p]) == pytest.approx(float(d_same.sum()), rel=2e-3)
        own = faiss.Kmeans(
            16, 32, niter=20, seed=1, verbose=False, min_points_per_centroid=1, max_points_per_centroid=10**6
        )
        own.train(data)
        d_own, _ = own.index.search(data, 1)
        assert float(ours.inertia[p]) == pytest.approx(float(d_own.sum()), rel=0.05)


@pytest.mark.parametrize("metric", ["l2", "ip"])
def test_faiss_backend_agrees_with_torch(metric: str):
    pytest.importorskip("faiss")
    from kvbench.methods.primitives import faiss_backend

    x, _ = blobs(problems=2, per=100, spread=1.5, seed=12)
    ours = kmeans(x, 8, iters=10, seed=4, metric=metric)
    theirs = faiss_backend.kmeans(x, 8, iters=10, seed=4, metric=metric)
    assert theirs.centroids.shape == ours.centroids.shape and theirs.iterations == 10
    assert torch.allclose(theirs.inertia, ours.inertia, rtol=1e-3)
    assert torch.equal(assign(x, theirs.centroids, metric, phi=theirs.phi, extra=theirs.extra), theirs.labels)
    with pytest.raises(NotImplementedError):
        faiss_backend.kmeans(x, 8, iters=10, stop_when_stable=True)
    with pytest.raises(NotImplementedError, match="tol"):
        faiss_backend.kmeans(x, 8, iters=10, tol=1e-4)
    with pytest.raises(NotImplementedError, match="splits"):
        faiss_backend.kmeans(x, 8, iters=10, empty="relocate")


def test_faiss_backend_cosine_returns_plain_mean_centroids():
    pytest.importorskip("faiss")
    from kvbench.methods.primitives import faiss_backend

    x, _ = blobs(problems=1, per=50, spread=1.0, seed=13)
    scaled = x * torch.linspace(0.5, 3, 200)[None, :, None]
    result = faiss_backend.kmeans(scaled, 4, iters=8, metric="cosine")
    assert torch.equal(assign(x, result.centroids, "cosine"), result.labels)  # cosine ignores the scale
    assert float(result.inertia[0]) < 0.2 * 200  # directions are well grouped
    assert (result.centroids.norm(dim=-1) > 2).all()  # raw means of long vectors, not unit vectors
