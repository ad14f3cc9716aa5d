"""The decode step's attention kernels (``engine.decode_attention``): sdpa, matmul and split compute the
same attention, the engine runs each as a static, sync-free step, and a bad choice is one clear error."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.bench.decode_host import StepRecorder
from kvbench.engine import attention, split_decode
from kvbench.engine.generate import generate
from kvbench.engine.settings import EngineSettings, engine_settings
from kvbench.errors import ConfigError
from kvbench.methods import create_method

KERNELS = ("sdpa", "matmul", "split")

# (KV heads, query heads per KV head, head dim, slots attended, held length, buffer capacity)
SHAPES = [(2, 4, 64, 512, 300, 600), (4, 1, 32, 256, 256, 256), (2, 3, 64, 768, 700, 1000), (1, 16, 16, 64, 1, 64)]


def _inputs(rows: int, group: int, d: int, slots: int, length: int, capacity: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    buffer_k = torch.randn(rows, capacity, d, generator=gen)
    buffer_v = torch.randn(rows, capacity, d, generator=gen)
    query = torch.randn(1, rows * group, 1, d, generator=gen)
    mask = attention.length_mask(torch.arange(slots), torch.tensor([length]), torch.float32)
    # the keys and values are views of a longer buffer, as a layer's bucket is
    return query, buffer_k[:, :slots], buffer_v[:, :slots], mask


def _reference(query, keys, values, length):
    """Softmax attention over the first ``length`` slots, written out."""
    rows, d = keys.shape[0], keys.shape[-1]
    q = query.reshape(rows, -1, d).double()
    k, v = keys[:, :length].double(), values[:, :length].double()
    probs = torch.softmax(q @ k.transpose(1, 2) * d**-0.5, dim=-1)
    return (probs @ v).reshape(1, 1, -1, d).float()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_is_softmax_attention_over_the_held_slots(kernel, shape):
    query, keys, values, mask = _inputs(*shape)
    out = attention.decode_dense(query, keys, values, mask, keys.shape[-1] ** -0.5, kernel)
    assert out.shape == (1, 1, query.shape[1], keys.shape[-1])
    torch.testing.assert_close(out, _reference(query, keys, values, shape[4]), rtol=1e-5, atol=1e-5)


def test_a_masked_slot_changes_nothing():
    query, keys, values, mask = _inputs(2, 4, 64, 512, 300, 600)
    before = attention.decode_matmul(query, keys, values, mask, 0.125)
    keys[:, 300:] = 1e3  # slots past the length: any finite content
    values[:, 300:] = -1e3
    assert torch.equal(attention.decode_matmul(query, keys, values, mask, 0.125), before)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_decode_kernels import SHAPES, _inputs, _reference
from kvbench.engine import split_decode
for shape in SHAPES:
    query, keys, values, mask = _inputs(*shape)
    out = split_decode.attend(query, keys, values, mask, keys.shape[-1] ** -0.5, split_tokens=64)
    print(float((out - _reference(query, keys, values, shape[4])).abs().max()))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the CUDA wheels bring it)")
def test_the_triton_split_kernel_in_the_interpreter():
    """The kernel itself, run by Triton's interpreter on the CPU (in a process of its own: Triton reads
    TRITON_INTERPRET when it is imported): the chunk partials and their merge give the attention, chunks
    with no held slot included (length 1 of 64 slots in chunks of 64; 300 of 512: three chunks of eight)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [float(line) for line in done.stdout.split()]
    assert len(errors) == len(SHAPES) and max(errors) < 1e-5, errors


def test_split_takes_the_shapes_it_supports_and_falls_back_otherwise():
    assert split_decode.supports(4, 128, 256) and split_decode.supports(16, 64, 64)
    assert not split_decode.supports(32, 128, 256)  # a group wider than the 16-row tile
    assert not split_decode.supports(4, 96, 256)  # a head dimension that is no power of two
    assert not split_decode.supports(4, 128, 100)  # a chunk that is not whole iterations
    query, keys, values, mask = _inputs(1, 32, 16, 64, 40, 64)
    out = split_decode.attend(query, keys, values, mask, 0.25, split_tokens=64)  # (falls back, no Triton call)
    torch.testing.assert_close(out, attention.decode_matmul(query, keys, values, mask, 0.25))


def _steady_step(loaded, ids, kernel):
    with StepRecorder() as rec:
        out = generate(
            loaded,
            create_method({"name": "full"}),
            ids,
            max_new_tokens=10,
            min_new_tokens=10,
            engine=EngineSettings(decode_attention=kernel),
        )
    return out, rec.steps


def test_the_engine_runs_each_kernel_as_a_static_sync_free_step(tiny_llama, random_ids):
    """Same tokens with every kernel (float32); each steady step reads nothing back and repeats its ops; the
    matmul step's op count is sdpa's plus exactly what the two GEMMs and the softmax add per layer."""
    ids = random_ids(700, seed=15)
    runs = {kernel: _steady_step(tiny_llama, ids, kernel) for kernel in KERNELS}
    for kernel, (out, steps) in runs.items():
        assert out.tokens == runs["sdpa"][0].tokens, kernel
        first, second = steps[4], steps[5]
        assert dict(first.syncs) == {} and first.host_data == 0, kernel
        assert first.first_difference(second) is None, kernel
    layers = tiny_llama.spec.n_layers
    sdpa_ops, matmul_ops = runs["sdpa"][1][4].aten_ops, runs["matmul"][1][4].aten_ops
    assert matmul_ops - sdpa_ops == MATMUL_EXTRA_OPS_PER_LAYER * layers, (sdpa_ops, matmul_ops)
    assert runs["split"][1][4].aten_ops == matmul_ops  # (on a CPU, split computes matmul's softmax)


#: aten ops the matmul kernel's layer adds over sdpa's on a CPU (torch 2.13): baddbmm, softmax, the cast and
#: bmm with their three views, against SDPA's call and what it dispatches to; fixed here so a change shows
MATMUL_EXTRA_OPS_PER_LAYER = 4


def test_bad_choices_are_one_clear_error(monkeypatch):
    with pytest.raises(ConfigError, match="decode_attention"):
        engine_settings({"decode_attention": "flash"})
    with pytest.raises(ConfigError, match="split_tokens"):
        engine_settings({"split_tokens": 8})
    from kvbench.engine.decode import decode_kernel

    monkeypatch.setattr(split_decode, "available", lambda: False)
    with pytest.raises(ConfigError, match="needs Triton on CUDA"):
        decode_kernel(EngineSettings(decode_attention="split"), torch.device("cuda"))
    assert decode_kernel(EngineSettings(decode_attention="split"), torch.device("cpu")) == "split"
