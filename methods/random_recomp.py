"""``random_recomp``: full reuse with a random share of every chunk's tokens recomputed (Cache-Craft's
"Random-Recomp" baseline; Agarwal et al., Cache-Craft, SIGMOD 2025, arXiv 2502.15734, §Evaluation).

Cache-Craft compares its choice of recomputed tokens (the highest inter-chunk attention) with two
other rules *at the same recompute ratio on the same reuse plan*: tokens drawn at random
(Random-Recomp, this method) and the tokens with the highest accumulated attention (Prefill-H2O,
:mod:`kvbench.methods.prefill_h2o`). Secondary write-ups of the paper (no code is released) report
Random-Recomp below full reuse in quality.

The plan (the reuse family's; the mechanism is :class:`~kvbench.engine.reuse.ReusePrefill`):

* every ``chunk`` segment's K/V is precomputed and reused as ``full_reuse`` does it (``chunk_bos``:
  alone or after BOS, keys re-rotated to the chunk's positions); the ``prefix`` segment is the exact
  prefix cache; the ``query`` rows are always computed;
* of each chunk of ``|C|`` tokens, ``ceil(recompute_ratio · |C|)`` tokens are recomputed **from layer 0
  through every layer** (``initial_rows`` = the query, the uncached rows and the selected tokens), the
  others keep their reused K/V: no check layer, unlike CacheBlend — Cache-Craft's "partial prefill"
  with the set fixed before the prefill. A chunk whose count reaches ``|C|`` is not read from its cache
  at all (computed in full, as an uncached span).

Choices of ours (the paper gives only the baseline's name and its ratio):

* the ratio is per chunk, ``ceil`` as in Cache-Craft's Eq. 14 (``N = ceil(CFO · |C|)``), default 0.15
  like CacheBlend's (Cache-Craft sweeps it);
* the draw: ``count`` distinct offsets uniformly without replacement from a generator seeded by
  ``seed`` and the chunk's tokens, so a chunk recomputes the same tokens in every request (as a
  Cache-Craft variant's set is fixed), independent of the requests' order (a resumed run draws the
  same) and reproducible under ``seed``;
* ``recompute_ratio: 1.0`` recomputes every chunk token (token-identical to ``full``); ``0.0`` recomputes
  only the query (token-identical to ``full_reuse``).

Telemetry (``telemetry.method.chunk_recompute``): per chunk its tokens, the count recomputed and the
offsets (within the chunk) chosen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbench.engine.reuse import CachedSpan, ReusePrefill
from kvbench.methods import register
from kvbench.methods.params import ChunkRecomputeParams
from kvbench.methods.primitives.cachecraft import recompute_count
from kvbench.methods.reuse import ReuseMethod
from kvbench.params import param
from kvbench.requests import Segment, segment_spans

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


class ChunkRecompute(ReuseMethod):
    """Full reuse with ``ceil(recompute_ratio · |C|)`` tokens of each chunk recomputed from layer 0; a
    subclass says which (:meth:`recompute_offsets`). Not registered: the shared plan of ``random_recomp`` and
    ``prefill_h2o``."""

    Params = ChunkRecomputeParams
    params: ChunkRecomputeParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self._chunks: list[dict[str, Any]] = []
        self._reuses = True

    def recompute_offsets(self, span: CachedSpan, ids: tuple[int, ...], count: int) -> np.ndarray:
        """Offsets (within the chunk, sorted) of the ``count`` tokens of chunk ``ids`` to recompute."""
        raise NotImplementedError

    def _count(self, length: int) -> int:
        return recompute_count(self.params.recompute_ratio, length)

    def cached_segments(self, ctx: GenerationContext, segments: tuple[Segment, ...]) -> list[CachedSpan]:
        """The prefix and every chunk not recomputed in full."""
        spans = []
        for segment, (begin, end) in zip(segments, segment_spans(segments)):
            if segment.role == "query" or end == begin:
                continue
            if segment.role == "chunk" and self._count(end - begin) >= end - begin:
                continue
            spans.append(CachedSpan(begin, end, self.chunk_key(ctx, segment, begin)))
        self._reuses = bool(spans)
        return spans

    def expects_reuse(self) -> bool:
        """Whether the request's plan reads any cache (the guard then fails a prefill that reused nothing):
        not when every chunk is recomputed in full and there is no prefix segment."""
        return self._reuses

    def initial_rows(self, plan: ReusePrefill) -> np.ndarray:
        cached = {span.begin: span for span in plan.spans}
        selected = [plan.uncached]
        self._chunks = []
        for segment, (begin, end) in zip(plan.segments, segment_spans(plan.segments)):
            if segment.role != "chunk" or end == begin:
                continue
            span = cached.get(begin)
            if span is None:  # recomputed in full (an uncached span: its rows are in plan.uncached)
                offsets = np.arange(end - begin, dtype=np.int64)
            else:
                offsets = self.recompute_offsets(span, segment.ids, self._count(end - begin))
                selected.append(begin + offsets)
            self._chunks.append(
                {"begin": begin, "tokens": end - begin, "recomputed": len(offsets), "offsets": offsets.tolist()}
            )
        return np.unique(np.concatenate(selected)).astype(np.int64)

    def telemetry(self) -> dict[str, Any]:
        return {
            **super().telemetry(),
            "chunk_recompute": {"ratio": self.params.recompute_ratio, "chunks": self._chunks},
        }


def chunk_seed(ids: tuple[int, ...]) -> int:
    """A 64-bit number from a chunk's tokens (what seeds its draw with ``seed``)."""
    return int.from_bytes(hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()[:8], "little")


@dataclass(frozen=True)
class RandomRecompParams(ChunkRecomputeParams):
    seed: int = param(0, "random selection seed (with the chunk's tokens: a chunk gets the same draw in every request)")


@register
class RandomRecomp(ChunkRecompute):
    name = "random_recomp"

    Params = RandomRecompParams
    params: RandomRecompParams

    def recompute_offsets(self, span: CachedSpan, ids: tuple[int, ...], count: int) -> np.ndarray:
        generator = np.random.default_rng([self.params.seed, chunk_seed(ids)])
        return np.sort(generator.choice(len(ids), size=count, replace=False)).astype(np.int64)
