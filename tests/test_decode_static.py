"""The static decode step: the same tokens and selections as the earlier step, no host reads, a fixed op stream.

* **equivalence** — every method converted to the static step attends exactly the positions its earlier
  (dynamic, host-driven) implementation attended, at every decode step and layer (the selection
  digest), and generates the same tokens (``tests/reference_selection.py`` keeps those implementations);
  ``full`` and the eviction methods give the same tokens under ``engine.decode=static`` and ``dynamic``;
* **no host reads** — a steady step issues no sync-prone op and builds no tensor from host data
  (:mod:`kvbench.engine.ops`), and the counter catches one that does;
* **a static op stream** — consecutive steps of one regime issue the same ops with the same shapes and
  arguments (what a CUDA graph replays), and the counter catches a step that bakes in a host value.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate, teacher_force
from kvbench.engine.settings import EngineSettings
from kvbench.methods import create_method
from kvbench.methods.oracle import Oracle
from tests.reference_selection import LEGACY
from tests.static_helpers import assert_same_as_legacy, assert_static_step, digest_run, recorded_steps, registered

NEW = 24
STATIC_METHODS = ["full", "oracle", "streamingllm"]


def _method(name: str, **params):
    return create_method({"name": name, **params})


@pytest.fixture(scope="module", autouse=True)
def _test_methods_registered():
    with registered(*LEGACY.values(), _SyncingOracle, _BakingOracle):
        yield


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    "params",
    [{}, {"gqa": "logit_sum"}, {"gqa": "max"}, {"per_query_head": True}, {"offload": True}],
    ids=["softmax_sum", "logit_sum", "max", "per_query_head", "offload"],
)
def test_static_oracle_attends_what_the_earlier_oracle_attended(fixture, params, request, random_ids):
    loaded = request.getfixturevalue(fixture)
    assert_same_as_legacy(loaded, "oracle", LEGACY["oracle"].name, random_ids(700, seed=11), params=params, tokens=96)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize(
    ("prompt", "budget"),
    [(700, {"tokens": 96}), (700, {"token_ratio": 0.1, "sink": 0}), (100, {"tokens": 110})],
    ids=["sliding", "no_sinks", "starts_sliding_while_decoding"],
)
def test_static_streamingllm_attends_what_the_evicting_one_kept(fixture, prompt, budget, request, random_ids):
    """The window slid by a device-side selection attends, at every step and layer, the positions the
    earlier per-step eviction kept (in the same order: the same tokens), also when the prompt fits the
    budget and the window starts to slide during the decode."""
    loaded = request.getfixturevalue(fixture)
    static, _ = assert_same_as_legacy(
        loaded, "streamingllm", LEGACY["streamingllm"].name, random_ids(prompt, seed=17), n=NEW, **budget
    )
    assert len(set(static.telemetry["attended_per_layer"])) == 1  # every layer slides the same window


def test_a_covering_budget_is_the_dense_step(tiny_llama, random_ids):
    ids = random_ids(300, seed=16)
    full = digest_run(tiny_llama, "full", ids)
    covered = digest_run(tiny_llama, "oracle", ids, tokens=400)
    assert covered.tokens == full.tokens
    assert covered.telemetry["attended_per_layer"] == full.telemetry["attended_per_layer"]


@pytest.mark.parametrize("name", ["full", "snapkv", "pyramidkv", "streamingllm", "h2o"])
def test_static_and_dynamic_steps_give_the_same_tokens(name, tiny_llama, random_ids):
    ids = random_ids(600, seed=12)
    budget = {} if name == "full" else {"token_ratio": 0.2}
    static = digest_run(tiny_llama, name, ids, engine=EngineSettings(decode="static"), **budget)
    dynamic = digest_run(tiny_llama, name, ids, engine=EngineSettings(decode="dynamic"), **budget)
    assert static.tokens == dynamic.tokens
    assert static.telemetry["selection_digest"] == dynamic.telemetry["selection_digest"]
    assert static.telemetry["attended_per_layer"] == dynamic.telemetry["attended_per_layer"]


def test_static_teacher_forcing_matches_the_dynamic_one(tiny_llama, random_ids):
    ids = random_ids(400, seed=13)
    runs = [
        teacher_force(tiny_llama, _method("oracle"), ids[:300], ids[300:], budget=BudgetConfig(tokens=64), engine=e)
        for e in (EngineSettings(decode="static"), EngineSettings(decode="dynamic"))
    ]
    assert runs[0].nll == pytest.approx(runs[1].nll, rel=1e-5)
    assert runs[0].telemetry["decode_steps"] == runs[1].telemetry["decode_steps"] == 99


def test_a_later_readback_keeps_the_tokens_and_drops_the_steps_past_a_stop(tiny_llama, random_ids):
    ids = random_ids(300, seed=14)
    every = digest_run(tiny_llama, "full", ids, n=30)
    stop = every.tokens[9]  # the 10th token ends the generation when it is a stop id
    first_at = every.tokens.index(stop)
    runs = [
        generate(
            tiny_llama,
            _method("full"),
            ids,
            max_new_tokens=30,
            stop_ids=[stop],
            engine=EngineSettings(readback_every=r),
        )
        for r in (1, 8)
    ]
    for out in runs:
        assert out.tokens == every.tokens[: first_at + 1] and out.stop_reason == "stop"
        assert out.telemetry["decode_steps"] == first_at
        assert len(out.telemetry["attended_per_layer"]) == tiny_llama.spec.n_layers


# ---------------------------------------------------------------------- the op stream
@pytest.mark.parametrize("name", STATIC_METHODS)
def test_a_steady_step_reads_nothing_back_and_repeats_its_ops(name, tiny_llama, random_ids):
    budget = {} if name == "full" else {"tokens": 96, "comm_ratio": 1 / 64}
    assert_static_step(
        tiny_llama, name, random_ids(700, seed=15), {"offload": False} if name == "oracle" else None, **budget
    )


class _SyncingOracle(Oracle):
    """An Oracle that reads its budget back from the device at every step (a regression the test must catch)."""

    name = "_syncing_oracle"

    def select(self, layer, query, kv):
        selection = super().select(layer, query, kv)
        assert kv.length is not None
        int(kv.length)  # a host read
        return selection


class _BakingOracle(Oracle):
    """An Oracle whose step bakes the host's length into an op (what a graph replay would freeze)."""

    name = "_baking_oracle"

    def select(self, layer, query, kv):
        selection = super().select(layer, query, kv)
        torch.arange(kv.n, device=kv.device)
        return selection


