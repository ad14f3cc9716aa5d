"""A store of precomputed chunk KV caches that outlives one generation (CacheBlend §6, its "KV store").

Reuse methods take most of a prompt's K/V from caches computed earlier: each document chunk prefilled
alone (CacheBlend, full KV reuse), or an exact token prefix (prefix caching). This store keeps them
between requests and runs, in two tiers with a byte capacity each and least-recently-used eviction
(or, with :attr:`ChunkStore.priority` set, the lowest-scored entry first):

* ``ram`` — tensors in host memory, also on a GPU machine (the tier above the device): an entry put
  in RAM is copied to the host, into one pinned buffer when CUDA is available, so a load from RAM is
  a real host → device copy, asynchronous from pinned memory (:class:`~kvbench.engine.reuse.LayerLoader`
  issues it on its worker's CUDA stream, as it does a disk read's); on a CPU-only machine the tensors
  are used as they are;
* ``disk`` — one safetensors file per entry under ``$KVBENCH_HOME/chunk_kv/<model>/`` (or
  ``store.dir``), tensors per layer (``k.<layer>``, ``v.<layer>``) so a layer can be read alone.

An entry is keyed by the model (name, architecture hash, dtype), the chunk's token ids, and *how* it
was prefilled (``mode``): ``alone`` (the chunk by itself at positions 0..n-1), ``bos`` (after the
tokenizer's BOS, at positions 1..n, as CacheBlend's scripts do) or ``prefix`` (an exact prompt prefix
at its real positions). Keys are stored post-RoPE at those positions (:attr:`ChunkKV.start` is the
first one); a reuse method re-rotates them to where the chunk sits in the new prompt
(:func:`kvbench.engine.rope.rerotate`).

Every read is accounted per tier: hits, misses, bytes and the measured load time. ``store.tier``
picks where entries are served from (``ram``: kept in RAM; ``disk``: written to disk only, every load
reads the file). With ``store.tier=ram``, an entry found only in the disk folder is first copied into
RAM (:meth:`ChunkStore.promote`, before the request's clock, counted as ``ram_promoted``), as a tiered
store moves a hot entry up; so RAM runs reuse what disk runs computed, and are still served from RAM.
Disk reads drop the file from the OS page cache first (``posix_fadvise`` ``DONTNEED``,
``store.cold_reads``), so a disk load really reads the disk instead of the page cache.

**Throttled disk (an emulation).** ``store.read_mbps`` emulates a slower SSD or an HDD (CacheBlend
Fig. 17's "slower disks"): each layer read is padded with sleep until it has taken
``bytes / read_mbps``. The bytes really come from this machine's disk; only the extra delay is made
up, and the run records ``read_mbps`` with the store's figures. A sleep costs no CPU, so a throttled
load overlaps with compute as well as a slow device's DMA would.

**Reading without the GIL.** Disk entries are safetensors files, read here tensor by tensor with
``os.preadv`` into a preallocated buffer (the header is parsed by :class:`TensorFile`): CPython
releases the GIL during the system call, so a loader thread reading layer ``i + 1`` really runs while
the main thread computes layer ``i`` (``store.pipeline``, see :mod:`kvbench.engine.reuse`). The
``safetensors`` library's reader holds the GIL while it copies from its memory map, which would
serialise the two. On CUDA the buffers are pinned, so the copy to the device can be asynchronous
(the RAM tier's entries are pinned too, so both tiers load alike).

**Tier throughput.** :func:`measure_tiers` measures what each tier delivers on this machine — RAM:
a copy of a layer's K/V into fresh memory (on a GPU, host → device from pinned memory, what a load
from the RAM tier really does); disk: a cold read of a model-shaped entry, throttled when
``read_mbps`` is set — the input of CacheBlend's loading controller
(:mod:`kvbench.methods.cacheblend`) and of ``kvbench bench chunk_load``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param

if TYPE_CHECKING:  # the module itself needs no torch: the CLI checks store.* before importing it
    import torch

TIERS = ("ram", "disk")


@dataclass(frozen=True)
class ChunkKey:
    """Identity of a cached chunk: model, token ids and how it was prefilled."""

    model: str
    ids: tuple[int, ...]
    mode: str  # alone | bos | prefix

    @property
    def digest(self) -> str:
        blob = json.dumps([self.model, self.mode, list(self.ids)]).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


@dataclass
class ChunkKV:
    """Per-layer K (post-RoPE at positions ``start..start+n-1``) and V of one chunk.

    ``keys[layer]`` / ``values[layer]`` are ``[kv_heads, n, head_dim]``.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    start: int

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def n_tokens(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def on_host(self, *, pin: bool) -> ChunkKV:
        """This entry in host memory (the RAM tier's form): itself when every tensor is already on the
        host (and pinned, with ``pin``), else a copy whose tensors are views into one host buffer (pinned
        with ``pin``: one allocation per entry, not one rounded-up pinned block per tensor)."""
        import torch

        tensors = [*self.keys, *self.values]
        if all(t.device.type == "cpu" and (t.is_pinned() or not pin) for t in tensors):
            return self
        buffer = torch.empty(self.nbytes(), dtype=torch.uint8, pin_memory=pin)
        copies, offset = [], 0
        for t in tensors:
            size = t.numel() * t.element_size()  # (every offset is a multiple of the element size)
            copy = buffer[offset : offset + size].view(t.dtype).view(t.shape)
            copy.copy_(t)
            copies.append(copy)
            offset += size
        half = len(self.keys)
        return ChunkKV(copies[:half], copies[half:], self.start)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    evictions: int = 0
    bytes_written: int = 0
    promoted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class StoreConfig(Params):
    """The ``store.*`` config keys (their defaults in ``conf/config.yaml``; ``pipeline`` is not there, so
    that it names no run)."""

    tier: Literal["ram", "disk"] = param("ram", "where chunk caches are served from: ram | disk")
    ram_gb: float = param(2.0, "RAM tier capacity in GB (least recently used entries are evicted)", min=0)
    disk_gb: float = param(10.0, "disk tier capacity in GB", min=0)
    dir: str | None = param(None, "disk tier folder (null: $KVBENCH_HOME/chunk_kv)")
    read_mbps: float | None = param(None, "throttle disk reads to this many MB/s (null: no throttle)")
    cold_reads: bool = param(True, "drop a file from the OS page cache before reading it (real disk reads)")
    pipeline: bool = param(True, "load layer i+1's chunk caches on a worker while layer i computes")

    def __post_init__(self) -> None:  # (also when built directly, not through parse)
        self.validate()

    def validate(self) -> None:
        if self.tier not in TIERS:
            raise ConfigError(
                f"store.tier={self.tier!r} is not one of {', '.join(TIERS)}", "use store.tier=ram or store.tier=disk"
            )
        for key in ("ram_gb", "disk_gb"):
            if float(getattr(self, key)) < 0:
                raise ConfigError(f"store.{key}={getattr(self, key)} is negative", f"set store.{key} to a size in GB")
        if self.read_mbps is not None and (isinstance(self.read_mbps, bool) or float(self.read_mbps) <= 0):
            raise ConfigError(
                f"store.read_mbps={self.read_mbps} must be positive",
                "e.g. store.read_mbps=500, or null for no throttle",
            )
        for key in ("cold_reads", "pipeline"):  # (parse checks types; a direct construction does not)
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"store.{key}={getattr(self, key)!r} must be true or false", f"use store.{key}=true or false"
                )

    @classmethod
    def from_mapping(cls, cfg: Any) -> StoreConfig:
        """The ``store`` node, parsed and checked (an unknown key, a wrong type or range: one line)."""
        from kvbench.params import parse

        return parse(cls, dict(cfg or {}), owner="store", prefix="store.")  # type: ignore[return-value]


