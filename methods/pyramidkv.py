"""``pyramidkv``: SnapKV's selection with a pyramid of per-layer budgets (Cai et al., 2024).

Lower layers, whose attention is spread out, keep more tokens; higher layers, whose attention is
concentrated, keep fewer, for the same total. Every layer scores tokens exactly as ``snapkv`` does
(observation-window votes, pooling; per query head by default, ``granularity``) and keeps its sinks,
its window (``local``) and its own number of selected tokens ``select_l``. The defaults are the
authors' (KVCache-Factory ``run_longbench.py``): observation window 8, kernel 7, max pooling, and
``query_head`` granularity (KV stored per query head under GQA; see ``snapkv``). PQCache's released
code has no PyramidKV, so the same defaults apply under its protocol.

The schedule (the authors' ``PyramidKVCluster``): with ``C`` the uniform selected budget of a layer
(SnapKV's ``select``: the budget minus the window), ``L`` layers and ``A`` the tokens a layer can
choose from (``s - sink - local``),

    min = C / beta,   max = 2C - min;   if max >= A: max = A, min = 2C - max
    select_l = max - l · (max - min) / (L - 1)          (layer l = 0 .. L-1, an arithmetic sequence)

with ``beta`` = 20 (the authors' code). The real-valued sequence averages ``C``. ``rounding`` turns it
into token counts:

* ``authors`` (default): the authors' integer arithmetic (KVCache-Factory ``PyramidKVCluster.update_kv``),
  ``min = C // beta`` and a floored step ``(max - min) // (L - 1)``; ``select_l = max - l · step``
  exactly as their code computes it (``tests/test_pyramidkv_authors.py`` pins the counts against a
  transcription of it over windows 8–64). The floor shortens the step, so the layers together keep
  ``L·C + L·r/2`` tokens, with ``r = (max - min) mod (L - 1)``: up to ``(L - 2)/2`` extra tokens per
  layer (about 9 % more KV than SnapKV for SmolLM2's 30 layers at a 1k prompt and a 10 % budget).
* ``exact``: the real-valued sequence rounded by cumulative sums (each layer within one token of its
  real value, non-increasing), so the total is **exactly** ``L × C``: the same KV bytes as every other
  method in a comparison. The PQCache tables run it (``method=pyramidkv_equal``), since they compare
  methods at equal memory.

The authors' schedule applies at every window: at a 64-token window (kvpress's default) their code
still builds the pyramid, as kvbench does. kvpress 0.5.5 instead falls back to SnapKV's uniform budget
whenever ``min < window`` (its own guard, not in the authors' code), which is why the two tools' sets
agree at windows 8–16 and not at 64. ``C``, ``A`` and the window here are kvbench's: ``A`` excludes the
sinks (the authors' code has none; with ``sink: 0`` the counts are theirs).

As in the authors' code, prompts shorter than ``2C`` keep the uniform budget on every layer
(``short_prompt_uniform``). The resolved per-layer budgets (``local + select_l``, sinks excluded) are
``budget.per_layer`` in every sample's record, and the engine checks that each layer kept exactly that.

Layers hold different numbers of tokens. kvbench's store is per layer and decode attends per layer,
so nothing is padded: an evicted token is gone from its layer's store and cannot be attended (the
authors' code and kvpress instead pad or mask a shared-length cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.errors import ConfigError
from kvbench.methods import register
from kvbench.methods.snapkv import SnapKV, SnapKVParams
from kvbench.params import param

ROUNDINGS = ("exact", "authors")


def pyramid_budgets(select: int, layers: int, available: int, beta: float = 20, rounding: str = "exact") -> list[int]:
    """Selected tokens per layer (layer 0 first) averaging ``select``, at most ``available`` each."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown pyramid rounding {rounding!r}; use one of {ROUNDINGS}")
    if layers <= 1:
        return [min(select, available)] * layers
    if rounding == "authors":
        low = int(select // beta)
        high = 2 * select - low
        if high >= available:
            high = available
            low = 2 * select - high
        steps = (high - low) // (layers - 1)
        return [high - layer * steps for layer in range(layers)]
    low_r = select / beta
    high_r = 2 * select - low_r
    if high_r >= available:
        high_r = float(available)
        low_r = 2 * select - high_r
    step = (high_r - low_r) / (layers - 1)
    values = [high_r - layer * step for layer in range(layers)]
    # cumulative rounding: sum preserved (the real sum is the integer layers * select), each within 1
    cumulative = [0] + [math.floor(sum(values[: i + 1]) + 0.5) for i in range(layers)]
    counts = [cumulative[i + 1] - cumulative[i] for i in range(layers)]
    return sorted((min(available, max(0, c)) for c in counts), reverse=True)


@dataclass(frozen=True)
class PyramidKVParams(SnapKVParams):
    window: int = param(8, "observation window = kept recent window (the authors' KVCache-Factory: 8)", min=1)
    kernel: int = param(7, "pooling kernel, odd (KVCache-Factory: 7)", min=1)
    pooling: Literal["avg", "max"] = param("max", "vote pooling (KVCache-Factory: max)")
    beta: float = param(20.0, "pyramid steepness: the top layer keeps C/beta, the bottom 2C - C/beta")
    rounding: Literal["exact", "authors"] = param(
        "authors",
        "authors: KVCache-Factory's floored step (up to (L-2)/2 more per layer than uniform) | "
        "exact: layers sum to L x C, the same KV as uniform (preset pyramidkv_equal)",
    )
    short_prompt_uniform: bool = param(True, "prompts shorter than 2C keep the uniform budget (authors' code)")

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise ConfigError(f"method.beta must be positive, got {self.beta}", "use e.g. method.beta=20")


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"
    Params = PyramidKVParams
    params: PyramidKVParams

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)
        self.beta, self.rounding = self.params.beta, self.params.rounding

    def resolve_budget(self, budget: BudgetConfig, context: int, capacity: int, n_layers: int) -> ResolvedBudget:
        resolved = super().resolve_budget(budget, context, capacity, n_layers)
        uniform = resolved.select
        available = max(0, context - resolved.sink - resolved.local)
        short = self.params.short_prompt_uniform and context < 2 * uniform
        if not resolved.compresses or short:
            selects = [uniform] * n_layers
        else:
            selects = pyramid_budgets(uniform, n_layers, available, self.beta, self.rounding)
        return resolved.with_per_layer([resolved.local + s for s in selects])
