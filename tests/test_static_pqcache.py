"""PQCache on the static decode step: the same positions, tokens and bytes as the earlier step, a fixed op stream.

* **equivalence** — :class:`~tests.legacy_pqcache.LegacyPQCache` (the pre-static ``select``, verbatim) and the
  static method attend the same positions at every step and layer, generate the same tokens and count the
  same bytes, index bytes and block-cache hits: GQA rules, both ``comm_ratio`` defaults (2×4 and 1×4 codes
  at ``d_h`` 32), ``offload`` on and off, a block cache smaller than the prompt, other k-means metrics, a
  budget that stops covering the cache in the middle of the generation (several tokens coded at once) and a
  covering one, on a 4:1 (Llama) and a 7:1 (Qwen2) GQA model; generations are longer than the local window,
  so decode-time codes are scored;
* **no host reads, one op stream** — steady steps 4 and 5 read nothing back and issue the same ops, in the
  regime that encodes a token every step and in the one before it;
* **the primitives** — ``pq_encode_static``, ``pq_scores_static`` and ``prefix_group_sum`` give
  ``pq_encode``'s, ``pq_scores``' and a prefix sum's numbers bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.settings import EngineSettings
from kvbench.methods.primitives.pq import (
    pq_encode,
    pq_encode_static,
    pq_encode_table,
    pq_fit,
    pq_scores,
    pq_scores_static,
    prefix_group_sum,
)
from tests.legacy_pqcache import LegacyPQCache
from tests.static_helpers import assert_same_as_legacy, assert_static_step, digest_run, registered

NEW = 40  # more than the local windows below: tokens generated here leave the window and are scored by their codes
LEGACY = LegacyPQCache.name
FAST = {"kmeans_iters": 5}  # (the default, adaptive, fits a cost model first)


@pytest.fixture(scope="module", autouse=True)
def _legacy_registered():
    with registered(LegacyPQCache):
        yield


VARIANTS = {
    "softmax_sum-1/64-device": ({"offload": False}, {"tokens": 96, "local": 8, "comm_ratio": 1 / 64}),
    "softmax_sum-1/128-offload-cache": ({"cache_tokens": 256}, {"tokens": 96, "local": 8, "comm_ratio": 1 / 128}),
    "logit_sum-1/64-offload": ({"gqa": "logit_sum"}, {"tokens": 128, "local": 16, "comm_ratio": 1 / 64}),
    "max-1/128-device": ({"gqa": "max", "offload": False}, {"tokens": 96, "local": 8, "comm_ratio": 1 / 128}),
    "logit_sum-1/128-device": (
        {"gqa": "logit_sum", "offload": False},
        {"tokens": 64, "local": 4, "comm_ratio": 1 / 128},
    ),
}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_static_pqcache_attends_what_the_earlier_pqcache_attended(fixture, variant, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    params, budget = VARIANTS[variant]
    assert_same_as_legacy(loaded, "pqcache", LEGACY, random_ids(700, seed=31), NEW, {**FAST, **params}, **budget)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_that_stops_covering_codes_the_tokens_it_skipped(fixture, offload, request, random_ids):
    """500 prompt tokens, 32 sinks, a window of 8 and 480 selected: the cache is covered (the dense step, no
    codebook awaited) until step 22, whose layout leaves 13 tokens past the prompt's codes: they are coded
    at once, as before, and later steps code one token each."""
    loaded = request.getfixturevalue(fixture)
    static, _ = assert_same_as_legacy(
        loaded, "pqcache", LEGACY, random_ids(500, seed=32), NEW, {**FAST, "offload": offload}, tokens=488, local=8
    )
    attended = static.telemetry["attended_per_layer"]
    assert attended and all(a < 500 + NEW for a in attended)  # (it did select at the end)


@pytest.mark.parametrize("offload", [False, True])
def test_a_covering_budget_is_the_dense_step(offload, tiny_qwen2, random_ids):
    ids = random_ids(600, seed=33)
    static, _ = assert_same_as_legacy(
        tiny_qwen2, "pqcache", LEGACY, ids, NEW, {**FAST, "offload": offload}, tokens=600 + NEW
    )
    full = digest_run(tiny_qwen2, "full", ids, NEW)
    assert static.tokens == full.tokens


@pytest.mark.parametrize(
    "params",
    [{"metric": "ip"}, {"metric": "cosine"}, {"m": 32, "b": 8, "init": "kmeans++"}],
    ids=["ip", "cosine", "one_dimensional_codes"],
)
def test_other_codebooks_code_new_tokens_alike(params, tiny_llama, random_ids):
    """Other metrics code a token with other arithmetic; 4 sinks make the bucket's width no multiple of 32."""
    ids, params = random_ids(600, seed=34), {**FAST, "offload": False, **params}
    assert_same_as_legacy(tiny_llama, "pqcache", LEGACY, ids, NEW, params, tokens=80, local=6, sink=4)


