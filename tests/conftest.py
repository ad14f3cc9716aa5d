"""Shared fixtures: tiny random models (sub-second) and, for integration tests, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.cli import conf_dir

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def model_config(name: str, **overrides):
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / f"{name}.yaml"))
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def tiny_llama():
    from kvbench.models.loading import load_model

    return load_model(model_config("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2():
    from kvbench.models.loading import load_model

    return load_model(model_config("tiny_qwen2"))


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fetched from PyPI and converted once)."""
    from kvbench.models.loading import load_model

    return load_model(model_config("smollm2_135m"))


@pytest.fixture
def random_ids():
    def make(n: int, seed: int = 0, vocab: int = 250) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    return make