class ChunkStore:
    """Two LRU tiers of :class:`ChunkKV` entries with byte capacities and per-tier accounting."""

    def __init__(self, config: StoreConfig | None = None) -> None:
        self.config = config or StoreConfig()
        self.ram_capacity = int(float(self.config.ram_gb) * 2**30)
        self.disk_capacity = int(float(self.config.disk_gb) * 2**30)
        self._ram: OrderedDict[ChunkKey, ChunkKV] = OrderedDict()
        self._ram_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # digest -> file bytes, LRU order
        self._disk_bytes = 0
        self._disk_scanned: set[Path] = set()
        self.stats = {tier: TierStats() for tier in TIERS}
        self.precompute_s = 0.0
        self.precomputed = 0
        #: eviction order: ``None`` evicts the least recently used entry; a function of an entry's digest
        #: evicts the entry it scores lowest, the least recently used among equal scores (a reuse method
        #: sets it for its requests, e.g. Cache-Craft's expected frequency x saving per byte)
        self.priority: Callable[[str], float] | None = None

    def _victim(self, digests: Iterable[str]) -> int:
        """Which of ``digests`` (least recently used first) to evict: its index."""
        if self.priority is None:
            return 0
        scores = [self.priority(digest) for digest in digests]
        return scores.index(min(scores))

    # ------------------------------------------------------------------ disk layout
    def folder(self, model: str) -> Path:
        from kvbench.assets import kvbench_home

        root = Path(self.config.dir).expanduser() if self.config.dir else kvbench_home() / "chunk_kv"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
        folder = root / safe
        if folder not in self._disk_scanned:
            folder.mkdir(parents=True, exist_ok=True)
            files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
            for path in files:
                if path.stem not in self._disk:
                    size = path.stat().st_size
                    self._disk[path.stem] = size
                    self._disk_bytes += size
            self._disk_scanned.add(folder)
        return folder

    def _path(self, key: ChunkKey) -> Path:
        return self.folder(key.model) / f"{key.digest}.safetensors"

    # ------------------------------------------------------------------ lookups
    def contains(self, key: ChunkKey) -> str | None:
        """The tier that holds ``key`` (``ram`` first), or ``None``; no accounting."""
        if key in self._ram:
            return "ram"
        if self.disk_capacity and self._path(key).exists():
            return "disk"
        return None

    def touch(self, key: ChunkKey) -> str | None:
        """Mark ``key`` most recently used in the tier that holds it and return that tier (``None``: not
        held); no accounting. A request touches every cache it will read before it computes any it
        lacks, so that storing those cannot evict the ones it is about to use."""
        tier = self.contains(key)
        if tier == "ram":
            self._ram.move_to_end(key)
        elif tier == "disk" and key.digest in self._disk:
            self._disk.move_to_end(key.digest)
        return tier

    def open(self, key: ChunkKey) -> ChunkReader | None:
        """A reader of the entry (a hit in the tier that holds it), or ``None`` (a miss)."""
        tier = self.contains(key)
        if tier is None:
            self.stats[self.config.tier].misses += 1
            return None
        self.stats[tier].hits += 1
        if tier == "ram":
            self._ram.move_to_end(key)
            entry = self._ram[key]
            return ChunkReader(self, tier, entry.start, entry.n_tokens, entry.n_layers, entry=entry)
        path = self._path(key)
        if key.digest in self._disk:
            self._disk.move_to_end(key.digest)
        started = time.perf_counter()
        self._drop_page_cache(path)
        handle = TensorFile(path)
        self.stats[tier].load_s += time.perf_counter() - started
        meta = handle.metadata
        return ChunkReader(self, tier, int(meta["start"]), int(meta["tokens"]), int(meta["layers"]), file=handle)

    def promote(self, key: ChunkKey) -> bool:
        """``store.tier=ram``: copy an entry that only the disk folder holds into RAM (not a measured load:
        called before the request's clock); True when it did."""
        if self.config.tier != "ram" or key in self._ram or not self.disk_capacity:
            return False
        path = self._path(key)
        if not path.exists():
            return False
        handle = TensorFile(path)
        try:
            layers = int(handle.metadata["layers"])
            entry = ChunkKV(
                [handle.read(f"k.{i}") for i in range(layers)],
                [handle.read(f"v.{i}") for i in range(layers)],
                int(handle.metadata["start"]),
            )
        finally:
            handle.close()
        self._put_ram(key, entry)
        self.stats["ram"].promoted += 1
        return key in self._ram

    def get(self, key: ChunkKey) -> ChunkKV | None:
        """The whole entry, loaded from the tier that holds it (timed and counted); ``None`` on a miss."""
        reader = self.open(key)
        if reader is None:
            return None
        with reader:
            layers = [reader.layer(i) for i in range(reader.layers)]
        return ChunkKV([k for k, _ in layers], [v for _, v in layers], reader.start)

    # ------------------------------------------------------------------ writes
    def put(self, key: ChunkKey, entry: ChunkKV) -> None:
        """Store ``entry`` in the configured tier (``ram``: RAM; ``disk``: a file), evicting LRU entries."""
        if self.config.tier == "ram":
            self._put_ram(key, entry)
        else:
            self._put_disk(key, entry)

    def _put_ram(self, key: ChunkKey, entry: ChunkKV) -> None:
        size = entry.nbytes()
        if size > self.ram_capacity:
            return
        entry = entry.on_host(pin=_pin_host())  # a RAM entry is host memory, wherever the model runs
        if key in self._ram:
            self._ram_bytes -= self._ram.pop(key).nbytes()
        while self._ram and self._ram_bytes + size > self.ram_capacity:
            victim = list(self._ram)[self._victim(k.digest for k in self._ram)]
            old = self._ram.pop(victim)
            self._ram_bytes -= old.nbytes()
            self.stats["ram"].evictions += 1
        self._ram[key] = entry
        self._ram_bytes += size
        self.stats["ram"].bytes_written += size

    def _put_disk(self, key: ChunkKey, entry: ChunkKV) -> None:
        from safetensors.torch import save_file

        path = self._path(key)
        tensors = {f"k.{i}": k.contiguous() for i, k in enumerate(entry.keys)}
        tensors.update({f"v.{i}": v.contiguous() for i, v in enumerate(entry.values)})
        if len({t.untyped_storage().data_ptr() for t in tensors.values()}) < len(tensors):
            # views into one buffer (an entry taken from the RAM tier): safetensors refuses shared storage
            tensors = {name: t.clone() for name, t in tensors.items()}
        metadata = {
            "layers": str(entry.n_layers),
            "start": str(entry.start),
            "model": key.model,
            "mode": key.mode,
            "tokens": str(entry.n_tokens),
        }
        # a name of this process and thread: runs sharing a store folder may write the same chunk at once;
        # each writes its own file and the last rename wins (the contents are identical)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        save_file(tensors, str(tmp), metadata=metadata)
        fd = os.open(tmp, os.O_RDONLY)
        try:  # on the disk before any read: a cold read can then drop every page of it
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        size = path.stat().st_size
        if key.digest in self._disk:
            self._disk_bytes -= self._disk.pop(key.digest)
        self._disk[key.digest] = size
        self._disk_bytes += size
        self.stats["disk"].bytes_written += size
        folder = path.parent
        while self._disk_bytes > self.disk_capacity and len(self._disk) > 1:
            held = [d for d in self._disk if d != key.digest]  # (never the entry just written)
            digest = held[self._victim(held)]
            old = self._disk.pop(digest)
            (folder / f"{digest}.safetensors").unlink(missing_ok=True)
            self._disk_bytes -= old
            self.stats["disk"].evictions += 1

    def _drop_page_cache(self, path: Path) -> None:
        if not self.config.cold_reads or not hasattr(os, "posix_fadvise"):
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def _throttle(self, nbytes: int, spent: float) -> None:
        if not self.config.read_mbps:
            return
        wanted = nbytes / (float(self.config.read_mbps) * 1e6)
        if wanted > spent:
            time.sleep(wanted - spent)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """The store's configuration and cumulative per-tier figures (``<tier>_mbps``: the measured
        throughput of the loads so far, bytes over load time)."""
        rates = {
            f"{tier}_mbps": (self.stats[tier].bytes_loaded / self.stats[tier].load_s / 1e6)
            if self.stats[tier].load_s > 0
            else None
            for tier in TIERS
        }
        return {
            "tier": self.config.tier,
            "read_mbps": self.config.read_mbps,
            "cold_reads": self.config.cold_reads,
            "pipeline": self.config.pipeline,
            "precompute_s": self.precompute_s,
            "precomputed": self.precomputed,
            **rates,
            "ram_bytes": self._ram_bytes,
            "disk_bytes": self._disk_bytes,
            **{f"{tier}_{k}": v for tier in TIERS for k, v in self.stats[tier].to_dict().items()},
        }

    def restart_stats(self) -> None:
        """Zero the per-tier figures and the precompute counters, keeping every entry: a store handed to
        the next run of a sweep (:meth:`kvbench.shared.Sweep.chunk_store`) then reports that run's figures
        alone."""
        self.stats = {tier: TierStats() for tier in TIERS}
        self.precompute_s = 0.0
        self.precomputed = 0