def test_the_counter_catches_a_host_read_and_a_baked_length(tiny_llama, random_ids):
    ids = random_ids(700, seed=15)
    syncing = recorded_steps(tiny_llama, _SyncingOracle.name, ids, tokens=96)
    assert syncing[4].syncs["item"] == tiny_llama.spec.n_layers
    baking = recorded_steps(tiny_llama, _BakingOracle.name, ids, tokens=96)
    assert baking[4].first_difference(baking[5]) is not None


# ---------------------------------------------------------------------- the lean layers
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_lean_layers_compute_exactly_what_the_stock_layers_compute(fixture, request):
    """engine/lean.py's decoder layer, over the CPU-fused weights the models load with, is bit-identical to
    the model's own layer (the same attention plugged into both)."""
    import torch.nn.functional as F

    from kvbench.engine import lean

    loaded = request.getfixturevalue(fixture)
    model, spec = loaded.model, loaded.spec
    assert lean.supports(model) and getattr(model, "_kvbench_fused", False)
    x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    position = torch.tensor([[37]])
    rotary = model.model.rotary_emb(x, position)
    cos, signed_sin = lean.rotary_tables(*rotary)

    def attend(layer, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=spec.head_dim**-0.5).transpose(1, 2)

    previous = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            for index, layer in enumerate(model.model.layers):
                weights = lean.layer_weights(layer)
                assert weights.fused
                stock = layer(x, attention_mask=None, position_ids=position, position_embeddings=rotary)
                ours = lean.lean_layer(
                    index, weights, x[0], cos, signed_sin, (spec.n_heads, spec.n_kv_heads, spec.head_dim), attend
                )
                assert torch.equal(stock[0], ours)
    finally:
        model.config._attn_implementation = previous


# ---------------------------------------------------------------------- a finished request's memory
def test_a_finished_request_is_freed_without_the_cycle_collector(tiny_llama, random_ids, monkeypatch):
    """The context owns its static decoder and the decoder refers back weakly: when a method starts its next
    request, the previous context (its K/V buffers, on a GPU the graphs' pool) is freed at once, with the
    cycle collector off (on an H200 several 17 GB caches waited for it: RESULTS §10b)."""
    import gc
    import weakref

    from kvbench.engine import generate as generation

    contexts = []
    made = generation._new_context

    def spy(*args, **kwargs):
        ctx = made(*args, **kwargs)
        contexts.append(weakref.ref(ctx))
        return ctx

    monkeypatch.setattr(generation, "_new_context", spy)
    method = create_method({"name": "full"})
    ids = random_ids(300, seed=16)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(2):
            generate(tiny_llama, method, ids, max_new_tokens=6, min_new_tokens=6)
        assert contexts[0]() is None, "the first request's context outlived it"
        assert contexts[1]() is not None  # (the method still serves the second: its context lives)
    finally:
        if was_enabled:
            gc.enable()
