"""The device side of an offloaded layer: what stays on the accelerator, and how a gather is assembled.

An offloaded :class:`~kvbench.kv.store.LayerKV` keeps every token's K/V in its host tier (pinned CPU
memory on CUDA). Its :class:`DeviceTier` holds, on the compute device, the rows a decode step reads
without crossing the host→device link, in one *arena* per K and V (``[rows, head_dim]``, so that a
gather is one ``index_select``):

* **sinks** — slots ``[0, sink)`` of every KV head (``[heads, sink]`` rows);
* **window** — a ring of ``window`` rows per KV head: slot ``s`` lives at entry ``s % window``. It holds
  the local window and every token written since (the prefill's tail, then each decode token as
  :meth:`~kvbench.kv.store.LayerKV.write_slot` or ``append`` writes it), and grows when a method widens
  its resident range (ClusterKV's unclustered tokens); a token that leaves the resident range is read
  from the host tier again, as the accounting counts it;
* **block cache** — ``blocks × block_size`` tokens of every KV head, block-major: the blocks the
  :class:`~kvbench.kv.block_cache.BlockCache` admitted, at the buffer row it gave them;
* **misses** — room for the rows one gather fetches from the host tier.

Writes keep the copies equal to the host tier: a written slot goes to the sink region, the ring and a
cached block that covers it (a device-to-device copy of the K/V the model just computed). Anything that
rewrites the host tier in place (eviction, a reuse install, a rollback past a rewrite) marks the copies
stale; a stale or missing row is copied again from the host tier when a gather needs it, and counted in
:attr:`DeviceTier.repairs` (no run of a retrieval method needs one: the tests check it).

On CUDA the miss rows (gathered on the CPU into pinned memory) and the gather's index go to the device on
a side stream, and the compute stream waits for an event before it reads them; block fills go the same
way after the step's reads. On a CPU both tiers are host memory and the same code runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbench.kv.block_cache import BlockCache

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, shared by every layer (copies of one layer are ordered by events)."""
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device)
    return stream


@dataclass
class TierSnapshot:
    """What :meth:`DeviceTier.snapshot` copied: the sink and window regions and which slots they hold."""

    heads: int
    sink: int
    window: int
    k: torch.Tensor  # [heads * (sink + window), d]: the sink and window regions, copied on the device
    v: torch.Tensor
    sink_held: np.ndarray
    ring_slot: np.ndarray


@dataclass
class Fill:
    """Rows of the host tier to copy into the arena (block fills, repairs): host row → arena row."""

    source: np.ndarray  # flat host rows (kv head × capacity + slot)
    target: np.ndarray  # arena rows