def _pin_host() -> bool:
    """Whether host-tier tensors are pinned (CUDA available: a copy from them to a GPU can be asynchronous)."""
    import torch

    return torch.cuda.is_available()


def model_fingerprint(loaded: Any) -> str:
    """A stable name for a loaded model's K/V: its config name, a hash of its architecture, its dtype."""
    config = loaded.model.config.to_dict()
    keep = {
        k: config.get(k)
        for k in sorted(config)
        if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
    }
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    first = next(loaded.model.parameters()).detach().float().flatten()[:4096].cpu().numpy().tobytes()
    weights = hashlib.sha256(first).hexdigest()[:8]  # tells seeds of a random-weight model apart
    return f"{loaded.spec.name}-{digest}-{dtype}-{weights}"


class ChunkReader:
    """One entry opened for reading: :attr:`start`, :attr:`tokens`, and its (K, V) layer by layer.

    :meth:`layer` reads one layer when asked for it (from RAM: the stored host tensors, pinned where
    CUDA is available; from disk: that layer's two tensors of the open file), so a prefill plan reads
    layer ``i`` just before layer ``i`` runs and a pipelined loader can read layer ``i + 1`` on a worker
    thread while layer ``i`` computes (one reader is read by one thread at a time). Bytes and load time
    are added to the tier's statistics as layers are read. Close the reader when done (or use ``with``).
    """

    def __init__(
        self,
        store: ChunkStore,
        tier: str,
        start: int,
        tokens: int,
        layers: int,
        *,
        entry: ChunkKV | None = None,
        file: TensorFile | None = None,
    ) -> None:
        self.store = store
        self.tier = tier
        self.start = start
        self.tokens = tokens
        self.layers = layers
        self._entry = entry
        self._file = file

    def layer(self, index: int, *, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of layer ``index``, each ``[kv_heads, tokens, head_dim]`` (``pin``: disk reads land in
        pinned memory, for an asynchronous copy to a GPU)."""
        stats = self.store.stats[self.tier]
        if self._entry is not None:
            k, v = self._entry.keys[index], self._entry.values[index]
            stats.bytes_loaded += 2 * k.numel() * k.element_size()
            return k, v
        assert self._file is not None, "the reader was closed"
        started = time.perf_counter()
        k = self._file.read(f"k.{index}", pin=pin)
        v = self._file.read(f"v.{index}", pin=pin)
        nbytes = 2 * k.numel() * k.element_size()
        self.store._throttle(nbytes, time.perf_counter() - started)
        stats.bytes_loaded += nbytes
        stats.load_s += time.perf_counter() - started
        return k, v

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: safetensors dtype names → torch dtypes (the ones a K/V cache can have)
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


class TensorFile:
    """A safetensors file opened for reading one tensor at a time with ``os.preadv`` (no GIL held while
    the disk works; see the module docs).

    The format: 8 bytes little-endian header length, a JSON header mapping each tensor name to its
    ``dtype``, ``shape`` and ``data_offsets`` (relative to the end of the header) plus
    ``__metadata__``, then the data.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = int.from_bytes(self._pread(8, 0), "little")
            header = json.loads(self._pread(size, 8))
        except Exception:
            os.close(self._fd)
            raise
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self.entries: dict[str, dict[str, Any]] = header
        self._base = 8 + size

    def _pread(self, size: int, offset: int) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise OSError(f"{self.path}: truncated safetensors file")
        return data

    def read(self, name: str, *, pin: bool = False) -> torch.Tensor:
        import torch

        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        buffer = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pin)
        # numpy's stubs declare ndarray's buffer protocol (__buffer__) only for Python >= 3.12
        view = memoryview(buffer.numpy())  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], self._base + begin + done)
            if got <= 0:
                raise OSError(f"{self.path}: truncated safetensors file ({name})")
            done += got
        dtype = getattr(torch, _DTYPES[entry["dtype"]])
        return buffer.view(dtype).view(entry["shape"])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


