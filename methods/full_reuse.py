"""``full_reuse``: full KV reuse (PromptCache; CacheBlend's "full KV reuse" baseline).

Every chunk's K/V is precomputed alone and reused as is, keys re-rotated to the chunk's position in
the prompt (CacheBlend's fix of PromptCache's positions: PromptCache itself precomputed each chunk
behind a dummy prefix); the exact ``prefix`` segment is reused too. Only the ``query`` rows are
computed, at every layer, attending every cached row. Cross-attention between chunks is lost — the
quality gap CacheBlend closes. Equivalent to ``cacheblend`` at ``recompute_ratio: 0`` without its
full-prefill layers before the check. A prompt that is a single chunk at position 0 followed by the
query is token-identical to ``full`` (its cache is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.methods import register
from kvbench.methods.params import ReuseParams
from kvbench.methods.reuse import ReuseMethod


@dataclass(frozen=True)
class FullReuseParams(ReuseParams):
    pass


@register
class FullReuse(ReuseMethod):
    name = "full_reuse"
    Params = FullReuseParams
