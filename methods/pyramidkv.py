"""``pyramidkv``: SnapKV's selection with a pyramid of per-layer budgets (Cai et al., 2024).

Lower layers keep more tokens and higher layers fewer, for the same total. With ``B`` the non-window
budget per layer, the authors' schedule (KVCache-Factory ``PyramidKVCluster``) is

    min = B // beta,   max = 2B - min   (if max ≥ s - window: max = s - window, min = 2B - max)
    steps = (max - min) // (layers - 1),   layer l keeps max - l · steps

with ``beta`` = 20, so the average stays ``B`` (up to the floor division: the layers together may
keep slightly more than ``layers × B``). As in the authors' code, prompts shorter than ``2B`` keep
the uniform ``B`` on every layer (``short_prompt_uniform``). Every layer stores its own number of
tokens; kvbench attends per layer, so no padding or masking tricks are needed and an evicted token can
never be attended. The per-layer budgets are recorded with every sample (``budget.per_layer``).
"""

from __future__ import annotations

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.methods import register
from kvbench.methods.snapkv import SnapKV


def pyramid(budget: int, window: int, context: int, layers: int, beta: int) -> list[int]:
    """Per-layer non-window budgets of the PyramidKV schedule."""
    low = budget // beta
    high = 2 * budget - low
    if high >= context - window:
        high = context - window
        low = 2 * budget - high
    steps = (high - low) // max(layers - 1, 1)
    return [high - layer * steps for layer in range(layers)]


@register
class PyramidKV(SnapKV):
    name = "pyramidkv"

    def resolve_budget(self, budget: BudgetConfig, context: int, capacity: int, n_layers: int) -> ResolvedBudget:
        resolved = super().resolve_budget(budget, context, capacity, n_layers)
        if not resolved.compresses:
            return resolved
        uniform = resolved.select
        short = bool(self.cfg.get("short_prompt_uniform", True)) and context < 2 * uniform
        room = context - resolved.sink
        layers = [uniform] * n_layers if short else pyramid(uniform, resolved.local, room, n_layers, int(self.cfg.get("beta", 20)))
        return resolved.with_per_layer([resolved.local + max(0, select) for select in layers])

    def layer_select(self, layer: int) -> int:
        budget = self.ctx.budget
        return budget.layer_budget(layer) - budget.local