def measure_tiers(
    config: StoreConfig,
    *,
    kv_heads: int,
    tokens: int,
    head_dim: int,
    layers: int = 4,
    dtype: Any = None,
    device: Any = "cpu",
    repeats: int = 3,
) -> dict[str, dict[str, float]]:
    """What each tier delivers on this machine, for one chunk shaped like a model's (``layers`` layers of
    ``[kv_heads, tokens, head_dim]`` K and V): per tier, ``mbps`` (bytes loaded per second, the best of
    ``repeats`` passes) and ``layer_s`` (seconds to load one layer of this chunk at that rate).

    * ``ram`` — the stored tensors copied into fresh memory on ``device`` (on a GPU: host → device,
      asynchronous from pinned memory, as the RAM tier holds its entries and the loader copies them):
      what installing a RAM-tier chunk costs beyond the lookup;
    * ``disk`` — a cold read (page cache dropped, as ``store.cold_reads``) of a file written under the
      store's disk folder, throttled to ``read_mbps`` when that is set (the emulated slower device).
    """
    import torch

    dtype = dtype or torch.float32
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    shape = (kv_heads, tokens, head_dim)
    keys = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers)]
    values = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers)]
    if device.type == "cuda":
        keys, values = [k.pin_memory() for k in keys], [v.pin_memory() for v in values]
    layer_bytes = 2 * keys[0].numel() * keys[0].element_size()
    out: dict[str, dict[str, float]] = {}

    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for k, v in zip(keys, values):
            k.to(device, copy=True, non_blocking=True)
            v.to(device, copy=True, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    out["ram"] = _rate(layer_bytes, layers, best)

    from kvbench.assets import kvbench_home

    root = Path(config.dir).expanduser() if config.dir else kvbench_home() / "chunk_kv"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=root) as folder:
        probe = ChunkStore(
            StoreConfig(
                tier="disk",
                dir=folder,
                disk_gb=max(1.0, 4 * layers * layer_bytes / 2**30),
                read_mbps=config.read_mbps,
                cold_reads=True,
            )
        )
        key = ChunkKey("probe", (0,), "alone")
        probe.put(key, ChunkKV(keys, values, 0))
        best = float("inf")
        for _ in range(repeats):
            reader = probe.open(key)  # drops the page cache, reads the header: per entry, not per layer
            assert reader is not None
            with reader:
                started = time.perf_counter()
                for layer in range(layers):
                    reader.layer(layer)
                best = min(best, time.perf_counter() - started)
    out["disk"] = _rate(layer_bytes, layers, best)
    return out


def _rate(layer_bytes: int, layers: int, seconds: float) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {"mbps": layer_bytes * layers / seconds / 1e6, "layer_s": seconds / layers, "layer_bytes": layer_bytes}