def test_the_dynamic_step_selects_alike(tiny_qwen2, random_ids):
    """``engine.decode=dynamic`` runs the static ``select`` without ``before_step``: it does the host side itself."""
    ids = random_ids(600, seed=35)
    params, budget = {**FAST, "offload": False}, {"tokens": 96, "local": 8, "comm_ratio": 1 / 64}
    dynamic = digest_run(tiny_qwen2, "pqcache", ids, NEW, params, EngineSettings(decode="dynamic"), **budget)
    earlier = digest_run(tiny_qwen2, LEGACY, ids, NEW, params, **budget)
    assert dynamic.telemetry["selection_digest"] == earlier.telemetry["selection_digest"]
    assert dynamic.tokens == earlier.tokens


# ---------------------------------------------------------------------- the op stream
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("local", [2, 16], ids=["encoding", "window_from_the_prompt"])
def test_a_steady_step_reads_nothing_back_and_repeats_its_ops(fixture, local, request, random_ids):
    """``local`` 2: steps 4 and 5 each encode the token that leaves the window; 16: no token has left it yet."""
    loaded = request.getfixturevalue(fixture)
    params = {**FAST, "offload": False}
    assert_static_step(loaded, "pqcache", random_ids(700, seed=36), params, tokens=96, local=local, comm_ratio=1 / 64)


# ---------------------------------------------------------------------- the primitives
@pytest.mark.parametrize("metric", ["l2", "ip", "cosine"])
@pytest.mark.parametrize("shape", [(2, 32, 2, 4), (1, 32, 1, 4), (2, 32, 32, 8), (4, 64, 4, 8)])
def test_static_encoding_and_scores_are_pq_encode_and_pq_scores(metric, shape):
    groups, d, m, b = shape
    generator = torch.Generator().manual_seed(sum(shape))
    keys = torch.randn(groups, 400, d, generator=generator)
    keys[:, ::3] = (keys[:, ::3] * 2).round() / 2  # (repeated coordinates: ties between centroids)
    book = pq_fit(keys, m, b, iters=4, metric=metric)
    table = pq_encode_table(book.centroids, metric=metric, extra=book.extra)
    for t in (1, 1, 1, 5):
        new = (torch.randn(groups, t, d, generator=generator) * 2).round() / 2
        expected = pq_encode(new, book.centroids, metric=metric, phi=book.phi, extra=book.extra)
        assert torch.equal(pq_encode_static(new, table, m, phi=book.phi), expected.long())
    queries = torch.randn(groups, 3, d, generator=generator)
    transposed = book.centroids.reshape(groups * m, 2**b, d // m).transpose(1, 2)
    expected = pq_scores(queries, book.centroids, book.codes)
    assert torch.equal(pq_scores_static(queries, transposed, book.codes), expected)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 12])
def test_prefix_group_sum_is_the_sum_over_the_prefix(rows):
    generator = torch.Generator().manual_seed(rows)
    for count in (8, 31, 32, 100, 517, 1000):
        values = torch.rand(2, rows, count + 77, generator=generator) * 3
        expected = values[..., :count].contiguous().sum(dim=1)
        got = prefix_group_sum(values, torch.tensor([count + 4]), 4)
        assert torch.equal(got[..., :count], expected)
