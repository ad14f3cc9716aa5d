"""Product quantization and PQ search: faiss ADC as an oracle, exact codes, encoding, GQA top-k rules,
communication accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.methods.primitives.pq import (
    code_dtype,
    comm_ratio,
    exact_scores,
    gqa_topk,
    group_scores,
    pq_encode,
    pq_fit,
    pq_scores,
    topk_ascending,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny problems: a second thread per small op only costs time on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest per row by a stable descending sort (ties to the lower index), ascending."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


# ----------------------------------------------------------------------------- fit / encode / scores


def test_pq_fit_shapes_dtypes_and_encode_reproduces_the_codes():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 300, 16, generator=g)
    book = pq_fit(keys, 2, 6, iters=5, seed=0)
    assert book.centroids.shape == (3, 2, 64, 8) and book.centroids.dtype == torch.float32
    assert book.codes.shape == (3, 300, 2) and book.codes.dtype == torch.uint8
    assert int(book.codes.max()) < 64 and book.iterations == 5 and book.m == 2 and book.bits == 6
    assert torch.equal(pq_encode(keys, book.centroids), book.codes)
    assert torch.equal(pq_encode(keys.half(), book.centroids), pq_encode(keys.half().float(), book.centroids))
    wide = pq_fit(keys[:, :40], 4, 9, iters=1)
    assert wide.codes.dtype == torch.int16 and wide.centroids.shape == (3, 4, 512, 4)
    assert code_dtype(8) == torch.uint8 and code_dtype(15) == torch.int16 and code_dtype(16) == torch.int32


def test_pq_fit_is_one_batched_kmeans_over_groups_and_subspaces():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 200, 8, generator=g)
    together = pq_fit(keys, 2, 3, iters=4, seed=7)
    for head in range(2):
        alone = pq_fit(keys[head : head + 1], 2, 3, iters=4, seed=7)
        assert torch.equal(alone.codes[0], together.codes[head])
        assert torch.allclose(alone.centroids[0], together.centroids[head], atol=1e-6)
    # Sub-space j of group g sees exactly the j-th slice of the keys.
    sub = pq_fit(keys[:, :, 4:], 1, 3, iters=4, seed=7)
    assert torch.allclose(sub.centroids[:, 0], together.centroids[:, 1], atol=1e-6)


def test_ip_codebook_codes_new_keys_in_the_augmented_space():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 150, 8, generator=g) * torch.linspace(0.2, 3, 150)[None, :, None]
    book = pq_fit(keys, 2, 4, iters=6, metric="ip")
    assert book.phi.shape == (2, 2) and book.extra.shape == (2, 2, 16)
    codes = pq_encode(keys, book.centroids, metric="ip", phi=book.phi, extra=book.extra)
    assert torch.equal(codes, book.codes)


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
        codes = pq.compute_codes(np.ascontiguousarray(keys[head].numpy()))  # one byte per sub-space at 8 bits
        assert np.array_equal(codes, book.codes[head].numpy())
        q = np.ascontiguousarray(queries[head].numpy())
        tables = np.zeros((3, 4 * 256), dtype=np.float32)
        pq.compute_inner_prod_tables(3, faiss.swig_ptr(q), faiss.swig_ptr(tables))
        tables = tables.reshape(3, 4, 256)
        adc = sum(tables[:, j, codes[:, j].astype(np.int64)] for j in range(4))  # [3, 600]
        np.testing.assert_allclose(ours[head].numpy(), adc, rtol=1e-5, atol=1e-5)


def test_exact_codes_give_exact_scores_and_the_same_top_k():
    g = torch.Generator().manual_seed(7)
    keys = torch.randint(-2, 2, (2, 300, 8), generator=g).float() * 0.5  # 4 levels per dimension
    book = pq_fit(keys, 8, 2, iters=10, seed=0, init="kmeans++")  # m = d, 2**b = 4 levels: exact codes
    reconstructed = torch.gather(book.centroids[..., 0], 2, book.codes.long().permute(0, 2, 1)).permute(0, 2, 1)
    assert torch.equal(reconstructed, keys)
    queries = torch.randn(2, 4, 8, generator=g)
    approx, exact = pq_scores(queries, book.centroids, book.codes), exact_scores(queries, keys)
    assert torch.allclose(approx, exact, atol=1e-5)
    for rule in ("softmax_sum", "logit_sum", "max"):
        assert torch.equal(gqa_topk(approx, 20, rule, scale=8**-0.5), gqa_topk(exact, 20, rule, scale=8**-0.5))


def test_pq_scores_approximate_exact_scores_and_agree_with_the_faiss_backend():
    pytest.importorskip("faiss")
    from kvbench.methods.primitives import faiss_backend

    g = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 512, 16, generator=g)
    queries = torch.randn(2, 2, 16, generator=g)
    exact = exact_scores(queries, keys)
    for fit in (pq_fit, faiss_backend.pq_fit):
        book = fit(keys, 4, 4, iters=10, seed=0)
        assert torch.equal(pq_encode(keys, book.centroids), book.codes)
        error = (pq_scores(queries, book.centroids, book.codes) - exact).pow(2).mean()
        assert float(error) < 0.5 * float(exact.pow(2).mean())


def test_pq_scores_reject_mismatched_shapes():
    book = pq_fit(torch.randn(2, 40, 8), 2, 2, iters=1)
    with pytest.raises(ValueError):
        pq_scores(torch.randn(2, 1, 6), book.centroids, book.codes)
    with pytest.raises(ValueError):
        pq_fit(torch.randn(1, 40, 9), 2, 2, iters=1)


# ----------------------------------------------------------------------------- GQA top-k


def test_softmax_sum_and_logit_sum_pick_different_tokens():
    # Two query heads of one KV head, three tokens, scale 1.
    logits = torch.tensor([[[5.0, 20.0, 0.0], [5.0, -20.0, 6.0]]])
    # softmax per head: head 0 ≈ [0, 1, 0]; head 1 ≈ [0.269, 0, 0.731] → sums ≈ [0.269, 1.0, 0.731]
    sums = group_scores(logits, "softmax_sum", scale=1.0)
    assert torch.allclose(sums, torch.tensor([[0.2689, 1.0, 0.7311]]), atol=1e-3)
    assert gqa_topk(logits, 1, "softmax_sum", scale=1.0).tolist() == [[1]]
    assert gqa_topk(logits, 1, "logit_sum").tolist() == [[0]]  # raw sums [10, 0, 6]
    assert gqa_topk(logits, 1, "max").tolist() == [[1]]  # maxima [5, 20, 6]
    assert gqa_topk(logits, 2, "softmax_sum", scale=1.0).tolist() == [[1, 2]]
    assert gqa_topk(logits, 2, "logit_sum").tolist() == [[0, 2]]
    # The scale matters for softmax_sum: flattened heads let the summed mass follow the logit sums.
    assert gqa_topk(logits, 1, "softmax_sum", scale=1e-3).tolist() == [[0]]
    with pytest.raises(ValueError, match="scale"):
        gqa_topk(logits, 1, "softmax_sum")
    with pytest.raises(ValueError, match="GQA rule"):
        gqa_topk(logits, 1, "mean")


def test_top_k_ties_go_to_the_lower_index_and_indices_are_ascending():
    values = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert topk_ascending(values, 3).tolist() == [[1, 2, 4], [0, 1, 2]]
    assert topk_ascending(values, 10).tolist() == [list(range(6))] * 2  # k clipped to n
    nan_row = torch.tensor([[float("nan"), 1.0, 0.5]])
    assert topk_ascending(nan_row, 2).tolist() == [[1, 2]]  # NaN ranks last
    g = torch.Generator().manual_seed(0)
    many_ties = torch.randint(0, 5, (7, 300), generator=g).float()
    for k in (1, 17, 64, 299, 300):
        assert torch.equal(topk_ascending(many_ties, k), reference_topk(many_ties, k))
    scores = torch.randint(0, 3, (4, 2, 100), generator=g).float()
    for rule in ("softmax_sum", "logit_sum", "max"):
        picked = gqa_topk(scores, 25, rule, scale=0.5)
        assert picked.shape == (4, 25) and picked.dtype == torch.int64
        assert torch.equal(picked, reference_topk(group_scores(scores, rule, 0.5), 25))


# ----------------------------------------------------------------------------- accounting


def test_comm_ratio_of_the_papers_configs():
    assert comm_ratio(2, 6, 128) == 3 / 512
    assert comm_ratio(4, 8, 128) == 1 / 64
    assert comm_ratio(2, 8, 128) == 1 / 128  # m·b = 16: the paper's 1/128 bound
