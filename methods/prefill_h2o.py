"""``prefill_h2o``: full reuse with each chunk's most-attended tokens recomputed (Cache-Craft's
"Prefill-H2O" baseline; Agarwal et al., Cache-Craft, SIGMOD 2025, arXiv 2502.15734, §Evaluation).

Cache-Craft compares its choice of recomputed tokens (the highest inter-chunk attention) with the
heavy hitters of H2O (Zhang et al., NeurIPS 2023) applied to the prefill, *at the same recompute ratio
on the same reuse plan*; secondary write-ups of the paper report Prefill-H2O only 2-10 % better than
full reuse. The plan is :mod:`kvbench.methods.random_recomp`'s (full reuse of every chunk's
precomputed K/V as ``full_reuse`` does it, ``ceil(recompute_ratio · |C|)`` tokens of each chunk
recomputed from layer 0 through every layer, no check layer); only the tokens differ.

**The score** is H2O's accumulated attention: the attention a token *receives*, summed over the query
rows that attend it. It is measured when the chunk's K/V are computed — the chunk's own precompute
(alone, or after BOS with ``chunk_bos``), a dense prefill outside the request's clock — so it is a
property of the stored chunk, known before the prefill, like a Cache-Craft variant's statistics (and
it sees nothing of the other chunks: a chunk's cache never has). Per layer the received-attention
column sums come from :func:`kvbench.engine.attention_stats.column_mass` (row blocks of at most
``stats_block`` logits); the tokens with the highest score are recomputed (ties: the earlier token).

Aggregation choices (ours; H2O defines the score for one head of one layer during decoding):

* rows: every row of the chunk's precompute at or after the token — causal, the token's own row
  included (H2O sums the causal attention matrix's column); the BOS row attends only itself, and the
  BOS column is dropped;
* heads: ``heads`` (default ``mean``) combines the query heads' column sums (``max``: the largest
  head's, ``sum``);
* layers: the per-layer scores are **summed** over every layer;
* no normalisation by the number of rows that can attend a token, so earlier tokens of a chunk are
  favoured, as in H2O's own accumulation;
* the softmax scale is ``head_dim ** -0.5`` (the scale of the models kvbench runs, as its decoder uses).

The score pass runs inside :meth:`PrefillH2O.precompute` on the queries the precompute's dense prefill
hands over (:func:`~kvbench.engine.generate.prefill_kv` ``query_rows``: every layer's post-RoPE queries of
the chunk, held until its scores are made), so its time is in ``prepared.precompute_s``. A chunk
already held by the store without a score (precomputed by another method of a sweep, or a disk entry
of an earlier run) is scored by a fresh precompute of it, its K/V discarded (``prepared.score_s``,
``prepared.scored_chunks``). Scores live in the method's memory, keyed by the chunk's cache key.

``recompute_ratio: 1.0`` is token-identical to ``full``, ``0.0`` to ``full_reuse``. Telemetry as
``random_recomp``'s (``telemetry.method.chunk_recompute``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kvbench.engine.attention_stats import column_mass
from kvbench.engine.reuse import CachedSpan
from kvbench.kv.chunks import ChunkKey, ChunkKV
from kvbench.methods import register
from kvbench.methods.params import ChunkRecomputeParams
from kvbench.methods.primitives.cachecraft import select_tokens
from kvbench.methods.random_recomp import ChunkRecompute
from kvbench.params import param
from kvbench.requests import Segment

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext


@dataclass(frozen=True)
class PrefillH2OParams(ChunkRecomputeParams):
    heads: Literal["mean", "max", "sum"] = param(
        "mean", "how the query heads' received-attention column sums are combined: mean | max | sum"
    )
    stats_block: int = param(1 << 22, "score pass: attention entries (head x row x key) computed at once", min=1)


@register
class PrefillH2O(ChunkRecompute):
    name = "prefill_h2o"

    Params = PrefillH2OParams
    params: PrefillH2OParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        #: chunk cache digest -> each token's accumulated received attention (float64, ``[|C|]``)
        self.scores: dict[str, np.ndarray] = {}

    def precompute(self, ctx: GenerationContext, key: ChunkKey) -> None:
        """A chunk's K/V, stored, and its tokens' scores (the prefix segment: the family's exact cache)."""
        if key.mode == "prefix":
            super().precompute(ctx, key)
        else:
            self._score(ctx, key, store=True)

    def _score(self, ctx: GenerationContext, key: ChunkKey, *, store: bool) -> None:
        from kvbench.engine.generate import prefill_kv

        ids, start = list(key.ids), 0
        if key.mode == "bos":
            bos = self._bos(ctx)
            assert bos is not None
            ids, start = [bos, *ids], 1
        keys, values, queries = prefill_kv(ctx.loaded, ids, query_rows=torch.arange(len(ids)))
        if store:
            entry = ChunkKV(
                [k[:, start:].contiguous() for k in keys], [v[:, start:].contiguous() for v in values], start
            )
            self.chunk_store().put(key, entry)
        positions = torch.arange(len(ids))
        scaling = ctx.spec.head_dim**-0.5
        total = torch.zeros(len(ids), dtype=torch.float64)
        for query, layer_keys in zip(queries, keys):
            mass = column_mass(
                query,
                positions,
                layer_keys,
                positions,
                scaling,
                heads=self.params.heads,
                block_elements=self.params.stats_block,
            )
            total += mass.double().cpu()
        self.scores[key.digest] = total[start:].numpy()

    def prepare(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> dict[str, Any]:
        report = super().prepare(ctx, input_ids, segments)
        started, scored = time.perf_counter(), 0
        for span in self.cached_segments(ctx, self._require_segments(segments)):
            if span.key.mode != "prefix" and span.key.digest not in self.scores:
                self._score(ctx, span.key, store=False)
                scored += 1
        report["score_s"] = time.perf_counter() - started
        report["scored_chunks"] = scored
        return report

    def recompute_offsets(self, span: CachedSpan, ids: tuple[int, ...], count: int) -> np.ndarray:
        return select_tokens(self.scores[span.key.digest], count)
