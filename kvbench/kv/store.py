"""Where K/V live during a run, and what moving them costs.

One :class:`LayerKV` per transformer layer holds that layer's keys and values (batch size 1) as
``[kv_heads, slots, head_dim]`` with the absolute position of every slot. Two memory regimes, chosen by
a method's ``offload`` parameter (``KVStore(offload=...)``):

* **device-resident** (``offload: false``; the default of the latency benches, what the papers' latency
  runs use, and always ``full``, the eviction methods and ``oracle``): every token's K/V live on the
  compute device, written in place and read where they are. Nothing crosses the host→device link
  during decode and no byte is counted.
* **offload** (``offload: true``, its own experiment): every token's K/V live in the *host tier* (CPU
  memory, pinned on CUDA); the compute device keeps a :class:`~kvbench.kv.device_tier.DeviceTier` per
  layer with the *resident* rows — the sink tokens and a window holding the local window and the tokens
  generated since (the current token's K/V are written there by the step that computed them) — and,
  with a :class:`~kvbench.kv.block_cache.BlockCache`, the K/V of the blocks it holds. A decode step's
  :meth:`LayerKV.gather` reads the selection on the host once (the layer's one sync), takes resident rows
  and cache hits on the device, and fetches only the *misses* from the host tier: gathered into pinned
  memory and copied asynchronously on a side stream that the compute stream waits for. The blocks the
  cache admits are filled the same way after the step's reads.

What crosses the link in offload mode, and is counted (:class:`TransferStats`): the misses' K/V
(``bytes_h2d_fetch``: each distinct (KV head, slot) once, however many query heads read it), the block
fills (``bytes_h2d_cache_fill``: whole blocks, every KV head), index data a method moves to score tokens
(``bytes_h2d_index``), and the prefill's and each new token's K/V going to the host tier (``bytes_d2h``).
Sinks and the window never cross. Not counted: the gather's index (8 bytes a selected entry) and the
rows of a method's own device cache (ClusterKV's ``cached`` slots: counted as hits, as its paper's
cluster cache serves them, but the store holds no copy of that cache, so they are fetched like misses).
A method's dense layers (``dense_layers``: Quest and ClusterKV keep layers 0-1 whole) stay
device-resident altogether (``KVStore(resident=...)``): they attend every token at every step. Whatever
attends a whole offloaded layer (a budget that covers it, a multi-token extension) reads it through
:meth:`LayerKV.held`, which counts the transfer like any fetch.

Methods never move bytes themselves: they ask :meth:`LayerKV.gather` for slots, and the store counts
every byte that crosses host→device and every cache hit. On a CPU-only machine both tiers are host
memory and the same code runs synchronously; the counts are still exact: they are what the same run
would move on a GPU.

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

import numpy as np
import torch

from kvbench.kv.block_cache import BlockCache
from kvbench.kv.device_tier import DeviceTier, Fill, TierSnapshot


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
        # offload: the device tier (sinks, window, block cache; made with the first write) and how often
        # the host tier was rewritten in place (a rollback across a rewrite refreshes the cached blocks)
        self.tier: DeviceTier | None = None
        self._rewrites = 0
        self._written: torch.cuda.Event | None = None  # the last asynchronous write into the pinned host tier
        #: slots below ``n`` no write has filled (a write beyond the held slots leaves the ones it skips);
        #: host ints, so the check costs no device read (see :meth:`check_written`)
        self._holes = np.zeros(0, dtype=np.int64)

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
            self._pos[:, self.n : self.n + t] = positions.to(self.home, non_blocking=True).view(1, t)
            if t:  # (positions a plan built on the host are read there; device ones are read back once)
                last = positions if positions.device.type == "cpu" else positions.cpu()
                self.seen = max(self.seen, int(last.max()) + 1)
        if self.offload:
            self.stats.bytes_d2h += t * self.n_kv_heads * self.token_bytes()
            self._device_tier().write(self.n, keys, values)
            self._mark_written()
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
            self._holes = np.concatenate([self._holes, np.arange(self.n, top, dtype=np.int64)])
            self.reserve(top - self.n)
            self.n = top
        if self._holes.size:
            self._holes = np.setdiff1d(self._holes, host.numpy())
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
            self._rewritten()

    def check_written(self, layer: int | None = None) -> None:
        """Refuse to be attended while a held slot was never written: its K/V would be the buffer's
        filler (zeros at position -1), attended as if it were a token. Raises ``RuntimeError`` naming the
        slots; reads nothing from the device."""
        if self._holes.size:
            where = f"layer {layer}" if layer is not None else "a layer"
            raise RuntimeError(
                f"{where} holds {self._holes.size} slot(s) never written (first: {self._holes[:5].tolist()}), "
                "which attention would read as tokens; every held slot must come from a cache or a computed row"
            )

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
        self._rewritten()
        self.tier = None  # (the stored rows per head may have changed: a new tier, refilled as it is read)

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
        self._rewritten()
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
            self._device_tier().write(slot, keys, values)  # (the window's copy: never read back from the host)
            self._mark_written()

    def bucket(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``[0, bucket_end)`` (views; slots from :attr:`length` on hold no token yet)."""
        return self._k[:, : self.bucket_end], self._v[:, : self.bucket_end]

    # ------------------------------------------------------------------ reads
    def set_residency(self, sink: int, recent: int) -> None:
        """Slots below ``sink`` and the last ``recent`` slots are device-resident (offload mode): the device
        tier makes room for them (its window grows when ``recent`` does, keeping the rows it holds)."""
        self.resident_sink = sink
        self.resident_recent = recent
        if self.tier is not None:
            self.tier.resize(sink, recent)

    def attach_cache(self, cache: BlockCache | None) -> None:
        """A block cache between the host tier and attention: its blocks' K/V live in the device tier."""
        self.cache = cache
        if self.tier is not None:
            self.tier.set_cache(cache)

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held K and V on the compute device: views of the home tier when it is the device, else
        a :meth:`gather` of every slot (counted: every non-resident, non-cached row crosses the link)."""
        if self.home == self.device:
            return self.keys, self.values
        return self.gather(torch.arange(self.n, device=self.home).expand(self._k.shape[0], -1))

    def gather(self, slots: torch.Tensor, cached: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` on the compute device, counting what crosses the host→device link.

        ``slots`` is ``[kv_heads, k]`` (one selection per KV head) or ``[q_heads, k]`` (one per query
        head; query head ``h`` reads KV head ``h // group``). ``cached`` (same shape, optional) flags
        slots a method keeps on the device itself (ClusterKV's cluster cache): they count as hits.

        An offloaded layer reads the selection on the host once, then takes the sinks and the window from
        the device tier, the block cache's hits from its device buffer, and only the other rows from the
        host tier (:meth:`_gather_offloaded`); the K/V returned are the same either way.
        """
        rows = slots.shape[0]
        if rows % self.n_kv_heads:
            raise ValueError(f"cannot map {rows} selection rows onto {self.n_kv_heads} KV heads")
        if self.offload:
            return self._gather_offloaded(slots, cached)
        group = rows // self.n_kv_heads
        home_slots = slots if slots.device == self.home else slots.to(self.home)
        # one row gather per tensor: row (head h, slot s) of the [kv_heads * capacity, d] view is
        # h * capacity + s (index_select copies whole rows, 3x faster than K[heads, slots] on a CPU)
        flat = (home_slots + self._row_base(rows, group, self.capacity)).view(-1)
        k = self._rows(self._k, flat).view(rows, -1, self.head_dim)
        v = self._rows(self._v, flat).view(rows, -1, self.head_dim)
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

    # ------------------------------------------------------------------ offload
    def _device_tier(self) -> DeviceTier:
        """The device tier of this offloaded layer (made on first use, sized for the resident ranges)."""
        if self.tier is None:
            self.tier = DeviceTier(self._k.shape[0], self.head_dim, self.dtype, self.device)
            if self.cache is not None:
                self.tier.set_cache(self.cache)
            self.tier.resize(self.resident_sink, self.resident_recent)
        return self.tier

    def _mark_written(self) -> None:
        """On CUDA, remember the last asynchronous device→host write (a host-side read of the host tier that
        no device read preceded waits for it)."""
        if self._pin and torch.cuda.is_available():
            self._written = torch.cuda.Event()
            self._written.record()

    def _rewritten(self) -> None:
        """The host tier changed in place (not an append): the device tier's copies are stale."""
        if not self.offload:
            return
        self._rewrites += 1
        if self.tier is not None:
            self.tier.reset()

    def _read_selection(self, slots: torch.Tensor, cached: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The selection (and the method's cached flags) on the host: one read, the step's only sync in
        this layer (stacked first, so that the flags come with it)."""
        both = slots if cached is None else torch.stack((slots, cached.to(slots.device, slots.dtype)))
        if both.device.type == "cpu":
            if self._written is not None:  # (a selection made on the host: no device read waited for the writes)
                self._written.synchronize()
            host = both.numpy()  # (on a CPU run, the read a GPU run does here)
        else:
            host = np.from_dlpack(both.cpu())  # the read; from_dlpack views the host copy
        self._written = None
        host = host.astype(np.int64, copy=False)
        if cached is None:
            return host, None
        return host[0], host[1] != 0

    def _gather_offloaded(self, slots: torch.Tensor, cached: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather` of an offloaded layer, planned on the host from one read of the selection.

        Each entry (row ``i``, slot ``s``; KV head ``h = i // group``) is read from: the device tier's sinks
        (``s`` below the resident sink) or window (``s`` in the last ``resident_recent`` slots); the block
        cache's buffer (a middle slot whose block was resident before this step, not flagged ``cached``);
        else the host tier, each distinct (KV head, slot) once — the misses, plus ClusterKV's ``cached``
        rows (its cluster cache is the method's, not the store's: they cross, counted as hits as before).
        The blocks the cache admits this step are filled after the step's reads. The counts are those
        of :meth:`_account_offloaded`."""
        rows, width = slots.shape
        group = rows // self.n_kv_heads
        sel, flags = self._read_selection(slots, cached)
        tier = self._device_tier()
        n, capacity = self.n, self.capacity
        low = min(self.resident_sink, n)  # resident: slots below low and from high on
        high = max(low, n - self.resident_recent)
        head = np.broadcast_to((np.arange(rows, dtype=np.int64) // group)[:, None], sel.shape)
        sink = (sel >= 0) & (sel < low)
        ring = (sel >= high) & (sel < n)
        middle = (sel >= low) & (sel < high)
        if flags is not None:
            middle &= ~flags
        host_k = self._k.view(-1, self.head_dim)
        host_v = self._v.view(-1, self.head_dim)
        hit = np.zeros(sel.shape, dtype=bool)
        buffer_row = hit.astype(np.int64)  # (the buffer row of each entry's block, where hit)
        cache = self.cache
        if cache is not None and cache.rows and middle.any():
            buffer_row = cache.rows_of((sel - cache.offset) // cache.block_size)
            hit = middle & (buffer_row >= 0)
            stale = buffer_row[hit]
            stale = stale[~tier.filled[stale]]
            if stale.size:
                tier.repair_blocks(host_k, host_v, capacity, stale, n)
        missing_sinks, missing_ring = tier.missing_resident(sel[sink], sel[ring])
        if missing_sinks.size or missing_ring.size:
            tier.repair(host_k, host_v, capacity, missing_sinks, missing_ring)
        admitted = self._account_offloaded(sel, flags, head, low, high)  # (updates the block cache)
        index = np.empty(sel.shape, dtype=np.int64)
        index[sink] = tier.sink_rows(head[sink], sel[sink])
        index[ring] = tier.ring_rows(head[ring], sel[ring])
        if hit.any():
            index[hit] = tier.cache_rows(head[hit], sel[hit], buffer_row[hit])
        fetched = ~(sink | ring | hit)
        misses, inverse = np.unique(head[fetched] * capacity + sel[fetched], return_inverse=True)
        index[fetched] = tier.miss_at + inverse.reshape(-1)
        fill = tier.block_fill(admitted, capacity, n) if admitted else Fill(misses[:0], misses[:0])
        return tier.gather(host_k, host_v, index.reshape(-1), misses, fill, (rows, width))

    def _account_offloaded(
        self, sel: np.ndarray, flags: np.ndarray | None, head: np.ndarray, low: int, high: int
    ) -> list[int]:
        """Count bytes for the non-resident (kv head, slot) pairs of a selection (host arrays); several
        query heads share a fetch. Returns the blocks the block cache admitted (to fill)."""
        size = self.n_kv_heads * self.n
        pairs = head * self.n + sel  # (kv head, slot) as h * n + s

        def distinct(where: np.ndarray | None) -> np.ndarray:
            """``[kv_heads, high - low]`` bool: the middle pairs asked for (those flagged by ``where``)."""
            mask = np.zeros(size + 1, dtype=bool)
            mask[(pairs if where is None else np.where(where, pairs, size)).reshape(-1)] = True
            return mask[:size].reshape(self.n_kv_heads, self.n)[:, low:high]

        if flags is not None:
            held = int(distinct(flags).sum())
            self.stats.cache_lookups += held
            self.stats.cache_hits += held
            middle = distinct(~flags)
        else:
            middle = distinct(None)
        if self.cache is None:
            wanted = int(middle.sum())
            self.stats.cache_lookups += wanted
            self.stats.bytes_h2d_fetch += wanted * self.token_bytes()
            return []
        slot = np.nonzero(middle)[1] + low  # every wanted (kv head, slot) pair, by head then slot
        wanted = int(slot.size)
        if wanted == 0:
            return []
        self.stats.cache_lookups += wanted
        hits, admitted = self.cache.serve_array((slot - self.cache.offset) // self.cache.block_size)
        self.stats.cache_hits += hits
        self.stats.bytes_h2d_fetch += (wanted - hits) * self.token_bytes()
        self.stats.bytes_h2d_cache_fill += len(admitted) * self.cache.block_size * self.n_kv_heads * self.token_bytes()
        return admitted

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
            tier=None if self.tier is None else self.tier.snapshot(),
            rewrites=self._rewrites,
        )

    def restore(self, snap: LayerSnapshot) -> None:
        """Hold exactly what :meth:`snapshot` copied (bit for bit), whatever happened since.

        Not rolled back: the transfer counters (the bytes a question and its answer moved were moved)
        and the block cache, a device cache that stays warm across questions; its blocks from slot
        ``snap.n`` on are forgotten, since those slots will hold other tokens. The device tier's sink and
        window copies come back from the snapshot's device copy (offload)."""
        if self.capacity < snap.n:
            self._k = self._alloc(snap.n, self.head_dim, self.dtype)
            self._v = self._alloc(snap.n, self.head_dim, self.dtype)
            self._pos = self._alloc(snap.n, None, torch.long)
        self._k[:, : snap.n].copy_(snap.keys)
        self._v[:, : snap.n].copy_(snap.values)
        self._pos[:, : snap.n].copy_(snap.positions)
        self.n, self.seen = snap.n, snap.seen
        self._holes = self._holes[self._holes < snap.n]
        self.resident_sink, self.resident_recent = snap.resident_sink, snap.resident_recent
        if self.cache is not None:
            self.cache.forget_from(snap.n)
        if self.tier is not None:  # its sink and window copies as they were; cached blocks kept (all below n)
            self.tier.restore(snap.tier, snap.n, rewritten=self._rewrites != snap.rewrites)
            self.tier.resize(self.resident_sink, self.resident_recent)


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
    tier: TierSnapshot | None = None  # the device tier's sink and window copies (offload)
    rewrites: int = 0  # the layer's in-place rewrites of its host tier so far


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

    def check_written(self) -> None:
        """:meth:`LayerKV.check_written` for every layer."""
        for index, layer in enumerate(self.layers):
            layer.check_written(index)

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
