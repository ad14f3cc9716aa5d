"""Shared checks of the static decode step (``tests/test_decode_static.py`` and the per-method files)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvbench.bench.decode_host import StepRecorder
from kvbench.budget import BudgetConfig
from kvbench.engine.generate import generate
from kvbench.engine.settings import EngineSettings
from kvbench.methods import REGISTRY, create_method
from kvbench.profile import Profile


def _generate(loaded: Any, name: str, ids: list[int], n: int, params: dict | None, budget: dict, **options: Any):
    method = create_method({"name": name, **(params or {})})
    return generate(loaded, method, ids, max_new_tokens=n, min_new_tokens=n, budget=BudgetConfig(**budget), **options)


def digest_run(loaded: Any, name: str, ids: list[int], n: int = 24, params: dict | None = None, engine=None, **budget):
    """``generate`` with the selection digest on (every position each layer keeps and attends, per step)."""
    return _generate(loaded, name, ids, n, params, budget, profile=Profile(selection_digest=True), engine=engine)


def assert_same_as_legacy(loaded: Any, name: str, legacy: str, ids: list[int], n: int = 24, params=None, **budget):
    """The static method ``name`` and its earlier implementation ``legacy`` attend the same positions at every
    step and layer, generate the same tokens, count the same attended tokens and moved bytes."""
    static = digest_run(loaded, name, ids, n, params, **budget)
    earlier = digest_run(loaded, legacy, ids, n, params, **budget)
    assert static.telemetry["selection_digest"] == earlier.telemetry["selection_digest"]
    assert static.tokens == earlier.tokens
    assert static.telemetry["attended_per_layer"] == earlier.telemetry["attended_per_layer"]
    for key in ("bytes_h2d", "bytes_h2d_fetch", "bytes_h2d_index", "cache_hits", "cache_lookups"):
        assert static.telemetry[key] == earlier.telemetry[key], key
    return static, earlier


def recorded_steps(loaded: Any, name: str, ids: list[int], n: int = 10, params: dict | None = None, **budget):
    """The op streams of decode steps 4 and 5 (:class:`~kvbench.bench.decode_host.StepRecorder`)."""
    with StepRecorder() as rec:
        _generate(loaded, name, ids, n, params, budget, engine=EngineSettings(decode="static"))
    return rec.steps


def assert_static_step(loaded: Any, name: str, ids: list[int], params: dict | None = None, **budget) -> None:
    """A steady step reads nothing back, builds no tensor from host data, and repeats its op stream."""
    steps = recorded_steps(loaded, name, ids, params=params, **budget)
    first, second = steps[4], steps[5]
    assert dict(first.syncs) == {}, dict(first.syncs)
    assert first.host_data == 0
    assert first.first_difference(second) is None, first.first_difference(second)
    assert first.aten_ops > 10 * loaded.spec.n_layers  # (the recorder saw the step)


@contextmanager
def registered(*classes: type) -> Iterator[None]:
    """Register test methods for the enclosed tests only (the registry is the golden checks' list)."""
    for cls in classes:
        REGISTRY.register(cls)
    try:
        yield
    finally:
        for cls in classes:
            REGISTRY.entries.pop(cls.name, None)
