"""scikit-learn semantics of the batched k-means (``SKLEARN``: tolerance stop and empty-cluster
relocation), checked against scikit-learn's own ``KMeans`` from the same initial centroids, and the
relocation rule on hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from kvbench.methods.primitives.kmeans import SKLEARN, _Points, kmeans


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def overlapping(problems: int, n: int, d: int, centres: int, seed: int) -> torch.Tensor:
    """Blobs that overlap, so Lloyd needs several iterations and labels move until late."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(problems, centres, d, generator=g) * 2
    pick = torch.randint(0, centres, (problems, n), generator=g)
    return torch.gather(means, 1, pick[..., None].expand(-1, -1, d)) + torch.randn(problems, n, d, generator=g)


def sklearn_fit(points: torch.Tensor, start: torch.Tensor, iters: int, tol: float) -> KMeans:
    model = KMeans(
        n_clusters=start.shape[0],
        init=start.numpy().astype(np.float64),
        n_init=1,
        max_iter=iters,
        tol=tol,
        algorithm="lloyd",
    )
    return model.fit(points.numpy().astype(np.float64))


def check_like_sklearn(x: torch.Tensor, k: int, iters: int, tol: float, extra: int) -> list[KMeans]:
    """Our batched run and scikit-learn per problem from the same start: the same labels and centres
    within float32 rounding; scikit-learn's ``n_iter_`` is our ``updates`` plus ``extra`` (1 when it
    stops on unchanged labels: it counts the no-op update it runs then; 0 on the tolerance or the cap)."""
    start = kmeans(x, k, iters=0, seed=3).centroids
    ours = kmeans(x, k, iters=iters, init="given", init_centroids=start, **{**SKLEARN, "tol": tol})
    fits = []
    for p in range(x.shape[0]):
        ref = sklearn_fit(x[p], start[p], iters, tol)
        assert np.array_equal(ours.labels[p].numpy(), ref.labels_)
        assert np.allclose(ours.centroids[p].numpy(), ref.cluster_centers_, atol=1e-4)
        assert float(ours.inertia[p]) == pytest.approx(ref.inertia_, rel=1e-4)
        assert ref.n_iter_ == int(ours.updates[p]) + extra
        fits.append(ref)
    assert ours.iterations == int(ours.updates.max())
    return fits


def test_default_tolerance_matches_sklearn_per_problem():
    x = overlapping(problems=4, n=300, d=5, centres=6, seed=0)
    fits = check_like_sklearn(x, 8, iters=100, tol=1e-4, extra=1)  # these stop on unchanged labels
    assert len({f.n_iter_ for f in fits}) > 1  # the problems stopped at different iterations


def test_loose_tolerance_stops_on_the_centre_shift():
    x = overlapping(problems=3, n=300, d=4, centres=5, seed=1)
    fits = check_like_sklearn(x, 6, iters=100, tol=0.05, extra=0)
    strict = check_like_sklearn(x, 6, iters=100, tol=1e-9, extra=1)
    assert all(loose.n_iter_ < tight.n_iter_ for loose, tight in zip(fits, strict))


def test_iteration_cap_and_final_assignment_match_sklearn():
    x = overlapping(problems=2, n=400, d=3, centres=8, seed=2)
    fits = check_like_sklearn(x, 10, iters=2, tol=1e-4, extra=0)
    assert all(f.n_iter_ == 2 for f in fits)


def test_tolerance_scale_is_the_mean_feature_variance_of_valid_points():
    x = overlapping(problems=2, n=50, d=3, centres=2, seed=4)
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, 30:] = False
    scale = _Points(x, "l2", None, 16, 1).mean_variance(valid)
    assert float(scale[0]) == pytest.approx(float(np.var(x[0].numpy().astype(np.float64), axis=0).mean()), rel=1e-5)
    assert float(scale[1]) == pytest.approx(
        float(np.var(x[1, :30].numpy().astype(np.float64), axis=0).mean()), rel=1e-5
    )


# ----------------------------------------------------------------------------- relocation


def test_an_empty_cluster_takes_the_point_farthest_from_its_centroid():
    x = torch.tensor([[[0.0], [0.1], [0.2], [10.0]]])
    start = torch.tensor([[[0.0], [10.0], [100.0]]])
    # First assignment: {0, 0.1, 0.2} → 0, {10} → 1, cluster 2 empty. The point farthest from its own
    # centroid is 0.2 (0.04 from 0): it becomes centroid 2 and leaves cluster 0's mean (0 + 0.1) / 2.
    result = kmeans(x, 3, iters=1, init="given", init_centroids=start, empty="relocate")
    assert torch.allclose(result.centroids[0, :, 0], torch.tensor([0.05, 10.0, 0.2]))
    assert result.labels.tolist() == [[0, 0, 2, 1]] and result.counts.tolist() == [[2, 1, 1]]
    ref = sklearn_fit(x[0], start[0], iters=1, tol=1e-4)
    assert np.allclose(ref.cluster_centers_[:, 0], [0.05, 10.0, 0.2]) and ref.labels_.tolist() == [0, 0, 2, 1]
    kept = kmeans(x, 3, iters=1, init="given", init_centroids=start)  # the default rule keeps it at 100
    assert kept.centroids[0, 2].item() == 100.0


