"""``prefix_cache``: reuse the K/V of the longest cached exact token prefix (vLLM automatic prefix
caching / SGLang's radix cache; CacheBlend's "prefix caching" baseline).

K/V of a token depend only on the tokens before it, so the cache of any earlier prompt is exact for
the part a new prompt shares with it from the first token on. The method keeps an index of the
prefixes it has stored (in the chunk store, mode ``prefix``, at their real positions), finds the
stored prefix with the longest common token prefix with the new prompt (token granularity, like
SGLang's radix tree; vLLM matches whole 16-token blocks), installs those rows unchanged (no
re-rotation: same positions) and computes every row after them at every layer. Quality is exactly
``full``'s; only the time changes.

What earlier requests left in the store is the ``warm`` setting, prepared before the clock starts:

* ``first_chunk`` (default) — the prompt's ``prefix`` segment followed by its first chunk, as an
  earlier request with the same first passage would have left it: in a RAG prompt only the fixed
  prefix and the first chunk can hit (CacheBlend §3.2, §7.1);
* ``prefix`` — only the fixed ``prefix`` segment (instruction, template head);
* ``none`` — only what this run's earlier requests stored (``store_prompts: true`` stores each prompt's
  prefix up to the end of its last chunk after the request, outside any measured time).

At least the prompt's last token is always computed (its logits start the generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvbench.engine.reuse import CachedSpan
from kvbench.kv.chunks import ChunkKey
from kvbench.methods import register
from kvbench.methods.params import ReuseParams
from kvbench.methods.reuse import ReuseMethod
from kvbench.params import param
from kvbench.requests import Segment, join_segments, segment_spans


@dataclass(frozen=True)
class PrefixCacheParams(ReuseParams):
    warm: Literal["first_chunk", "prefix", "none"] = param(
        "first_chunk", "what earlier requests left cached: prefix + first chunk | the prefix | nothing"
    )
    store_prompts: bool = param(False, "store each prompt up to its last chunk after the request (request streams)")


@register
class PrefixCache(ReuseMethod):
    name = "prefix_cache"

    Params = PrefixCacheParams
    params: PrefixCacheParams

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self._index: list[ChunkKey] = []

    def expects_reuse(self) -> bool:
        return self.params.warm != "none"

    def _prefix_key(self, ctx: Any, ids: list[int]) -> ChunkKey:
        return ChunkKey(self._fingerprint(ctx), tuple(ids), "prefix")

    def _remember(self, key: ChunkKey) -> None:
        if key not in self._index:
            self._index.append(key)

    def _warm_prefixes(self, segments: tuple[Segment, ...]) -> list[list[int]]:
        spans = segment_spans(segments)
        ids = join_segments(segments)
        ends = []
        if self.params.warm in ("first_chunk", "prefix") and segments[0].role == "prefix":
            ends.append(spans[0][1])
        if self.params.warm == "first_chunk":
            first_chunk = next((end for seg, (_, end) in zip(segments, spans) if seg.role == "chunk"), None)
            if first_chunk is not None:
                ends.append(first_chunk)
        return [ids[:end] for end in ends if end > 0]

    def prepare(self, ctx: Any, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None) -> dict[str, Any]:
        segments = self._require_segments(segments)
        for ids in self._warm_prefixes(segments):
            key = self._prefix_key(ctx, ids)
            self._remember(key)
        return super().prepare(ctx, input_ids, segments)

    def cached_segments(self, ctx: Any, segments: tuple[Segment, ...]) -> list[CachedSpan]:
        ids = join_segments(segments)
        store = self.chunk_store()
        best, length = None, 0
        for key in self._index:
            if key.model != self._fingerprint(ctx):
                continue
            shared = _common_prefix(key.ids, ids)
            if shared > length and (store.contains(key) is not None or len(key.ids) == shared):
                best, length = key, shared
        length = min(length, len(ids) - 1)
        if best is None or length <= 0:
            return []
        return [CachedSpan(0, length, best, rows=slice(0, length))]

    def precompute(self, ctx: Any, key: ChunkKey) -> None:
        """Prefixes are stored whole, at their real positions (mode ``prefix``)."""
        from kvbench.engine.generate import prefill_kv
        from kvbench.kv.chunks import ChunkKV

        keys, values = prefill_kv(ctx.loaded, list(key.ids))
        self.chunk_store().put(key, ChunkKV(keys, values, 0))

    def after_request(self, ctx: Any, segments: tuple[Segment, ...] | None) -> None:
        """Store the prompt's prefix up to its last chunk (what a serving engine keeps), if asked."""
        if not self.params.store_prompts or segments is None:
            return
        spans = segment_spans(segments)
        end = max((e for seg, (_, e) in zip(segments, spans) if seg.role != "query"), default=0)
        if end <= 0:
            return
        ids = join_segments(segments)[:end]
        key = self._prefix_key(ctx, ids)
        if self.chunk_store().contains(key) is None:
            keys = [layer.keys[:, :end].clone() for layer in ctx.store.layers]
            values = [layer.values[:, :end].clone() for layer in ctx.store.layers]
            from kvbench.kv.chunks import ChunkKV

            self.chunk_store().put(key, ChunkKV(keys, values, 0))
        self._remember(key)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = torch.tensor(a[:n])
    y = torch.tensor(b[:n])
    differ = torch.nonzero(x != y)
    return int(differ[0]) if differ.numel() else n