class DeviceTier:
    """Device copies of one offloaded layer's resident rows and cached blocks (module docstring)."""

    def __init__(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.heads, self.head_dim, self.dtype, self.device = heads, head_dim, dtype, device
        self.cuda = device.type == "cuda"
        self.sink = 0  # slots [0, sink) have a row in the sink region
        self.window = 1  # ring entries per KV head
        self.cache: BlockCache | None = None
        self.spare = 0  # rows for one gather's misses
        self.sink_held = np.zeros(0, dtype=bool)  # sink slot s holds its row
        self.ring_slot = np.full(1, -1, dtype=np.int64)  # the slot each ring entry holds (-1: none)
        self.filled = np.zeros(0, dtype=bool)  # buffer row r holds its block (as the host tier has it)
        self.repairs = 0  # rows copied again from the host tier (stale or missing copies)
        self.rows_fetched = 0  # miss rows that crossed (kv head, slot), ClusterKV's cached rows included
        self.rows_filled = 0  # block-fill rows that crossed
        self.last_staging: torch.Tensor | None = None  # the last gather's miss rows on the host (tests)
        self._event: torch.cuda.Event | None = None  # the side stream's last copy into this arena
        self.k = self.v = torch.zeros(0, head_dim, dtype=dtype, device=device)
        self._allocate()

    # ------------------------------------------------------------------ layout
    @property
    def block(self) -> int:
        return self.cache.block_size if self.cache is not None else 0

    @property
    def blocks(self) -> int:
        return self.cache.capacity if self.cache is not None else 0

    @property
    def ring_at(self) -> int:
        return self.heads * self.sink

    @property
    def cache_at(self) -> int:
        return self.ring_at + self.heads * self.window

    @property
    def miss_at(self) -> int:
        return self.cache_at + self.blocks * self.heads * self.block

    def _allocate(self) -> None:
        rows = self.miss_at + self.spare
        self.k = torch.zeros(rows, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(rows, self.head_dim, dtype=self.dtype, device=self.device)

    def _regions(self, k: torch.Tensor, sink: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[heads, sink, d]`` and ``[heads, window, d]`` views of an arena laid out with those sizes."""
        h = self.heads
        d = self.head_dim
        return k[: h * sink].view(h, sink, d), k[h * sink : h * (sink + window)].view(h, window, d)

    def sink_view(self, k: torch.Tensor) -> torch.Tensor:
        return self._regions(k, self.sink, self.window)[0]

    def ring_view(self, k: torch.Tensor) -> torch.Tensor:
        return self._regions(k, self.sink, self.window)[1]

    def cache_view(self, k: torch.Tensor) -> torch.Tensor:
        """``[blocks, heads, block, d]``."""
        return k[self.cache_at : self.miss_at].view(self.blocks, self.heads, self.block, self.head_dim)

    def resize(self, sink: int, window: int, spare: int | None = None) -> None:
        """Room for ``sink`` sink slots, a ring of at least ``window`` entries and ``spare`` miss rows (never
        less than now)."""
        sink = max(sink, self.sink)
        window = self.window if window <= self.window else max(window, 2 * self.window)  # (amortised growth)
        spare = self.spare if spare is None else max(spare, self.spare)
        if (sink, window, spare) != (self.sink, self.window, self.spare):
            self._relayout(sink, window, spare, self.cache)

    def set_cache(self, cache: BlockCache | None) -> None:
        """A block cache attached to the layer: its region, every buffer row unfilled."""
        self._relayout(self.sink, self.window, self.spare, cache)

    def _relayout(self, sink: int, window: int, spare: int, cache: BlockCache | None) -> None:
        """A new arena of these sizes holding what the old one held (copied device to device): the sink
        rows, the ring (re-laid when its size changes: slot ``s`` moves from ``s % old`` to ``s % new``,
        the newest slot winning an entry), the cached blocks (the same cache only)."""
        self.wait_side()
        old_k, old_v = self.k, self.v
        old_sink, old_window, old_ring = self.sink, self.window, self.ring_slot
        old_cache = slice(self.cache_at, self.miss_at)
        same_cache = cache is self.cache
        self.sink, self.window, self.spare, self.cache = sink, window, spare, cache
        self._allocate()
        for old, new in ((old_k, self.k), (old_v, self.v)):
            sinks, ring = self._regions(old, old_sink, old_window)
            self.sink_view(new)[:, :old_sink].copy_(sinks)
            if window == old_window:
                self.ring_view(new).copy_(ring)
            if same_cache:
                new[self.cache_at : self.miss_at].copy_(old[old_cache])
        self.sink_held = np.concatenate([self.sink_held, np.zeros(sink - old_sink, dtype=bool)])
        if not same_cache:
            self.filled = np.zeros(self.blocks, dtype=bool)
        if window != old_window:
            ring_k, ring_v = (self._regions(old, old_sink, old_window)[1] for old in (old_k, old_v))
            self._lay_ring(ring_k, ring_v, old_ring)

    def _lay_ring(self, ring_k: torch.Tensor, ring_v: torch.Tensor, slots_held: np.ndarray) -> None:
        """Put the rows of another ring (``[heads, entries, d]``, entry ``j`` holding slot ``slots_held[j]``)
        into this one at ``slot % window``, the newest slot winning an entry; this ring holds nothing else."""
        self.ring_slot = np.full(self.window, -1, dtype=np.int64)
        held = np.flatnonzero(slots_held >= 0)
        held = held[np.argsort(slots_held[held], kind="stable")]  # oldest first: the newest is written last
        slots = slots_held[held]
        self.ring_slot[slots % self.window] = slots
        kept = self.ring_slot[slots % self.window] == slots
        if not kept.any():
            return
        source = torch.from_numpy(held[kept]).to(self.device)
        target = torch.from_numpy(slots[kept] % self.window).to(self.device)
        for ring, arena in ((ring_k, self.k), (ring_v, self.v)):
            self.ring_view(arena).index_copy_(1, target, ring.index_select(1, source))

    def reset(self) -> None:
        """The host tier was rewritten in place: no copy is current any more."""
        self.sink_held[:] = False
        self.ring_slot[:] = -1
        self.filled[:] = False

    # ------------------------------------------------------------------ writes
    def write(self, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Slots ``[first, first + t)`` were written with ``keys``/``values`` ``[heads, t, d]``: the sink rows,
        the newest ``window`` rows into the ring, and the rows of cached blocks."""
        t = keys.shape[1]
        end = first + t
        if first < self.sink:  # sinks
            stop = min(end, self.sink)
            self.sink_view(self.k)[:, first:stop].copy_(keys[:, : stop - first])
            self.sink_view(self.v)[:, first:stop].copy_(values[:, : stop - first])
            self.sink_held[first:stop] = True
        start = max(first, end - self.window)  # ring: at most two runs of entries
        while start < end:
            entry = start % self.window
            stop = min(end, start + self.window - entry)
            self.ring_view(self.k)[:, entry : entry + stop - start].copy_(keys[:, start - first : stop - first])
            self.ring_view(self.v)[:, entry : entry + stop - start].copy_(values[:, start - first : stop - first])
            self.ring_slot[entry : entry + stop - start] = np.arange(start, stop)
            start = stop
        cache = self.cache
        if cache is None or not cache.rows:
            return
        b = cache.block_size
        for block in range((first - cache.offset) // b, (end - 1 - cache.offset) // b + 1):
            row = cache.rows.get(block)
            if row is None:
                continue
            lo, hi = max(first, cache.offset + block * b), min(end, cache.offset + (block + 1) * b)
            at = lo - cache.offset - block * b
            self.wait_side()  # (a fill of this row may still be in flight)
            self.cache_view(self.k)[row, :, at : at + hi - lo].copy_(keys[:, lo - first : hi - first])
            self.cache_view(self.v)[row, :, at : at + hi - lo].copy_(values[:, lo - first : hi - first])

    # ------------------------------------------------------------------ reads
    def sink_rows(self, head: np.ndarray, slot: np.ndarray) -> np.ndarray:
        return head * self.sink + slot

    def ring_rows(self, head: np.ndarray, slot: np.ndarray) -> np.ndarray:
        return self.ring_at + head * self.window + slot % self.window

    def cache_rows(self, head: np.ndarray, slot: np.ndarray, row: np.ndarray) -> np.ndarray:
        assert self.cache is not None
        within = (slot - self.cache.offset) % self.block
        return self.cache_at + (row * self.heads + head) * self.block + within

    def missing_resident(self, sink_slots: np.ndarray, ring_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct sink and window slots asked for whose copies are not here (normally none)."""
        sinks = np.unique(sink_slots[~self.sink_held[sink_slots]]) if sink_slots.size else sink_slots
        ring = ring_slots[self.ring_slot[ring_slots % self.window] != ring_slots] if ring_slots.size else ring_slots
        return sinks, np.unique(ring)

    def block_fill(self, blocks: list[int], capacity: int, limit: int) -> Fill:
        """Host rows → arena rows of ``blocks`` (admitted, each at its buffer row): slots ``[0, limit)`` of
        each block still cached (a slot from ``limit`` on holds no token yet: a write puts it there when
        it comes)."""
        assert self.cache is not None
        cache, b, heads = self.cache, self.block, np.arange(self.heads)[:, None]
        sources, targets = [], []
        for block in blocks:
            row = cache.rows.get(block)
            if row is None:  # (admitted, then evicted by a later admission of the same step: never read)
                continue
            lo = max(0, cache.offset + block * b)
            hi = min(limit, capacity, cache.offset + (block + 1) * b)
            self.filled[row] = True
            if hi <= lo:
                continue
            slots = np.arange(lo, hi)[None, :]
            sources.append((heads * capacity + slots).reshape(-1))
            within = slots - cache.offset - block * b
            targets.append((self.cache_at + (row * self.heads + heads) * b + within).reshape(-1))
        empty = np.zeros(0, dtype=np.int64)
        return Fill(np.concatenate(sources) if sources else empty, np.concatenate(targets) if targets else empty)

    def repair(
        self, host_k: torch.Tensor, host_v: torch.Tensor, capacity: int, sinks: np.ndarray, ring: np.ndarray
    ) -> None:
        """Copy ``sinks`` and ``ring`` slots (every KV head) from the host tier into their places (counted in
        :attr:`repairs`; synchronous: this is the recovery path, not the decode path)."""
        heads = np.arange(self.heads)[:, None]
        sources = [(heads * capacity + s[None, :]).reshape(-1) for s in (sinks, ring) if s.size]
        targets = [self.sink_rows(heads, sinks[None, :]).reshape(-1)] if sinks.size else []
        if ring.size:
            targets.append(self.ring_rows(heads, ring[None, :]).reshape(-1))
        self.sink_held[sinks] = True
        self.ring_slot[ring % self.window] = ring
        if sources:
            self.copy_rows(host_k, host_v, Fill(np.concatenate(sources), np.concatenate(targets)))
            self.repairs += sum(s.size for s in sources)

    def repair_blocks(self, host_k: torch.Tensor, host_v: torch.Tensor, capacity: int, rows: np.ndarray, limit: int):
        """Refill cached blocks whose copies are stale (buffer ``rows``), from the host tier (counted)."""
        assert self.cache is not None
        by_row = {row: block for block, row in self.cache.rows.items()}
        fill = self.block_fill([by_row[int(r)] for r in np.unique(rows)], capacity, limit)
        self.copy_rows(host_k, host_v, fill)
        self.repairs += fill.source.size

    def copy_rows(self, host_k: torch.Tensor, host_v: torch.Tensor, fill: Fill) -> None:
        """Host rows into the arena, now (the compute stream waits for the copy)."""
        if not fill.source.size:
            return
        self.wait_side()
        source = torch.from_numpy(fill.source)
        target = torch.from_numpy(fill.target).to(self.device)
        for host, arena in ((host_k, self.k), (host_v, self.v)):
            arena.index_copy_(0, target, host.index_select(0, source).to(self.device))

    def gather(
        self,
        host_k: torch.Tensor,
        host_v: torch.Tensor,
        index: np.ndarray,
        misses: np.ndarray,
        fill: Fill,
        shape: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[rows, m, d]``: arena rows ``index`` (``[rows * m]``), the misses' rows placed from
        :attr:`miss_at` on first (host rows ``misses``, copied once each), then ``fill`` (block fills,
        after this gather's reads). ``host_k``/``host_v``: the host tier as ``[heads * capacity, d]``."""
        if misses.size > self.spare:
            self.resize(self.sink, self.window, max(misses.size, 2 * self.spare))
        rows = slice(self.miss_at, self.miss_at + misses.size)
        self.rows_fetched += int(misses.size)
        self.rows_filled += int(fill.source.size)
        if not self.cuda:  # one memory: the misses land in the arena, the same code runs in order
            take = torch.from_numpy(misses)
            torch.index_select(host_k, 0, take, out=self.k[rows])
            torch.index_select(host_v, 0, take, out=self.v[rows])
            self.last_staging = self.k[rows]
            index_t = torch.from_numpy(index)
            k, v = self.k.index_select(0, index_t), self.v.index_select(0, index_t)
            if fill.source.size:
                source, target = torch.from_numpy(fill.source), torch.from_numpy(fill.target)
                self.k.index_copy_(0, target, host_k.index_select(0, source))
                self.v.index_copy_(0, target, host_v.index_select(0, source))
            return k.view(*shape, -1), v.view(*shape, -1)
        return self._gather_cuda(host_k, host_v, index, misses, fill, rows, shape)

    def _gather_cuda(self, host_k, host_v, index, misses, fill, rows, shape):
        """:meth:`gather` on CUDA: host-side gathers into pinned memory, copies on the side stream."""
        compute = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        ints = np.concatenate([index, fill.target]).astype(np.int64, copy=False)
        ints_pinned = torch.empty(ints.size, dtype=torch.long, pin_memory=True)
        ints_pinned.copy_(torch.from_numpy(ints))
        staged = [_pinned_rows(host, misses) for host in (host_k, host_v)]
        filled = [_pinned_rows(host, fill.source) for host in (host_k, host_v)] if fill.source.size else None
        self.last_staging = staged[0]
        side.wait_stream(compute)  # (the previous reads of the miss region are done)
        with torch.cuda.stream(side):
            ints_dev = ints_pinned.to(self.device, non_blocking=True)
            for arena, rows_host in zip((self.k, self.v), staged):
                arena[rows].copy_(rows_host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        ints_dev.record_stream(compute)
        compute.wait_event(ready)
        index_t = ints_dev[: index.size]
        k, v = self.k.index_select(0, index_t), self.v.index_select(0, index_t)
        if filled is not None:  # after this gather's reads of the cache region
            read = torch.cuda.Event()
            read.record(compute)
            side.wait_event(read)
            with torch.cuda.stream(side):
                target = ints_dev[index.size :]
                for arena, rows_host in zip((self.k, self.v), filled):
                    arena.index_copy_(0, target, rows_host.to(self.device, non_blocking=True))
                done = torch.cuda.Event()
                done.record(side)
            self._event = done
        else:
            self._event = ready
        return k.view(*shape, -1), v.view(*shape, -1)

    def wait_side(self) -> None:
        """The compute stream waits for this arena's copies in flight (before it writes or reallocates it)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    # ------------------------------------------------------------------ rollback
    def snapshot(self) -> TierSnapshot:
        end = self.cache_at
        return TierSnapshot(
            self.heads,
            self.sink,
            self.window,
            self.k[:end].clone(),
            self.v[:end].clone(),
            self.sink_held.copy(),
            self.ring_slot.copy(),
        )

    def restore(self, snap: TierSnapshot | None, n: int, rewritten: bool) -> None:
        """Back to ``snap`` (device copies of the sink and window regions, laid into this tier's layout: its
        window may have grown since) for a layer of ``n`` slots; ``rewritten``: the host tier was
        rewritten in place since, so the cached blocks' copies are stale."""
        self.wait_side()
        self.sink_held[:] = False
        self.ring_slot[:] = -1
        if snap is not None and snap.heads == self.heads:
            self.resize(snap.sink, snap.window)
            for saved, arena in ((snap.k, self.k), (snap.v, self.v)):
                self.sink_view(arena)[:, : snap.sink].copy_(self._regions(saved, snap.sink, snap.window)[0])
            self.sink_held[: snap.sink] = snap.sink_held
            ring_k, ring_v = (self._regions(saved, snap.sink, snap.window)[1] for saved in (snap.k, snap.v))
            self._lay_ring(ring_k, ring_v, snap.ring_slot)
        self.sink_held[n:] = False
        self.ring_slot[self.ring_slot >= n] = -1
        if rewritten:
            self.filled[:] = False


def _pinned_rows(host: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """Rows of a pinned host tensor gathered into pinned memory (a plain index_select would return pageable
    memory, whose copy to the GPU is staged and synchronous)."""
    out = torch.empty((rows.size, host.shape[1]), dtype=host.dtype, pin_memory=True)
    return torch.index_select(host, 0, torch.from_numpy(rows), out=out)
