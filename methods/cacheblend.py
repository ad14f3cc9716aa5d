"""``cacheblend``: selective KV recompute over reused chunk caches (Yao et al., CacheBlend, EuroSys 2025).

Every chunk's K/V is precomputed alone and reused, keys re-rotated to the chunk's position in the
prompt; what reuse misses is the *cross-attention* between chunks. CacheBlend recovers it by
recomputing, on every layer, the few tokens whose reused K/V deviate most from what a full prefill
would give (the "high-KV-deviation", HKVD, tokens), and reusing the rest.

As run here (paper §4 and the authors' ``vllm_blend`` code; seed-cacheblend.md §1.4–1.6):

* layers ``0 .. check_layer - 1`` are prefilled in full for every row (layer 0's K/V cannot deviate:
  it depends on the token alone; the first layer whose K/V can deviate is 1, the code's single check
  layer);
* at ``check_layer`` every row is computed; each token's KV deviation is the squared L2 distance
  between its fresh V and its cached (reused) V, summed over heads and dimensions (the code's
  ``temp_diff``); the ``int(n_ctx · r)`` tokens with the largest deviation among the ``n_ctx``
  non-query tokens stay active, with every query-segment token (``suffix: query``; the released QA
  scripts force only the last token, ``suffix: last_token``); every row's fresh K/V is written at this
  layer;
* gradual filtering (paper Fig. 9): with ``filter_ratios`` (one ratio per check layer, starting at
  ``check_layer``), the deviation at each later check layer is computed only on the rows still active,
  and the set narrows to the next ratio; the default ``[]`` derives ``[r]`` (one check, the code's
  behaviour); e.g. ``filter_ratios=[0.3,0.2,0.15]`` checks at layers 1, 2, 3;
* every later layer recomputes only the active rows: their Q/K/V, attention over all rows of the layer
  (the cached ones re-rotated) and the MLP; the other rows keep their reused K/V and have no hidden
  state beyond the last check (the residual stream shrinks — the TTFT saving);
* ``mask: exact`` (default) lets an active query at position p attend keys at positions ≤ p;
  ``mask: code`` is the released code's bottom-right-aligned mask (xFormers
  ``LowerTriangularFromBottomRightMask``), with which the i-th of m active queries attends the first
  ``n - m + i + 1`` rows, so some queries see later keys — an approximation, kept to reproduce it;
* ``selection: random`` picks the recomputed tokens uniformly at random instead (the HKVD ablation of
  Fig. 6), seeded by ``seed``.

``recompute_ratio: 1.0`` recomputes everything and is token-identical to ``full``; ``0.0`` recomputes
only the query rows after the check layer. Deviations: the paper's loading controller and pipelined
loading are in the chunk store's and the engine's system side, not here.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbench.methods import register
from kvbench.methods.params import CacheBlendParams
from kvbench.methods.reuse import ReuseMethod, ReusePrefill


@register
class CacheBlend(ReuseMethod):
    name = "cacheblend"

    Params = CacheBlendParams
    params: CacheBlendParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        p = self.params
        self.ratios = [float(r) for r in p.filter_ratios] or [p.recompute_ratio]

    @property
    def check_layers(self) -> dict[int, float]:
        return {self.params.check_layer + i: r for i, r in enumerate(self.ratios)}

    def expects_reuse(self) -> bool:
        return self.ratios[-1] < 1.0

    def initial_rows(self, plan: ReusePrefill) -> torch.Tensor:
        return torch.arange(plan.n)

    def needs_cache_at(self, plan: ReusePrefill, layer: int) -> bool:
        return layer in self.check_layers or plan.active.numel() < plan.n

    def on_layer(self, plan: ReusePrefill, layer: int, fresh_v: torch.Tensor) -> torch.Tensor | None:
        ratio = self.check_layers.get(layer)
        if ratio is None:
            return None
        cached = plan.cached_values(layer)
        active = plan.active
        forced = plan.query_mask[active]
        if self.params.suffix == "last_token":
            forced = active == plan.n - 1
        candidates = torch.nonzero(~forced).flatten()
        n_ctx = int((~plan.query_mask).sum()) if self.params.suffix == "query" else plan.n - 1
        k = min(int(n_ctx * ratio), int(candidates.numel()))
        if self.params.selection == "random":
            generator = torch.Generator().manual_seed(self.params.seed + layer)
            chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:k]]
        else:
            assert cached is not None
            deviation = (fresh_v.float() - cached.float()).pow(2).sum(dim=(0, 2)).cpu()
            plan.deviations[layer] = deviation
            chosen = candidates[torch.topk(deviation[candidates], k).indices] if k else candidates[:0]
        keep = torch.cat([chosen, torch.nonzero(forced).flatten()])
        return torch.sort(keep).values
