"""Quest on the static decode step: the positions, tokens and bytes of its earlier implementation.

``tests/legacy_quest.py`` keeps the pre-conversion decode code; every test here compares the two at every
decode step and layer (the selection digest), across the settings that change the selection: the model's
GQA group (4:1 Llama, 7:1 Qwen2), per-query-head and shared ranking, the page size, ``min_pages``, sinks
(ClusterKV's alignment), the host tier, budgets where only the partial page is attended, where the middle
is a whole number of pages at some step, and one that covers the cache (the dense step). Every
generation crosses at least two page boundaries. The last tests check the scores against the earlier
expression bit for bit and the static properties of a steady step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvbench.bench.decode_host import StepRecorder
from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.engine.generate import generate
from kvbench.engine.settings import EngineSettings
from kvbench.kv.store import LayerKV
from kvbench.methods import create_method
from tests.legacy_quest import LegacyQuest
from tests.legacy_quest import page_bounds as legacy_page_bounds
from tests.legacy_quest import upper_bound_scores as legacy_upper_bound_scores
from tests.static_helpers import assert_same_as_legacy, registered

LEGACY = LegacyQuest.name


@pytest.fixture(scope="module", autouse=True)
def _legacy_registered():
    with registered(LegacyQuest):
        yield


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "params, budget",
    [
        ({"offload": False}, {"tokens": 96}),
        ({"offload": False, "gqa": "shared"}, {"tokens": 96}),
        ({"offload": True}, {"tokens": 160}),
        ({"offload": True, "gqa": "shared", "cache_tokens": 128, "cache_block": 16}, {"token_ratio": 0.2}),
        ({"offload": False, "page_size": 8, "min_pages": 5}, {"tokens": 20}),
        ({"offload": False, "sink": 16}, {"tokens": 128}),
        ({"offload": True, "sink": 16, "gqa": "shared"}, {"tokens": 64}),
        ({"offload": False, "local_fraction": 0.25}, {"tokens": 96}),
        ({"offload": True, "sink": 4, "local_fraction": 0.5}, {"tokens": 64}),
        ({"offload": False, "local_fraction": 1.0}, {"tokens": 64}),
    ],
    ids=[
        "device",
        "shared",
        "offload",
        "offload_cache",
        "page8",
        "sink16",
        "sink16_offload",
        "local",
        "local_sink_offload",
        "no_pages",
    ],
)
def test_static_quest_attends_what_the_earlier_quest_attended(fixture, params, budget, request, random_ids):
    """36 new tokens on a 700-token prompt: the middle crosses two page boundaries (at 704 and 720 without
    sinks or a local window), the partial page goes through 0 slots (a whole number of pages) and back.
    ``local_fraction`` gives a local window (pages end before it); 1.0 leaves no selected tokens (no pages:
    sinks, window and the current token)."""
    loaded = request.getfixturevalue(fixture)
    assert_same_as_legacy(loaded, "quest", LEGACY, random_ids(700, seed=41), n=36, params=params, **budget)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("gqa", ["per_query_head", "shared"])
def test_only_the_partial_page_is_attended_under_a_one_page_budget(offload, gqa, tiny_llama, random_ids):
    """``min_pages: 1`` and a budget under a page: the partial page alone while there is one, the best full
    page at the steps where the middle is a whole number of pages (512 = 32 pages at the 12th step)."""
    static, _ = assert_same_as_legacy(
        tiny_llama,
        "quest",
        LEGACY,
        random_ids(500, seed=42),
        n=36,
        params={"offload": offload, "gqa": gqa, "min_pages": 1},
        tokens=8,
    )
    assert static.telemetry["attended_first_step"][2:] == [4 + 1] * 2  # 500 = 31 pages + 4, then the current


def test_a_generation_across_a_length_bucket_with_a_page_of_eight(tiny_qwen2, random_ids):
    """A 500-token prompt and 40 new tokens cross the 512-slot bucket mid-generation (more pages scored)."""
    assert_same_as_legacy(
        tiny_qwen2, "quest", LEGACY, random_ids(500, seed=43), n=40, params={"page_size": 8}, tokens=48
    )


@pytest.mark.parametrize("offload", [False, True])
def test_a_budget_that_stops_covering_during_the_generation(offload, tiny_llama, random_ids):
    """A budget that covers the prompt (the dense step) and stops covering it after a few new tokens: the
    bounds are built at the first selective step."""
    static, _ = assert_same_as_legacy(
        tiny_llama, "quest", LEGACY, random_ids(600, seed=44), n=30, params={"offload": offload}, tokens=608
    )
    attended = static.telemetry["attended_first_step"]
    assert attended == [601] * tiny_llama.spec.n_layers  # dense at first
    assert all(a < 615 for a in static.telemetry["attended_per_layer"][2:])  # (dense: 601..629, mean 615)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_a_covering_budget_is_the_dense_step(fixture, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    static, _ = assert_same_as_legacy(loaded, "quest", LEGACY, random_ids(500, seed=45), n=20, tokens=600)
    assert static.telemetry["attended_first_step"] == [501] * loaded.spec.n_layers


@pytest.mark.parametrize("gqa", ["per_query_head", "shared"])
def test_the_scores_of_the_full_pages_are_the_earlier_ones_bit_for_bit(gqa):
    """The static step scores every page of the bucket from bounds folded in one key at a time (the unbuilt
    pages masked after): the folded bounds are the pages' ``amin``/``amax``, and each full page's score is
    the earlier expression's over the full pages only, bit for bit, per query head and summed."""
    torch.manual_seed(5)
    heads, kv_heads, d, full = 8, 2, 32, 37
    keys = torch.randn(kv_heads, 16 * full + 5, d)
    query = torch.randn(1, heads, 1, d)
    low, high = legacy_page_bounds(keys[:, : 16 * full], 16)
    bounds = torch.empty(kv_heads, 48, 2, d)
    bounds[:, :, 0], bounds[:, :, 1] = float("inf"), float("-inf")
    for slot in range(keys.shape[1]):
        index = torch.full((kv_heads, 1, d), slot // 16)
        bounds[:, :, 0].scatter_reduce_(1, index, keys[:, slot : slot + 1], "amin")
        bounds[:, :, 1].scatter_reduce_(1, index, keys[:, slot : slot + 1], "amax")
    assert torch.equal(bounds[:, :full, 0], low) and torch.equal(bounds[:, :full, 1], high)
    method = create_method({"name": "quest", "gqa": gqa})
    method.ctx = SimpleNamespace(spec=SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, group=heads // kv_heads))
    rows = heads if gqa == "per_query_head" else kv_heads
    earlier = legacy_upper_bound_scores(query[0, :, 0, :].view(kv_heads, heads // kv_heads, d), low, high)
    earlier = earlier.reshape(rows, full) if gqa == "per_query_head" else earlier.sum(dim=1)
    assert torch.equal(method._scores(query, bounds, rows)[:, :full], earlier)


@pytest.mark.parametrize("gqa", ["per_query_head", "shared"])
def test_gemv_scoring_is_the_same_terms_summed_in_another_order(gqa):
    """``method.scoring=gemv``: ``q⁺·max + q⁻·min`` by two matrix products equals the default's scores of
    every full page up to float32 rounding (not bit for bit), ranks the pages alike here, and leaves the
    empty pages (±inf bounds) to the masks that follow."""
    torch.manual_seed(6)
    heads, kv_heads, d, full = 8, 2, 32, 37
    keys = torch.randn(kv_heads, 16 * full, d)
    query = torch.randn(1, heads, 1, d)
    low, high = legacy_page_bounds(keys, 16)
    bounds = torch.empty(kv_heads, 48, 2, d)
    bounds[:, :, 0], bounds[:, :, 1] = float("inf"), float("-inf")
    bounds[:, :full, 0], bounds[:, :full, 1] = low, high
    rows = heads if gqa == "per_query_head" else kv_heads
    spec = SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, group=heads // kv_heads)
    scores = {}
    for scoring in ("products", "gemv"):
        method = create_method({"name": "quest", "gqa": gqa, "scoring": scoring})
        method.ctx = SimpleNamespace(spec=spec)
        scores[scoring] = method._scores(query, bounds, rows)
    exact, gemv = scores["products"][:, :full], scores["gemv"][:, :full]
    assert torch.allclose(gemv, exact, rtol=1e-5, atol=1e-5) and not torch.isnan(gemv).any()
    assert torch.equal(gemv.argsort(dim=1, descending=True), exact.argsort(dim=1, descending=True))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_gemv_scoring_attends_what_the_default_attends_here(fixture, request, random_ids):
    """On the tiny models the two scorings pick the same pages, so the tokens are the same, step for step
    sync-free (the steady-step test below runs with either)."""
    loaded, ids = request.getfixturevalue(fixture), random_ids(700, seed=43)
    outs = [
        generate(
            loaded,
            create_method({"name": "quest", "offload": False, "scoring": scoring}),
            ids,
            max_new_tokens=24,
            min_new_tokens=24,
            budget=BudgetConfig(tokens=96),
        )
        for scoring in ("products", "gemv")
    ]
    assert outs[0].tokens == outs[1].tokens


def test_quest_picks_the_pages_whose_bound_is_highest_and_keeps_the_partial_page():
    """``tests/test_retrieval.py``'s hand-made case on the static step's terms: the decoder's counters bound,
    ``before_step`` run, the padding of the partial page masked."""
    torch.manual_seed(3)
    d, n = 8, 16 * 10 + 5  # 10 full pages and a partial page of 5 before the current token
    keys = torch.randn(1, n + 1, d) * 0.1
    query = torch.zeros(1, 2, 1, d)
    query[0, 0, 0, 0] = 1.0  # query head 0 looks along e0, head 1 along e1
    query[0, 1, 0, 1] = 1.0
    keys[0, 16 * 3 + 7, 0] = 5.0  # one key of page 3 for head 0
    keys[0, 16 * 6 + 2, 0] = 4.0  # page 6 for head 0
    keys[0, 16 * 8, 1] = 5.0  # page 8 for head 1
    keys[0, 16 * 1 + 9, 1] = 4.0  # page 1 for head 1
    kv = LayerKV(1, d, dtype=torch.float32, device=torch.device("cpu"))
    kv.append(keys, keys.clone())
    kv.bind(torch.tensor([n + 1]), torch.tensor([n]), kv.capacity)
    method = create_method({"name": "quest"})
    spec = SimpleNamespace(n_heads=2, n_kv_heads=1, group=2, head_dim=d)
    budget = ResolvedBudget(context=n, sink=0, local=0, select=48)
    ctx = SimpleNamespace(spec=spec, budget=budget, store=SimpleNamespace(layers=[kv] * 3))
    method.start(ctx)
    method.before_step(ctx)
    sel = method.select(2, query, kv)
    assert sel is not None and sel.valid is not None

    def page(p):
        return list(range(16 * p, 16 * p + 16))

    partial = list(range(160, 165))
    # 3 pages of budget: the partial page and each head's two best pages, then the current token
    assert sel.slots[0][sel.valid[0]].tolist() == page(3) + page(6) + partial + [n]
    assert sel.slots[1][sel.valid[1]].tolist() == page(1) + page(8) + partial + [n]
    assert sel.slots.shape == (2, 3 * 16 + 1) and set(sel.slots[:, 2 * 16 + 5 : -1].flatten().tolist()) == {n}


@pytest.mark.parametrize("params", [{}, {"gqa": "shared"}, {"scoring": "gemv"}])
def test_a_steady_step_reads_nothing_back_and_repeats_its_ops(params, tiny_llama, random_ids):
    """``assert_static_step`` with the tokens (and the attended counts a padded selection leaves on the
    device) read every 8 steps, as on a GPU: on a CPU they are read at every step, inside it."""
    ids, params = random_ids(700, seed=46), {"name": "quest", "offload": False, **params}
    with StepRecorder() as rec:
        generate(
            tiny_llama,
            create_method(params),
            ids,
            max_new_tokens=10,
            min_new_tokens=10,
            budget=BudgetConfig(tokens=96),
            engine=EngineSettings(decode="static", readback_every=8),
        )
    first, second = rec.steps[4], rec.steps[5]
    assert dict(first.syncs) == {}, dict(first.syncs)
    assert first.host_data == 0
    assert first.first_difference(second) is None, first.first_difference(second)
    assert first.aten_ops > 10 * tiny_llama.spec.n_layers  # (the recorder saw the step)
