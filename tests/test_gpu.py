"""The CUDA path (pinned host tier, side-stream prefetch). Skipped without a GPU."""

import pytest
import torch

from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.methods import create_method

from .conftest import model_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_llama():
    from kvbench.models.loading import load_model

    return load_model(model_config("tiny_llama", device="cuda", dtype="float32"))


def test_full_matches_generate_on_cuda(cuda_llama, random_ids):
    ids = random_ids(300, seed=51)
    expected = cuda_llama.model.generate(
        torch.tensor([ids], device="cuda"), max_new_tokens=16, min_new_tokens=16, do_sample=False
    )[0, 300:].tolist()
    assert (
        generate(cuda_llama, create_method({"name": "full"}), ids, max_new_tokens=16, min_new_tokens=16).tokens
        == expected
    )


@pytest.mark.parametrize("name", ["pqcache", "clusterkv", "quest", "sparq", "infllm"])
def test_offloading_methods_run_on_cuda_with_pinned_host_tier(cuda_llama, random_ids, name):
    ids = random_ids(600, seed=52)
    full = generate(cuda_llama, create_method({"name": "full"}), ids, max_new_tokens=12, min_new_tokens=12)
    cover = generate(
        cuda_llama,
        create_method({"name": name}),
        ids,
        max_new_tokens=12,
        min_new_tokens=12,
        budget=BudgetConfig(tokens=612),
    )
    assert cover.tokens == full.tokens
    small = generate(
        cuda_llama,
        create_method({"name": name}),
        ids,
        max_new_tokens=6,
        min_new_tokens=6,
        budget=BudgetConfig(token_ratio=0.2, comm_ratio=1 / 64),
    )
    assert small.telemetry["bytes_h2d_fetch"] > 0


def test_host_tier_gathers_are_pinned_and_exact():
    """A gather out of the pinned host tier lands in pinned memory (an asynchronous copy to the GPU),
    and what reaches the device is the rows asked for."""
    from kvbench.kv.store import LayerKV

    kv = LayerKV(2, 8, dtype=torch.float32, device=torch.device("cuda"), offload=True)
    keys = torch.randn(2, 50, 8, device="cuda")
    kv.append(keys, -keys)
    slots = torch.tensor([[0, 7, 49], [3, 4, 5]])
    assert kv._rows(kv._k, slots.view(-1)).is_pinned()
    k, v = kv.gather(slots)
    assert k.is_cuda and torch.equal(k, torch.stack([keys[0, [0, 7, 49]], keys[1, [3, 4, 5]]]))
    assert torch.equal(v, -k)


INDEXES = {  # where each method keeps the metadata it ranks with (the static step's preallocated buffers)
    "clusterkv": lambda m: [
        t for index in m.index.values() for t in (index.centroids, index.labels, index.sorted_slots)
    ],
    "quest": lambda m: list(m._bounds.values()),
    "infllm": lambda m: list(m._block_keys.values()),
}


@pytest.mark.parametrize("name", sorted(INDEXES))
def test_selection_metadata_lives_on_the_device(cuda_llama, random_ids, name):
    """ClusterKV's clusters, Quest's page bounds and InfLLM's representative keys live on the GPU, as in
    the papers' systems (clustering and ranking run there); only the chosen slots reach the host tier,
    whose K/V rows are fetched."""
    method = create_method({"name": name})
    ids = random_ids(600, seed=53)
    out = generate(cuda_llama, method, ids, max_new_tokens=4, min_new_tokens=4, budget=BudgetConfig(tokens=64))
    tensors = INDEXES[name](method)
    assert tensors and all(t.is_cuda for t in tensors)
    assert out.telemetry["bytes_h2d_fetch"] > 0


@pytest.mark.parametrize(
    ("name", "kernel"),
    [("full", "sdpa"), ("oracle", "sdpa"), ("full", "matmul"), ("full", "split"), ("quest", "split")],
)
def test_graph_replay_is_the_eager_static_step_and_never_syncs(cuda_llama, random_ids, name, kernel, monkeypatch):
    """engine.cuda_graph=true replays the captured static step: the same tokens as the eager static step, and
    no step after the first waits for the device (sync debug mode 'error' raises on any sync); with each
    decode attention kernel (``split``: the Triton flash-decoding kernel, launched inside the graph)."""
    from kvbench.engine.decode import StaticDecoder
    from kvbench.engine.settings import EngineSettings

    ids = random_ids(700, seed=53)
    budget = BudgetConfig() if name == "full" else BudgetConfig(tokens=96)
    original = StaticDecoder.step
    replays = []

    def step(self, feed=None, timed=True):
        if self.steps == 0:
            return original(self, feed, timed)
        replays.append(bool(self.graphs))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, feed, timed)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def run(graphs):
        method = create_method({"name": name} if name == "full" else {"name": name, "offload": False})
        return generate(
            cuda_llama,
            method,
            ids,
            max_new_tokens=40,
            min_new_tokens=40,
            budget=budget,
            engine=EngineSettings(cuda_graph=graphs, decode_attention=kernel),
        )

    eager = run(False)
    monkeypatch.setattr(StaticDecoder, "step", step)
    graph = run(True)
    assert graph.tokens == eager.tokens
    assert any(replays), "no step replayed a captured graph"
    assert graph.telemetry["attended_per_layer"] == eager.telemetry["attended_per_layer"]


def test_the_decode_attention_kernels_agree_on_cuda(cuda_llama, random_ids):
    """sdpa, matmul and the Triton split kernel (float32, IEEE dot products) generate the same tokens."""
    from kvbench.engine.settings import EngineSettings

    ids = random_ids(700, seed=54)
    runs = {
        kernel: generate(
            cuda_llama,
            create_method({"name": "full"}),
            ids,
            max_new_tokens=24,
            min_new_tokens=24,
            engine=EngineSettings(decode_attention=kernel, split_tokens=128),
        ).tokens
        for kernel in ("sdpa", "matmul", "split")
    }
    assert runs["matmul"] == runs["sdpa"] and runs["split"] == runs["sdpa"]


@pytest.mark.parametrize("group", [1, 4])
def test_the_split_kernel_in_bfloat16(group):
    """The Triton kernel on the GPU in bf16 (its interpreter cannot check bf16 dot products on a CPU):
    within bf16 rounding of float32 attention, the masked tail and a partial last chunk included."""
    from kvbench.engine import attention, split_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, d, slots, length = 8, 128, 4096 + 128, 4000
    buffer_k = torch.randn(rows, 5000, d, device="cuda", generator=gen).bfloat16()
    buffer_v = torch.randn(rows, 5000, d, device="cuda", generator=gen).bfloat16()
    query = torch.randn(1, rows * group, 1, d, device="cuda", generator=gen).bfloat16()
    keys, values = buffer_k[:, :slots], buffer_v[:, :slots]
    mask = attention.length_mask(
        torch.arange(slots, device="cuda"), torch.tensor([length], device="cuda"), torch.bfloat16
    )
    out = split_decode.attend(query, keys, values, mask, d**-0.5, 256)
    exact = attention.decode_matmul(query.float(), keys.float(), values.float(), mask.float(), d**-0.5)
    torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=2e-2)
