"""Where K/V live during a run, and what moving them costs.

One :class:`LayerKV` per transformer layer holds that layer's keys and values (batch size 1) as
``[kv_heads, slots, head_dim]`` with the absolute position of every slot. Two tiers:

* **device** (where attention runs) for methods that keep their cache on the accelerator
  (``full``, eviction methods, ``oracle``);
* **host** (CPU memory, pinned on CUDA) for offloading methods: the *middle* tokens live there and
  every decode step fetches the selected ones. Sink tokens and the recent window are *resident*
  (kept on the device), and a :class:`~kvbench.kv.block_cache.BlockCache` keeps popular blocks.
  A method's dense layers (``dense_layers``: Quest and ClusterKV keep layers 0-1 whole) stay in the
  device tier altogether (``KVStore(resident=...)``): they attend every token at every step.
  Whatever attends a whole offloaded layer (a budget that covers it, a multi-token extension) reads
  it through :meth:`LayerKV.held`, which counts the transfer like any fetch.

Methods never move bytes themselves: they ask :meth:`LayerKV.gather` for slots, and the store counts
every byte that crosses host→device and every cache hit. On a CPU-only machine both tiers are host
memory, and the counts are still exact: they are what the same run would move on a GPU.

Slots are positions until a method evicts; after :meth:`LayerKV.keep` (eviction) slot order no longer
equals position order for every head, so position logic must read :attr:`LayerKV.positions`.

A layer normally stores one row per KV head. An eviction method that keeps a different token set per
*query* head under GQA (SnapKV and PyramidKV as their authors run them) calls :meth:`LayerKV.keep` with
one row per query head: the layer then stores K/V repeated per query head (``n_kv_heads`` becomes the
number of query heads, ``repeat`` the group size), so its bytes count what such a cache really holds.

:meth:`KVStore.snapshot` / :meth:`KVStore.restore` roll a store back to an earlier state, bit for bit
(shared-context multi-query: the context is prefilled and compressed once, and every question's tokens
and answer are dropped before the next question; see :mod:`kvbench.engine.conversation`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch

from kvbench.kv.block_cache import BlockCache


@dataclass
class TransferStats:
    """Bytes and cache events of one layer (or, merged, of a whole run)."""

    bytes_h2d_fetch: int = 0  # synchronous fetch of selected K/V that missed the block cache
    bytes_h2d_cache_fill: int = 0  # asynchronous block-cache fills
    bytes_h2d_index: int = 0  # index traffic a method moves to score tokens (PQ codes, key slices, ...)
    bytes_d2h: int = 0  # offload of K/V to the host tier
    cache_lookups: int = 0  # (kv head, token) pairs requested from the host tier
    cache_hits: int = 0  # ... of which the block cache served

    def merge(self, other: TransferStats) -> TransferStats:
        for key, value in asdict(other).items():
            setattr(self, key, getattr(self, key) + value)
        return self

    @property
    def bytes_h2d(self) -> int:
        return self.bytes_h2d_fetch + self.bytes_h2d_cache_fill + self.bytes_h2d_index

    @property
    def hit_rate(self) -> float | None:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else None

    def to_dict(self) -> dict[str, float | int | None]:
        data: dict[str, float | int | None] = dict(asdict(self))
        data["bytes_h2d"] = self.bytes_h2d
        data["hit_rate"] = self.hit_rate
        return data


class LayerKV:
    """Keys, values and positions of one layer, in one tier, with transfer accounting."""

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        offload: bool = False,
        capacity: int = 0,
    ) -> None:
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.offload = offload
        self.home = torch.device("cpu") if offload else self.device
        self._pin = offload and self.device.type == "cuda"
        self.n = 0  # slots in use
        self.repeat = 1  # stored rows per model KV head (> 1 after a per-query-head keep)
        self.seen = 0  # tokens ever appended (the next token's position)
        self.stats = TransferStats()
        self.cache: BlockCache | None = None
        self.resident_sink = 0
        self.resident_recent = 0
        self._k = self._alloc(capacity, head_dim, dtype)
        self._v = self._alloc(capacity, head_dim, dtype)
        self._pos = self._alloc(capacity, None, torch.long)
        self._bases: dict[tuple[int, int, int], torch.Tensor] = {}  # see _row_base
        # static decode (kvbench.engine.decode): device-side counters bound by the decoder
        self.length: torch.Tensor | None = None  # [1] held slots, the current token's included
        self.current: torch.Tensor | None = None  # [1] the current token's slot (length - 1)
        self.bucket_end = 0  # attention reads slots [0, bucket_end); the ones from length on are masked
        self._iota: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ storage
    def _alloc(self, capacity: int, dim: int | None, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``capacity`` slots, filled: zero K/V, position -1. A static decode step reads a bucket
        of slots and masks the ones not held yet, and a masked slot must still hold a finite number
        (``0 · NaN`` is NaN; ``torch.empty`` can hold anything)."""
        shape = (self.n_kv_heads, capacity) if dim is None else (self.n_kv_heads, capacity, dim)
        return torch.full(shape, -1 if dim is None else 0, dtype=dtype, device=self.home, pin_memory=self._pin)

    @property
    def capacity(self) -> int:
        return self._k.shape[1]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more slots (amortised doubling)."""
        need = self.n + extra
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity, 16)
        for name, dim, dtype in (
            ("_k", self.head_dim, self.dtype),
            ("_v", self.head_dim, self.dtype),
            ("_pos", None, torch.long),
        ):
            old = getattr(self, name)
            new = self._alloc(new_cap, dim, dtype)
            new[:, : self.n] = old[:, : self.n]
            setattr(self, name, new)

    @property
    def keys(self) -> torch.Tensor:
        """``[kv_heads, n, head_dim]`` view of the held keys (in the home tier)."""
        return self._k[:, : self.n]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, : self.n]

    @property
    def positions(self) -> torch.Tensor:
        """``[kv_heads, n]`` absolute position of every held slot."""
        return self._pos[:, : self.n]

    @property
    def element_bytes(self) -> int:
        return self._k.element_size()

    def token_bytes(self) -> int:
        """Bytes of one token's K and V for one KV head."""
        return 2 * self.head_dim * self.element_bytes

    def nbytes(self) -> int:
        """Bytes of the K/V this layer holds (live slots, not spare capacity)."""
        return self.n * self.n_kv_heads * self.token_bytes()

    # ------------------------------------------------------------------ writes
    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Append new tokens ``[kv_heads, t, head_dim]`` at ``positions`` ``[t]`` (default: the next ones)."""
        t = keys.shape[1]
        if self.repeat > 1:
            keys, values = keys.repeat_interleave(self.repeat, dim=0), values.repeat_interleave(self.repeat, dim=0)
        self.reserve(t)
        blocking = not self._pin
        self._k[:, self.n : self.n + t].copy_(keys, non_blocking=not blocking)
        self._v[:, self.n : self.n + t].copy_(values, non_blocking=not blocking)
        if positions is None:
            self._pos[:, self.n : self.n + t] = torch.arange(self.seen, self.seen + t, device=self.home)
            self.seen += t
        else:
            self._pos[:, self.n : self.n + t] = positions.to(self.home).view(1, t)
            self.seen = max(self.seen, int(positions.max()) + 1) if t else self.seen
        if self.offload:
            self.stats.bytes_d2h += t * self.n_kv_heads * self.token_bytes()
        self.n += t

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Put K/V ``[kv_heads, t, head_dim]`` at ``slots`` ``[t]`` (the same for every head), with their
        absolute ``positions`` ``[t]``; slots beyond the held ones extend the layer (a reuse prefill
        installs cached chunks, then overwrites the rows it recomputes).

        The layout decisions (how far the layer extends, whether the slots are one contiguous run) read
        ``slots`` and ``positions`` where a plan builds them, on the host, so that a write into a GPU
        tier waits for nothing; slots held on the device are read back once."""
        t = int(slots.numel())
        if t == 0:
            return
        host = slots if slots.device.type == "cpu" else slots.cpu()
        top = int(host.max()) + 1
        if top > self.n:
            self.reserve(top - self.n)
            self.n = top
        first = int(host[0])
        if top - first == t and bool((host[1:] > host[:-1]).all()):  # a contiguous run: plain copies
            where: slice | torch.Tensor = slice(first, top)
        else:
            where = slots.to(self.home, non_blocking=True)
        self._k[:, where] = keys.to(self.home, self.dtype)
        self._v[:, where] = values.to(self.home, self.dtype)
        self._pos[:, where] = positions.to(self.home, non_blocking=True).view(1, t)
        last = positions if positions.device.type == "cpu" else positions.cpu()
        self.seen = max(self.seen, int(last.max()) + 1)
        if self.offload:
            self.stats.bytes_d2h += t * self.n_kv_heads * self.token_bytes()

    def keep(self, slots: torch.Tensor) -> None:
        """Evict every slot not in ``slots`` (``[kv_heads, m]``, same m per head); keeps slot order.

        ``slots`` with ``r × kv_heads`` rows (``r > 1``: one row per query head of a GQA group) keeps a
        different set per row: the layer then stores its K/V repeated ``r`` times (row ``h`` from KV head
        ``h // r``), and later appends are repeated alike (see the module docstring)."""
        if slots.dim() != 2 or slots.shape[0] % self.n_kv_heads:
            raise ValueError(
                f"keep() expects [kv_heads={self.n_kv_heads} (or a multiple), m] slots, got {tuple(slots.shape)}"
            )
        repeat = slots.shape[0] // self.n_kv_heads
        slots, _ = torch.sort(slots.to(self.home), dim=1)
        heads = (torch.arange(slots.shape[0], device=self.home) // repeat)[:, None]  # row -> stored head
        k, v, pos = self._k[heads, slots], self._v[heads, slots], self._pos[heads, slots]  # no repeated copy
        self.n_kv_heads *= repeat
        self.repeat *= repeat
        m = slots.shape[1]
        self._k = self._alloc(m, self.head_dim, self.dtype)
        self._v = self._alloc(m, self.head_dim, self.dtype)
        self._pos = self._alloc(m, None, torch.long)
        self._k.copy_(k)
        self._v.copy_(v)
        self._pos.copy_(pos)
        self.n = m

    def remove(self, slots: torch.Tensor) -> None:
        """Evict ``slots`` (``[kv_heads, r]``, same r per head)."""
        mask = torch.ones(self.n_kv_heads, self.n, dtype=torch.bool, device=self.home)
        mask.scatter_(1, slots.to(self.home), False)
        keep = torch.nonzero(mask, as_tuple=False)[:, 1].view(self.n_kv_heads, -1)
        self.keep(keep)

    def swap_remove(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Evict ``slots`` (``[kv_heads, r]``, distinct per head) in place, in O(r) copies.

        Unlike :meth:`remove`, slot order is not kept: each evicted slot below ``n - r`` is filled by a
        surviving slot from the last ``r``, and the capacity stays allocated (no copy of the layer, no
        re-allocation on the next append). Positions move with their K/V, so position logic (read
        :attr:`positions`) is unaffected. Returns ``(dst, src)``, ``[kv_heads, r]`` each: slot ``src``
        moved to slot ``dst``, so a method can move its own per-slot state the same way (pairs with
        ``dst == src`` are no-ops).
        """
        if slots.dim() != 2 or slots.shape[0] != self.n_kv_heads:
            raise ValueError(f"swap_remove() expects [kv_heads={self.n_kv_heads}, r] slots, got {tuple(slots.shape)}")
        r = slots.shape[1]
        n, m = self.n, self.n - slots.shape[1]
        heads = torch.arange(self.n_kv_heads, device=self.home)[:, None]
        if r == 0:
            empty = slots.new_empty(self.n_kv_heads, 0).to(self.home)
            return empty, empty
        slots = slots.to(self.home)
        if r == 1:
            dst = slots
            src = torch.full_like(slots, n - 1)
        else:
            removed = torch.zeros(self.n_kv_heads, n, dtype=torch.bool, device=self.home)
            removed.scatter_(1, slots, True)
            if int(removed.sum()) != self.n_kv_heads * r:
                raise ValueError("swap_remove() slots must be distinct per head")
            index = torch.arange(n, device=self.home).expand(self.n_kv_heads, -1)
            # holes: evicted slots below m; movers: surviving slots at or above m (equally many per head).
            # Sorting pushes the unused entries (marked n) to the end of both, where they pair up as no-ops.
            holes = torch.where(removed & (index < m), index, n).sort(dim=1).values[:, :r]
            movers = torch.where(~removed & (index >= m), index, n).sort(dim=1).values[:, :r]
            dst = torch.where(holes < n, holes, n - 1)
            src = torch.where(movers < n, movers, n - 1)
        self._k[heads, dst] = self._k[heads, src]
        self._v[heads, dst] = self._v[heads, src]
        self._pos[heads, dst] = self._pos[heads, src]
        self.n = m
        return dst, src

    # ------------------------------------------------------------------ static decode
    def bind(self, length: torch.Tensor, current: torch.Tensor, bucket_end: int) -> None:
        """The decoder's device-side counters (``[1]`` views) and this step's bucket (static decode)."""
        self.length, self.current, self.bucket_end = length, current, bucket_end

    def iota(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the compute device, made once per size (a decode step asks every layer)."""
        found = self._iota.get(n)
        if found is None:
            found = self._iota[n] = torch.arange(n, device=self.device)
        return found

    def write_current(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """Put the current token's K/V ``[kv_heads, 1, head_dim]`` at slot :attr:`current` and its
        ``position`` (``[1]``, device) beside them, in place (static decode: no host value involved).
        A per-query-head layer (``repeat > 1``) stores the rows once per query head."""
        assert self.current is not None, "write_current needs the decoder's counters (bind)"
        if self.repeat > 1:
            heads, t, d = keys.shape
            keys = keys[:, None].expand(heads, self.repeat, t, d).reshape(heads * self.repeat, t, d)
            values = values[:, None].expand(heads, self.repeat, t, d).reshape(heads * self.repeat, t, d)
        self._k.index_copy_(1, self.current, keys)
        self._v.index_copy_(1, self.current, values)
        self._pos.index_copy_(1, self.current, position.view(1, 1).expand(self._pos.shape[0], 1))

    def write_slot(self, slot: int, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        """:meth:`write_current` at a host-known ``slot`` (a host-tier layer: the copy to pinned memory is
        asynchronous, and the offload is counted)."""
        if slot >= self.capacity:
            raise IndexError(f"slot {slot} is past the layer's capacity {self.capacity} (reserve first)")
        if self.repeat > 1:
            heads, t, d = keys.shape
            keys = keys[:, None].expand(heads, self.repeat, t, d).reshape(heads * self.repeat, t, d)
            values = values[:, None].expand(heads, self.repeat, t, d).reshape(heads * self.repeat, t, d)
        self._k[:, slot : slot + 1].copy_(keys, non_blocking=True)
        self._v[:, slot : slot + 1].copy_(values, non_blocking=True)
        self._pos[:, slot : slot + 1].copy_(position.view(1, 1).expand(self._pos.shape[0], 1), non_blocking=True)
        if self.offload:
            self.stats.bytes_d2h += self.n_kv_heads * self.token_bytes()

    def bucket(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``[0, bucket_end)`` (views; slots from :attr:`length` on hold no token yet)."""
        return self._k[:, : self.bucket_end], self._v[:, : self.bucket_end]

    # ------------------------------------------------------------------ reads
    def set_residency(self, sink: int, recent: int) -> None:
        """Slots below ``sink`` and the last ``recent`` slots are device-resident (offload mode)."""
        self.resident_sink = sink
        self.resident_recent = recent

    def attach_cache(self, cache: BlockCache | None) -> None:
        self.cache = cache

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held K and V on the compute device: views of the home tier when it is the device, else
        a :meth:`gather` of every slot (counted: all of it crosses the link)."""
        if self.home == self.device:
            return self.keys, self.values
        return self.gather(torch.arange(self.n, device=self.home).expand(self._k.shape[0], -1))

    def gather(self, slots: torch.Tensor, cached: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` on the compute device, counting what crosses the host→device link.

        ``slots`` is ``[kv_heads, k]`` (one selection per KV head) or ``[q_heads, k]`` (one per query
        head; query head ``h`` reads KV head ``h // group``). ``cached`` (same shape, optional) flags
        slots a method keeps on the device itself (ClusterKV's cluster cache): they count as hits.
        """
        rows = slots.shape[0]
        if rows % self.n_kv_heads:
            raise ValueError(f"cannot map {rows} selection rows onto {self.n_kv_heads} KV heads")
        group = rows // self.n_kv_heads
        home_slots = slots if slots.device == self.home else slots.to(self.home)
        # one row gather per tensor: row (head h, slot s) of the [kv_heads * capacity, d] view is
        # h * capacity + s (index_select copies whole rows, 3x faster than K[heads, slots] on a CPU)
        flat = (home_slots + self._row_base(rows, group, self.capacity)).view(-1)
        k = self._rows(self._k, flat).view(rows, -1, self.head_dim)
        v = self._rows(self._v, flat).view(rows, -1, self.head_dim)
        if self.offload:
            pairs = home_slots + self._row_base(rows, group, self.n)  # (kv head, slot) as h * n + s
            self._account_fetch(pairs, None if cached is None else cached.to(self.home))
        if k.device != self.device:
            k = k.to(self.device, non_blocking=True)
            v = v.to(self.device, non_blocking=True)
        return k, v

    def _rows(self, tensor: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Rows ``flat`` of ``tensor`` viewed as ``[kv_heads * capacity, d]``. From a pinned host tier
        they are gathered into pinned memory: a plain ``index_select`` returns pageable memory, whose
        copy to the GPU is staged and synchronous (the first GPU session's profile: 1,472 pageable
        copies in 10 decode steps). Pinned buffers come from torch's caching host allocator, which
        keeps a buffer until the asynchronous copy that reads it has finished."""
        source = tensor.view(-1, self.head_dim)
        if not self._pin:
            return source.index_select(0, flat)
        out = torch.empty((flat.numel(), self.head_dim), dtype=tensor.dtype, pin_memory=True)
        return torch.index_select(source, 0, flat, out=out)

    def _row_base(self, rows: int, group: int, stride: int) -> torch.Tensor:
        """``[rows, 1]``: ``(row // group) * stride``, the offset of each selection row's KV head in a
        flattened ``[kv_heads, stride]`` layout (kept while the shape holds: decode asks every step)."""
        key = (rows, group, stride)
        cached = self._bases.get(key)
        if cached is None:
            if len(self._bases) > 8:  # n grows every step: keep the few in use
                self._bases.clear()
            cached = self._bases[key] = (torch.arange(rows, device=self.home) // group * stride)[:, None]
        return cached

    def _distinct(self, pairs: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
        """``[kv_heads, n]`` bool: the (kv head, slot) pairs in ``pairs`` (``h * n + s``, any shape), those
        flagged by ``where`` only. Several query heads reading one KV head's token count it once; a
        mask instead of ``unique`` (a sort) and no compaction (entries left out go to a spare cell)."""
        size = self.n_kv_heads * self.n
        mask = torch.zeros(size + 1, dtype=torch.bool, device=self.home)
        index = pairs if where is None else torch.where(where, pairs, size)
        mask.index_fill_(0, index.reshape(-1), True)
        return mask[:size].view(self.n_kv_heads, self.n)

    def _account_fetch(self, pairs: torch.Tensor, cached: torch.Tensor | None) -> None:
        """Count bytes for the non-resident (kv head, slot) pairs; several query heads share a fetch."""
        low = min(self.resident_sink, self.n)  # resident: slots below low and from high on
        high = max(low, self.n - self.resident_recent)
        if cached is not None:
            held = int(self._distinct(pairs, cached)[:, low:high].sum())
            self.stats.cache_lookups += held
            self.stats.cache_hits += held
            middle = self._distinct(pairs, ~cached)[:, low:high]
        else:
            middle = self._distinct(pairs)[:, low:high]
        if self.cache is None:
            wanted = int(middle.sum())
            self.stats.cache_lookups += wanted
            self.stats.bytes_h2d_fetch += wanted * self.token_bytes()
            return
        slot = torch.nonzero(middle)[:, 1] + low  # every wanted (kv head, slot) pair, by head then slot
        wanted = int(slot.numel())
        if wanted == 0:
            return
        self.stats.cache_lookups += wanted
        hits, admitted = self.cache.serve(self.cache.block_of(slot))  # = lookup, then update
        self.stats.cache_hits += hits
        self.stats.bytes_h2d_fetch += (wanted - hits) * self.token_bytes()
        self.stats.bytes_h2d_cache_fill += admitted * self.cache.block_size * self.n_kv_heads * self.token_bytes()

    def count_index_bytes(self, nbytes: int) -> None:
        """A method moved ``nbytes`` of index data (e.g. PQ codes) to score tokens."""
        self.stats.bytes_h2d_index += int(nbytes)

    # ------------------------------------------------------------------ rollback
    def snapshot(self) -> LayerSnapshot:
        """A copy of what this layer holds now (K, V and positions of the live slots, the counters that
        place the next token, the device-resident ranges), for :meth:`restore`.

        A copy, not a view: eviction rewrites slots in place (``swap_remove``) or reallocates
        (``keep``), so only a copy survives what a later question and its answer do to the layer."""
        n = self.n
        return LayerSnapshot(
            keys=self._k[:, :n].clone(),
            values=self._v[:, :n].clone(),
            positions=self._pos[:, :n].clone(),
            n=n,
            seen=self.seen,
            resident_sink=self.resident_sink,
            resident_recent=self.resident_recent,
        )

    def restore(self, snap: LayerSnapshot) -> None:
        """Hold exactly what :meth:`snapshot` copied (bit for bit), whatever happened since.

        Not rolled back: the transfer counters (the bytes a question and its answer moved were moved)
        and the block cache, a device cache that stays warm across questions; its blocks from slot
        ``snap.n`` on are forgotten, since those slots will hold other tokens."""
        if self.capacity < snap.n:
            self._k = self._alloc(snap.n, self.head_dim, self.dtype)
            self._v = self._alloc(snap.n, self.head_dim, self.dtype)
            self._pos = self._alloc(snap.n, None, torch.long)
        self._k[:, : snap.n].copy_(snap.keys)
        self._v[:, : snap.n].copy_(snap.values)
        self._pos[:, : snap.n].copy_(snap.positions)
        self.n, self.seen = snap.n, snap.seen
        self.resident_sink, self.resident_recent = snap.resident_sink, snap.resident_recent
        if self.cache is not None:
            _forget_blocks_from(self.cache, snap.n)


@dataclass
class LayerSnapshot:
    """What :meth:`LayerKV.snapshot` copied: the live slots' K/V/positions and the layer's counters."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    n: int
    seen: int
    resident_sink: int
    resident_recent: int


def _forget_blocks_from(cache: BlockCache, slot: int) -> None:
    """Drop the cached blocks that cover any slot at or after ``slot`` (their slots get new tokens)."""
    first = (slot - cache.offset) // cache.block_size
    for block in [b for b in cache.blocks() if b >= first]:
        del cache._order[block]
        cache._freq.pop(block, None)


class KVStore:
    """The per-layer stores of one generation."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        offload: bool = False,
        capacity: int = 0,
        resident: Collection[int] = (),
    ) -> None:
        """``offload``: middle tokens live in the host tier; ``resident`` layers stay on the device even
        then (a method's dense layers attend every token at every step, as the papers' code keeps them)."""
        self.layers = [
            LayerKV(
                n_kv_heads,
                head_dim,
                dtype=dtype,
                device=device,
                offload=offload and layer not in resident,
                capacity=capacity,
            )
            for layer in range(n_layers)
        ]
        self.offload = offload

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def held_tokens(self) -> list[int]:
        return [layer.n for layer in self.layers]

    def snapshot(self) -> list[LayerSnapshot]:
        """Every layer's :meth:`LayerKV.snapshot`."""
        return [layer.snapshot() for layer in self.layers]

    def restore(self, snaps: list[LayerSnapshot]) -> None:
        """Every layer back to its snapshot (:meth:`LayerKV.restore`)."""
        for layer, snap in zip(self.layers, snaps, strict=True):
            layer.restore(snap)

    def stats(self) -> TransferStats:
        total = TransferStats()
        for layer in self.layers:
            total.merge(layer.stats)
        return total
