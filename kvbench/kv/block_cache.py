"""A device-side cache of token blocks between the host tier and attention.

Offloading methods (PQCache, InfLLM, ClusterKV) fetch the selected tokens' K/V from host memory at
every decode step; tokens that stay important from step to step are worth keeping on the device.
PQCache caches *blocks* of 128 consecutive tokens (all KV heads of a layer together), checks the
selected tokens against the cache, fetches only the misses, and after the step admits the
``update_blocks`` blocks that hold the most selected tokens, evicting by LRU or LFU.

The cache decides *what* is resident and *where*: each admitted block gets a row of the device buffer
(:attr:`BlockCache.rows`), which :class:`~kvbench.kv.device_tier.DeviceTier` fills with the block's K/V
of every KV head and reads the hits from; :class:`~kvbench.kv.store.LayerKV` does the counting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from itertools import count

import numpy as np
import torch


class BlockCache:
    """Which blocks of one layer are resident on the device, with an LRU or LFU replacement rule."""

    def __init__(
        self,
        capacity_blocks: int,
        *,
        block_size: int = 128,
        policy: str = "lfu",
        update_blocks: int | None = None,
        offset: int = 0,
    ):
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown block-cache policy {policy!r}; use 'lru' or 'lfu'")
        self.capacity = int(capacity_blocks)
        self.block_size = int(block_size)
        self.policy = policy
        self.update_blocks = int(update_blocks if update_blocks is not None else capacity_blocks)
        self.offset = int(offset)  # block b holds positions [offset + b*block_size, offset + (b+1)*block_size)
        self._freq: dict[int, int] = {}
        self._order: OrderedDict[int, int] = OrderedDict()  # block -> admission/touch tick
        self._tick = count()
        self.rows: dict[int, int] = {}  # block -> its row of the device buffer
        self._free = list(range(self.capacity - 1, -1, -1))  # free buffer rows (pop: the lowest first)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def blocks(self) -> list[int]:
        return list(self._order)

    def block_of(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots - self.offset).div(self.block_size, rounding_mode="floor")

    def lookup(self, blocks: torch.Tensor) -> torch.Tensor:
        """Boolean mask: which of ``blocks`` (any shape) are resident. Touches the hits."""
        if not self._order or blocks.numel() == 0:
            return torch.zeros_like(blocks, dtype=torch.bool)
        resident = torch.tensor(list(self._order), dtype=blocks.dtype, device=blocks.device)
        hit = torch.isin(blocks, resident)
        if hit.any():
            self._touch(torch.unique(blocks[hit]).tolist())
        return hit

    def update(self, requested_blocks: torch.Tensor) -> int:
        """Admit the ``update_blocks`` most requested blocks of this step; return how many were new."""
        if self.capacity == 0 or requested_blocks.numel() == 0:
            return 0
        ids, counts = torch.unique(requested_blocks.flatten(), return_counts=True)  # ids ascending
        # Most requested first; among equals the lower block id first (deterministic): a stable sort
        # of the counts keeps the ascending ids of equal counts in order.
        order = torch.sort(counts, descending=True, stable=True).indices[: self.update_blocks]
        return len(self._admit(ids[order].tolist()))

    def serve(self, blocks: torch.Tensor) -> tuple[int, int]:
        """One decode step's requests (``blocks``, 1-D, one entry per requested token and head):
        :meth:`lookup` then :meth:`update`, from a single count per block. Returns ``(hits, admitted)``:
        requests the resident blocks served, blocks newly admitted. (:meth:`serve_array` on the host copy.)"""
        hits, admitted = self.serve_array(blocks.cpu().numpy().astype(np.int64, copy=False))
        return hits, len(admitted)

    def serve_array(self, blocks: np.ndarray) -> tuple[int, list[int]]:
        """:meth:`serve` on a host array; returns the hits and the blocks newly admitted, in admission order.

        The same decisions as :meth:`lookup` then :meth:`update` (hits touched in ascending block order,
        then the most requested blocks admitted, lower id first among equals), from one count per block
        made on the host (numpy: the store plans a gather from its one read of the selection)."""
        if blocks.size == 0:
            return 0, []
        low = int(blocks.min())
        counts = np.bincount(blocks.reshape(-1) - low)  # counts[i]: requests of block low + i
        hits = 0
        touched = []
        for block in sorted(self._order):
            i = block - low
            if 0 <= i < counts.size and counts[i]:
                hits += int(counts[i])
                touched.append(block)
        self._touch(touched)
        if self.capacity == 0:
            return hits, []
        ids = np.flatnonzero(counts)
        order = np.lexsort((ids, -counts[ids]))[: self.update_blocks]  # most requested, lower id first
        return hits, self._admit((ids[order] + low).tolist())

    def rows_of(self, blocks: np.ndarray) -> np.ndarray:
        """The buffer row of each of ``blocks`` (any shape), -1 where the block is not resident."""
        if not self.rows:
            return np.full(blocks.shape, -1, dtype=np.int64)
        ids = np.fromiter(self.rows.keys(), dtype=np.int64, count=len(self.rows))
        rows = np.fromiter(self.rows.values(), dtype=np.int64, count=len(self.rows))
        order = np.argsort(ids)
        ids, rows = ids[order], rows[order]
        at = np.minimum(np.searchsorted(ids, blocks), ids.size - 1)
        return np.where(ids[at] == blocks, rows[at], -1)

    def forget_from(self, slot: int) -> None:
        """Drop the blocks that cover any slot at or after ``slot`` (their slots get new tokens)."""
        first = (slot - self.offset) // self.block_size
        for block in [b for b in self._order if b >= first]:
            self._drop(block)

    def _admit(self, blocks: Iterable[int]) -> list[int]:
        """Admit ``blocks`` in order (evicting by the policy when full), skipping resident ones; returns
        the new ones, each with a buffer row."""
        admitted = []
        for block in blocks:
            if block in self._order:
                continue
            if len(self._order) >= self.capacity:
                self._evict()
            self._order[block] = next(self._tick)
            self._freq[block] = 1
            self.rows[block] = self._free.pop()
            admitted.append(block)
        return admitted

    def _touch(self, blocks: list[int]) -> None:
        for block in blocks:
            self._freq[block] = self._freq.get(block, 0) + 1
            self._order[block] = next(self._tick)
            self._order.move_to_end(block)

    def _evict(self) -> None:
        if self.policy == "lru":
            victim = next(iter(self._order))
        else:  # least frequently used, the least recently touched among equals
            victim = min(self._order, key=lambda b: (self._freq.get(b, 0), self._order[b]))
        self._drop(victim)

    def _drop(self, block: int) -> None:
        del self._order[block]
        self._freq.pop(block, None)
        self._free.append(self.rows.pop(block))