def test_several_empty_clusters_take_the_farthest_points_in_order():
    x = torch.tensor([[[0.0], [1.0], [3.0], [6.0], [20.0]]])
    start = torch.tensor([[[0.0], [50.0], [20.0], [60.0]]])
    # All of 0, 1, 3, 6 go to centroid 0 (distances² 0, 1, 9, 36), 20 to centroid 2; clusters 1 and 3
    # are empty. The farthest point (6) goes to cluster 1, the next (3) to cluster 3.
    result = kmeans(x, 4, iters=1, init="given", init_centroids=start, empty="relocate")
    assert torch.allclose(result.centroids[0, :, 0], torch.tensor([0.5, 6.0, 20.0, 3.0]))
    assert result.labels.tolist() == [[0, 0, 3, 1, 2]]
    # The same set of centres as scikit-learn (its pairing order among the farthest points is unspecified).
    ref = sklearn_fit(x[0], start[0], iters=1, tol=1e-4)
    assert sorted(ref.cluster_centers_[:, 0].tolist()) == pytest.approx([0.5, 3.0, 6.0, 20.0])


def test_relocation_moves_only_valid_points_and_nothing_when_all_points_sit_on_centroids():
    x = torch.tensor([[[0.0], [0.1], [0.2], [10.0], [500.0]]])
    valid = torch.tensor([[True, True, True, True, False]])  # 500 is the farthest point but padding
    start = torch.tensor([[[0.0], [10.0], [100.0]]])
    result = kmeans(x, 3, iters=1, init="given", init_centroids=start, empty="relocate", valid=valid)
    assert torch.allclose(result.centroids[0, :, 0], torch.tensor([0.05, 10.0, 0.2]))
    # Fewer distinct points than clusters: every point is on its centroid, the duplicates stay empty.
    few = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 5.0]]])
    relocated = kmeans(few, 5, iters=3, empty="relocate")
    kept = kmeans(few, 5, iters=3)
    assert torch.equal(relocated.centroids, kept.centroids) and torch.equal(relocated.labels, kept.labels)


def test_relocation_matches_sklearn_when_clusters_empty_out():
    # A start with three centroids far from every point: each first assignment empties them.
    x = overlapping(problems=3, n=200, d=2, centres=3, seed=5)
    start = kmeans(x, 6, iters=0, seed=1).centroids
    start[:, 3:] = 1e3 + torch.arange(3.0)[None, :, None]
    ours = kmeans(x, 6, iters=100, init="given", init_centroids=start, **SKLEARN)
    assert (ours.counts > 0).all()
    for p in range(3):
        ref = sklearn_fit(x[p], start[p], 100, 1e-4)
        # The set of centres is sklearn's; with 3 empties the pairing order may differ, so compare
        # the clusterings up to a renaming and the sorted centres.
        pairs = set(zip(ours.labels[p].tolist(), ref.labels_.tolist()))
        assert len(pairs) == len(set(ref.labels_.tolist()))
        assert float(ours.inertia[p]) == pytest.approx(ref.inertia_, rel=1e-4)


# ----------------------------------------------------------------------------- per-problem stopping


@pytest.mark.parametrize("options", [{"stop_when_stable": True}, {"tol": 1e-3}, SKLEARN])
def test_each_problem_stops_on_its_own_as_if_alone(options):
    x = overlapping(problems=4, n=200, d=4, centres=5, seed=6)
    together = kmeans(x, 6, iters=50, seed=2, **options)
    assert len(set(together.updates.tolist())) > 1
    for p in range(4):
        alone = kmeans(x[p : p + 1], 6, iters=50, seed=2, **options)
        assert int(alone.updates[0]) == int(together.updates[p])
        assert torch.equal(alone.labels[0], together.labels[p])
        assert torch.allclose(alone.centroids[0], together.centroids[p], atol=1e-6)
        assert torch.allclose(alone.inertia[0], together.inertia[p], rtol=1e-5)
        assert torch.equal(alone.counts[0], together.counts[p])


def test_bad_semantics_options_are_refused():
    x = overlapping(problems=1, n=20, d=2, centres=2, seed=7)
    with pytest.raises(ValueError, match="empty-cluster rule"):
        kmeans(x, 2, iters=1, empty="split")
    with pytest.raises(ValueError, match="tol"):
        kmeans(x, 2, iters=1, tol=-1.0)


def test_relocation_in_the_ip_space_batched_as_alone():
    """``ip`` relocates in the augmented space (the same as l2 k-means on the augmented points), and
    a problem that relocates gets the same result in a batch (whose problems stop at different
    iterations) as alone."""
    x = overlapping(problems=3, n=120, d=3, centres=3, seed=8)
    start = kmeans(x, 5, iters=0, seed=2).centroids
    start[0, 3:] = 50.0  # problem 0 starts with two clusters no point will choose
    norms = (x**2).sum(-1)
    phi = norms.amax(1)
    augmented = torch.cat([x, (phi[:, None] - norms).clamp_min(0).sqrt()[..., None]], -1)
    start_aug = torch.cat([start, (phi[:, None, None] - (start**2).sum(-1, keepdim=True)).clamp_min(0).sqrt()], -1)
    ip = kmeans(x, 5, iters=30, metric="ip", init="given", init_centroids=start, **SKLEARN)
    ref = kmeans(augmented, 5, iters=30, init="given", init_centroids=start_aug, **SKLEARN)
    assert torch.equal(ip.labels, ref.labels) and torch.equal(ip.updates, ref.updates)
    assert torch.allclose(ip.centroids, ref.centroids[..., :-1], atol=1e-5)
    assert (ip.counts[0] > 0).all()  # the two far clusters were refilled
    for p in range(3):
        alone = kmeans(x[p : p + 1], 5, iters=30, metric="ip", init="given", init_centroids=start[p : p + 1], **SKLEARN)
        assert torch.equal(alone.labels[0], ip.labels[p]) and int(alone.updates[0]) == int(ip.updates[p])
        assert torch.allclose(alone.centroids[0], ip.centroids[p], atol=1e-6)
