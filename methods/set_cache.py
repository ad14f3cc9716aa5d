"""``set_cache``: prefix caching over a prompt whose retrieved chunks are reordered to hit the longest
stored prefix (Cache-Craft's "Set-Cache" baseline; Agarwal et al., Cache-Craft, SIGMOD 2025, arXiv
2502.15734, §Evaluation).

Cache-Craft's baselines include Set-Cache: treat a request's retrieved chunks as a *set*, reorder them
so that the longest exact prefix already cached is hit, and serve the reordered prompt with exact
prefix reuse. **The reordering changes the prompt the model sees** (the chunks' order), so its answer
can differ from ``full``'s on the retrieval order — that is the baseline's cost in quality; the reuse
itself is exact (``prefix_cache``'s: K/V of the stored prompt's shared token prefix, unchanged).

How it runs here (the storage and lookup are :class:`~kvbench.methods.prefix_cache.PrefixCache`'s):

* stored prompts are ``prefix_cache``'s: with ``store_prompts`` (default **true** here, unlike
  ``prefix_cache``: reordering exists to hit what earlier requests of a stream left) each served prompt
  is stored up to the end of its last chunk after the request; ``warm`` adds what the retrieval-order
  prompt's earlier requests would have left (``first_chunk``: its prefix and first chunk; see
  ``prefix_cache``);
* the order (before the request's clock, in :meth:`SetCache.prepare`): every stored prompt is followed
  from the first token — the prompt's non-chunk segments in place must match it, and at each chunk slot
  the first remaining retrieved chunk (in retrieval order) whose tokens continue it is taken — and the
  stored prompt followed furthest (in tokens; ties: the one stored first) gives the leading chunks; the
  other chunks follow in retrieval order. This is the greedy "at each position, a chunk that continues
  a stored sequence", with the choice among several continuations made by how far each leads. Chunks
  match whole (a chunk that matches only in part is not moved for it); the served prompt's exact hit is
  then ``prefix_cache``'s token-granular lookup;
* a stored prompt is a candidate when the store holds it or when it is followed to its last token
  (``prefix_cache``'s lookup rule: such a prefix is precomputed before the clock);
* non-chunk segments (``prefix``, ``query``) never move; with nothing stored the order is the retrieval
  order and the method is ``prefix_cache`` exactly.

The reordered prompt replaces the request's in the method's prefill plan and in what it stores after
the request (the engine hands the retrieval-order prompt to :meth:`~SetCache.prefill_plan` and
:meth:`~SetCache.after_request`; the two are the same length). Telemetry (``telemetry.method.set_cache``,
per request): ``order`` (the served chunks as indices into the retrieval order), ``reordered``,
``matched_chunks`` / ``matched_tokens`` (how far the chosen stored prompt was followed) and
``stored_tokens`` (its length; 0 when none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvbench.kv.chunks import ChunkKey
from kvbench.methods import register
from kvbench.methods.prefix_cache import PrefixCache, PrefixCacheParams
from kvbench.params import param
from kvbench.requests import Segment, join_segments

if TYPE_CHECKING:
    from kvbench.engine.prefill import PrefillPlan


def follow(segments: tuple[Segment, ...], stored: tuple[int, ...]) -> tuple[list[int], int]:
    """Follow ``stored`` (a stored prompt's tokens) through ``segments``: the chunks (indices into
    ``segments``, in the order taken) that continue it, and the tokens matched. Non-chunk segments stay
    in place and must match whole; at a chunk slot the first remaining chunk that matches whole is taken."""
    remaining = [i for i, segment in enumerate(segments) if segment.role == "chunk"]
    taken: list[int] = []
    at = 0
    for segment in segments:
        if segment.role != "chunk":
            if stored[at : at + len(segment)] != segment.ids:
                break
            at += len(segment)
            continue
        found = next(
            (i for i in remaining if len(segments[i]) and stored[at : at + len(segments[i])] == segments[i].ids), None
        )
        if found is None:
            break
        remaining.remove(found)
        taken.append(found)
        at += len(segments[found])
    return taken, at


def arrange(segments: tuple[Segment, ...], leading: list[int]) -> tuple[Segment, ...]:
    """``segments`` with the chunk slots filled by ``leading`` first, then the other chunks in order."""
    chunks = [i for i, segment in enumerate(segments) if segment.role == "chunk"]
    order = iter([*leading, *[i for i in chunks if i not in leading]])
    return tuple(segments[next(order)] if segment.role == "chunk" else segment for segment in segments)


@dataclass(frozen=True)
class SetCacheParams(PrefixCacheParams):
    store_prompts: bool = param(
        True, "store each served (reordered) prompt up to its last chunk after the request: what later requests hit"
    )


@register
class SetCache(PrefixCache):
    name = "set_cache"

    Params = SetCacheParams
    params: SetCacheParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self._retrieved: tuple[Segment, ...] | None = None
        self._served: tuple[Segment, ...] | None = None
        self._served_ids: torch.Tensor | None = None
        self._order: dict[str, Any] = {}

    def _warm_prefixes(self, segments: tuple[Segment, ...]) -> list[list[int]]:
        """What earlier requests left, from the prompt in its retrieval order (not the reordered one)."""
        return super()._warm_prefixes(self._retrieved if self._retrieved is not None else segments)

    def _candidates(self, ctx: Any) -> list[ChunkKey]:
        model = self._fingerprint(ctx)
        return [key for key in self._index if key.model == model]

    def plan_order(self, ctx: Any, segments: tuple[Segment, ...]) -> tuple[list[int], int, int]:
        """(leading chunks as indices into ``segments``, tokens matched, the stored prompt's length)."""
        store = self.chunk_store()
        best: tuple[list[int], int, int] = ([], 0, 0)
        for key in self._candidates(ctx):
            taken, matched = follow(segments, key.ids)
            if matched > best[1] and (store.contains(key) is not None or matched == len(key.ids)):
                best = (taken, matched, len(key.ids))
        return best

    def prepare(self, ctx: Any, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None) -> dict[str, Any]:
        segments = self._require_segments(segments)
        self._retrieved = segments
        for ids in self._warm_prefixes(segments):
            self._remember(self._prefix_key(ctx, ids))
        leading, matched, stored = self.plan_order(ctx, segments)
        served = arrange(segments, leading)
        chunks = [i for i, segment in enumerate(segments) if segment.role == "chunk"]
        slots = {index: n for n, index in enumerate(chunks)}
        order = [slots[i] for i in [*leading, *[i for i in chunks if i not in leading]]]
        self._order = {
            "order": order,
            "reordered": order != sorted(order),
            "matched_chunks": len(leading),
            "matched_tokens": matched,
            "stored_tokens": stored,
        }
        self._served = served
        self._served_ids = torch.tensor(join_segments(served), dtype=input_ids.dtype)
        return super().prepare(ctx, self._served_ids, served)

    def prefill_plan(self, ctx: Any, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None) -> PrefillPlan:
        """The reuse plan of the reordered prompt (see the module docs)."""
        if self._served is None or self._served_ids is None or self._served_ids.numel() != input_ids.numel():
            raise RuntimeError("set_cache: prefill_plan without the prepare of the same request")
        return super().prefill_plan(ctx, self._served_ids, self._served)

    def after_request(self, ctx: Any, segments: tuple[Segment, ...] | None) -> None:
        super().after_request(ctx, self._served if self._served is not None else segments)
        self._retrieved = self._served = self._served_ids = None

    def telemetry(self) -> dict[str, Any]:
        return {**super().telemetry(), "set_cache": self._order}
