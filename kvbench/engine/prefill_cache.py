"""One dense prefill per (model, prompt), shared by the methods of a sweep.

Why. A sweep runs every method on the same prompts, and most methods start from the same dense
prefill: ``full``, every retrieval method (they index the full cache in ``on_prefill``) and every
eviction method (they evict after each layer's dense attention). Only what the method does *after* a
layer's attention differs, so a 10-method sweep would compute the same K/V ten times. The prefill is
the dominant cost of a long prompt on a CPU; sharing it is the cheapest speed-up a sweep can get.

What is cached (:class:`PrefillEntry`), keyed by the model (:func:`model_key`) and the prompt's ids:

* every layer's post-RoPE K and V exactly as the model produced them (same values, same strides, so
  whatever a method computes from them is bit-identical to its own prefill), and the logits of the
  prompt's last token (the first generated token);
* the *query statistics* the methods asked for (:class:`~kvbench.engine.protocol.QueryStatistic`:
  SnapKV's observation-window votes, H2O's accumulated attention, InfLLM's local attention received).
  The queries themselves are not kept (they are larger than the K/V); a statistic is computed while
  they exist. An entry holding K/V but not a statistic a method asks for is a miss: the method runs a
  dense prefill that computes it, and the statistic is added to the entry for the next methods.
  A sweep that knows its points (``kvbench run -m``, ``kvbench reproduce``, ``kvbench check``:
  :class:`PrefillSharing` with ``points``) avoids that miss: a new entry also computes the statistics the
  sweep's methods on this model will read (:func:`anticipated`), each timed apart;
* the measured seconds of the dense prefill (``dense_s``, the statistics' time excluded) and of
  every statistic per layer.

Who uses it: a method whose :attr:`~kvbench.engine.protocol.KVMethod.shares_prefill` is true (the stock
dense plan: ``full``, ``oracle``, ``quest``, ``sparq``, ``infllm``, ``clusterkv``, ``streamingllm``,
``snapkv``, ``pyramidkv``, ``h2o``, ``pqcache`` with ``overlap: false``). The engine then installs the
cached K/V layer by layer into the method's store and calls its ``on_prefill`` as a dense prefill
would (:meth:`~kvbench.engine.context.GenerationContext.replay_prefill`), without the queries.
Methods that change the prefill never receive a cached one: reuse methods (their own plan) and
``pqcache`` with ``overlap: true`` (k-means overlapped with the prefill's compute, which a replay does
not run).

**Timing rule.** A method that shares the prefill records
``prefill_s = ttft_s = dense_s + its statistics' seconds + replay_s``: the dense prefill time measured
when the entry was made (same model, prompt and machine), the time its statistics took then (only the
layers it read), and the replay measured now — installing the K/V and running its own ``on_prefill``
(indexing, k-means, eviction). On a miss all three are measured now; on a hit the telemetry says
``prefill_shared: true``. Everything else (decode steps, selection, fetches) is measured as always.

Where entries live: RAM (host memory; on a GPU the entry is copied to the host) up to
``KVBENCH_PREFILL_CACHE_RAM_GB`` (default 4), then one safetensors file per entry in a folder of this
cache under ``$KVBENCH_HOME/prefill_cache`` up to ``KVBENCH_PREFILL_CACHE_DISK_GB`` (default 16),
deleted when the cache is collected or the process ends. Loads happen before the method's clock starts.

Eviction fits how sweeps run: Hydra runs a sweep point by point, each over all the samples, so
the prompts recur in the same order once per method. Least-recently-used eviction would evict exactly
the entry the next method needs first, and nothing would ever hit. Instead, entries used during the
current run (:meth:`PrefillCache.begin_run` starts one) are kept: when the caps are full of them, a new entry is not
stored, so the first prompts of every run hit. Entries not used during the current run (an earlier
model or task) are evicted least recently used first, RAM entries spilling to disk when it has room.

When it is on: ``prefill_cache`` (a top-level config key) ``true`` / ``false``; ``null`` (the
default) turns it on for the points of a sweep (``kvbench run -m``, ``kvbench reproduce``, ``kvbench
check``: the caller hands :func:`kvbench.runner.run` a :class:`kvbench.shared.Sweep`, which owns the cache)
and off for a single run, which has nothing to share. The runner makes the choice and passes the
:class:`PrefillSharing` down to the engine with each request; this module keeps no state between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from kvbench.engine import attention
from kvbench.engine.prefill import PrefillPlan

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext
    from kvbench.engine.protocol import QueryStatistic
    from kvbench.models.loading import LoadedModel

GB = 1024**3
DEFAULT_RAM_GB = 4.0
DEFAULT_DISK_GB = 16.0


# ---------------------------------------------------------------------- a run's sharing
@dataclass
class PrefillSharing:
    """How a run shares dense prefills (chosen by the runner, handed to every generation of the run:
    nothing here is module state). ``cache``: where entries live (one per sweep,
    :class:`kvbench.shared.Sweep`); ``points``: the resolved configs of the sweep's points, when known, and
    ``build``: how a point's method is made from its ``method`` config (the runner passes the method
    registry's: the engine imports no method). With both, a new entry also computes the query statistics
    the sweep's *later* methods will ask of the same prompt (:func:`anticipated`), so an eviction method or
    InfLLM that runs after ``full`` hits the entry instead of paying for a second dense prefill."""

    cache: PrefillCache
    points: tuple[Mapping[str, Any], ...] = ()
    build: Callable[[Mapping[str, Any]], Any] | None = None

    def anticipated(self, ctx: GenerationContext, prompt_len: int) -> tuple[QueryStatistic, ...]:
        return anticipated(self.points, self.build, ctx, prompt_len)


def anticipated(
    points: Sequence[Mapping[str, Any]],
    build: Callable[[Mapping[str, Any]], Any] | None,
    ctx: GenerationContext,
    prompt_len: int,
) -> tuple[QueryStatistic, ...]:
    """The query statistics that the sweep's ``points`` on this model will ask of a ``prompt_len``-token
    prompt: each point's method, built from its config by ``build``, given the point's budget resolved for
    this prompt and this model's spec, says what it reads
    (:meth:`~kvbench.engine.protocol.KVMethod.prefill_statistics`).

    Timing stays honest: a capture times every statistic on its own (``stat_s``) and a method's
    ``prefill_s`` counts only the statistics it reads, so computing others' costs no method anything
    but the sweep's wall time. A point whose method cannot be built or whose budget does not fit this
    prompt is skipped: it would only miss, as it does without anticipation.
    """
    from types import SimpleNamespace

    from kvbench.budget import BudgetConfig
    from kvbench.errors import KvbenchError

    if build is None:  # (nobody said how to build a point's method: no anticipation)
        return ()
    spec, capacity = ctx.spec, ctx.capacity
    wanted: list[QueryStatistic] = []
    seen: set[str] = set()
    for point in points:
        if (point.get("model") or {}).get("name") != spec.name:
            continue
        node = json.dumps([point.get("method"), point.get("budget")], sort_keys=True, default=str)
        if node in seen:
            continue
        seen.add(node)
        try:
            method = build(point["method"])
            if not method.shares_prefill:
                continue
            budget = BudgetConfig.from_mapping(point.get("budget"))
            resolved = method.resolve_budget(budget, prompt_len, capacity, spec.n_layers)
            method.ctx = cast("GenerationContext", SimpleNamespace(spec=spec, budget=resolved))
            stats = method.prefill_statistics()
        except (KvbenchError, AttributeError):  # (a method reading more of its context than spec/budget)
            continue
        wanted += [stat for stat in stats if stat not in wanted]
    return tuple(wanted)


def environment_cache() -> PrefillCache:
    """A cache with the environment's caps (``KVBENCH_PREFILL_CACHE_RAM_GB``, ``..._DISK_GB``)."""
    return PrefillCache(
        ram_bytes=int(float(os.environ.get("KVBENCH_PREFILL_CACHE_RAM_GB", DEFAULT_RAM_GB)) * GB),
        disk_bytes=int(float(os.environ.get("KVBENCH_PREFILL_CACHE_DISK_GB", DEFAULT_DISK_GB)) * GB),
    )


# ---------------------------------------------------------------------- keys
_MODEL_KEYS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def model_key(loaded: LoadedModel) -> str:
    """What makes two loaded models compute the same prefill: the chunk store's fingerprint (name,
    architecture, dtype, the first weights), the checkpoint's path, the device, and a digest of the last
    weights (two checkpoints of one architecture differ there even when their embeddings agree)."""
    from kvbench.kv.chunks import model_fingerprint

    model = loaded.model
    if model not in _MODEL_KEYS:
        last = list(model.parameters())[-1].detach().float().flatten()[:4096].cpu().numpy().tobytes()
        parts = [
            model_fingerprint(loaded),
            str(getattr(model.config, "_name_or_path", "")),
            loaded.spec.device,
            hashlib.sha256(last).hexdigest()[:8],
        ]
        _MODEL_KEYS[model] = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return _MODEL_KEYS[model]


def prompt_key(input_ids: torch.Tensor) -> str:
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    return f"{ids.numel()}-{hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:24]}"


# ---------------------------------------------------------------------- entries
@dataclass
class PrefillEntry:
    """One prompt's dense prefill: per layer K and V ``[1, kv_heads, n, d]`` (post-RoPE, the model's own
    strides), the last token's logits ``[1, vocab]``, per layer query statistics, and what each took."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    dense_s: float
    stats: dict[QueryStatistic, list[torch.Tensor]] = field(default_factory=dict)
    stat_s: dict[QueryStatistic, list[float]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[-2])

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.keys
        yield from self.values
        yield self.logits
        for per_layer in self.stats.values():
            yield from per_layer

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def has(self, stats: tuple[QueryStatistic, ...]) -> bool:
        return all(stat in self.stats for stat in stats)

    def to(self, device: torch.device | str) -> PrefillEntry:
        """A copy on ``device`` (the same tensors when they are there already); strides are kept."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return _compact(t).to(device)

        return PrefillEntry(
            keys=[move(t) for t in self.keys],
            values=[move(t) for t in self.values],
            logits=move(self.logits),
            dense_s=self.dense_s,
            stats={s: [move(t) for t in ts] for s, ts in self.stats.items()},
            stat_s={s: list(v) for s, v in self.stat_s.items()},
        )


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns exactly its bytes, else a copy with the same dimension order (a view
    into a larger buffer, e.g. V sliced from a fused QKV projection, would keep the whole buffer)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and _dense(t):
        return t
    order = _order(t)
    return t.permute(order).contiguous().permute(_inverse(order))


def _order(t: torch.Tensor) -> list[int]:
    """Dimensions from the largest stride to the smallest: ``t.permute(order)`` is contiguous for a
    dense tensor (the layout a copy must restore)."""
    strides = t.stride()
    return sorted(range(t.dim()), key=lambda i: (-strides[i], -t.shape[i]))


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def _dense(t: torch.Tensor) -> bool:
    return t.permute(_order(t)).is_contiguous()


class CapturePrefill(PrefillPlan):
    """The dense prefill of a shared entry: every row at every layer, transformers' SDPA as
    :class:`~kvbench.engine.prefill.DensePrefill` runs it, but nothing written to the store and no
    method hook: each layer's K/V are kept, and the asked query statistics computed (and timed) while
    the queries exist."""

    def __init__(self, ctx: GenerationContext, input_ids: torch.Tensor, stats: tuple[QueryStatistic, ...]) -> None:
        super().__init__(ctx, input_ids, torch.arange(input_ids.numel()))
        self.stats = stats
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.stat_values: dict[QueryStatistic, list[torch.Tensor]] = {s: [] for s in stats}
        self.stat_s: dict[QueryStatistic, list[float]] = {s: [] for s in stats}

    def attend(
        self,
        layer: int,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        self.keys.append(key)
        self.values.append(value)
        clock = self.ctx.clock
        for stat in self.stats:
            started = clock.now()
            self.stat_values[stat].append(stat.compute(query, key))
            self.stat_s[stat].append(clock.now() - started)
        return attention.dense(module, query, key, value, scaling)


def capture(ctx: GenerationContext, input_ids: torch.Tensor, stats: tuple[QueryStatistic, ...]) -> PrefillEntry:
    """Run the dense prefill of ``input_ids`` for a new entry (inside ``activate(ctx)``; the store of
    ``ctx`` is left untouched)."""
    plan = CapturePrefill(ctx, input_ids, stats)
    started = ctx.clock.now()
    logits = ctx.run_prefill(plan)
    total = ctx.clock.now() - started
    dense_s = max(0.0, total - sum(sum(seconds) for seconds in plan.stat_s.values()))
    return PrefillEntry(
        keys=plan.keys, values=plan.values, logits=logits, dense_s=dense_s, stats=plan.stat_values, stat_s=plan.stat_s
    )


# ---------------------------------------------------------------------- the cache
@dataclass
class _Slot:
    entry: PrefillEntry | None  # in RAM (host memory); None when on disk
    nbytes: int
    run: int  # the run that last used it
    tier: str = "ram"  # ram | disk
    path: Path | None = None  # on disk
    layout: dict[str, list[int]] = field(default_factory=dict)  # tensor name -> dimension order (disk)
    stat_order: list[QueryStatistic] = field(default_factory=list)  # disk names s<j> -> statistic
    dense_s: float = 0.0
    stat_s: dict[QueryStatistic, list[float]] = field(default_factory=dict)


@dataclass
class CacheCounts:
    """What the cache did, for tests and logs."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    refused: int = 0  # full of entries the current run uses
    ram_evictions: int = 0
    disk_evictions: int = 0
    spills: int = 0  # RAM entries moved to disk
    disk_loads: int = 0


class PrefillCache:
    """Shared prefills in RAM then on disk, each tier under a byte cap (see the module docs)."""

    def __init__(self, ram_bytes: int, disk_bytes: int, folder: Path | None = None) -> None:
        self.ram_bytes, self.disk_bytes = int(ram_bytes), int(disk_bytes)
        self._folder = folder
        self._slots: OrderedDict[tuple[str, str], _Slot] = OrderedDict()  # least recently used first
        self.run = 0
        self.counts = CacheCounts()

    # ------------------------------------------------------------------ use
    def begin_run(self) -> None:
        """A new run starts: the previous runs' entries may now be evicted."""
        self.run += 1

    def key(self, loaded: LoadedModel, input_ids: torch.Tensor) -> tuple[str, str]:
        return model_key(loaded), prompt_key(input_ids)

    def get(self, key: tuple[str, str], stats: tuple[QueryStatistic, ...], device: torch.device) -> PrefillEntry | None:
        """The entry of ``key`` on ``device`` when it holds ``stats`` (a hit), else ``None`` (a miss)."""
        slot = self._slots.get(key)
        if slot is None or not all(stat in slot.stat_s for stat in stats):
            self.counts.misses += 1
            return None
        self.counts.hits += 1
        slot.run = self.run
        self._slots.move_to_end(key)
        entry = slot.entry if slot.entry is not None else self._read(slot)
        return entry.to(device)

    def put(self, key: tuple[str, str], entry: PrefillEntry) -> None:
        """Keep ``entry``; a held entry of the same prompt is replaced by one with both's statistics
        (and its first measured ``dense_s``), or kept as it was when the larger one does not fit."""
        old = self._slots.pop(key, None)
        held = None
        if old is not None:
            held = old.entry if old.entry is not None else self._read(old)
            if old.path is not None:
                old.path.unlink(missing_ok=True)
            entry = PrefillEntry(
                entry.keys,
                entry.values,
                entry.logits,
                held.dense_s,
                {**entry.stats, **held.stats},
                {**entry.stat_s, **held.stat_s},
            )
        if self._insert(key, entry.to("cpu")):
            self.counts.stored += 1
            return
        self.counts.refused += 1
        if held is not None:
            self._insert(key, held)

    def _insert(self, key: tuple[str, str], host: PrefillEntry) -> bool:
        size = host.nbytes()
        slot = _Slot(entry=host, nbytes=size, run=self.run, dense_s=host.dense_s, stat_s=host.stat_s)
        if self._room("ram", size):
            self._slots[key] = slot
        elif self._room("disk", size):
            self._slots[key] = slot
            self._write(slot)
        else:
            return False
        return True

    def __len__(self) -> int:
        return len(self._slots)

    def held_bytes(self, tier: str) -> int:
        return sum(s.nbytes for s in self._slots.values() if s.tier == tier)

    def tier_of(self, key: tuple[str, str]) -> str | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.tier

    def clear(self) -> None:
        for key in list(self._slots):
            self._drop(key)

    # ------------------------------------------------------------------ eviction
    def _room(self, tier: str, size: int) -> bool:
        """Make ``size`` bytes of room in ``tier`` by evicting entries the current run has not used
        (least recently used first; a RAM entry spills to disk when disk can take it); false when the
        tier cannot take it without evicting the current run's entries."""
        cap = self.ram_bytes if tier == "ram" else self.disk_bytes
        if size > cap:
            return False
        while self.held_bytes(tier) + size > cap:
            victim = next((k for k, s in self._slots.items() if s.tier == tier and s.run < self.run), None)
            if victim is None:
                return False
            slot = self._slots[victim]
            if tier == "disk":
                self.counts.disk_evictions += 1
                self._drop(victim)
                continue
            self.counts.ram_evictions += 1
            slot.tier = "moving"  # in neither tier while disk makes room for it
            if self._room("disk", slot.nbytes):
                self._write(slot)
                self.counts.spills += 1
            else:
                self._drop(victim)
        return True

    def _drop(self, key: tuple[str, str]) -> None:
        slot = self._slots.pop(key)
        if slot.path is not None:
            slot.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ disk
    def folder(self) -> Path:
        """This process's spill folder (removed when the cache is collected or the process exits)."""
        if self._folder is None:
            from kvbench.assets import kvbench_home

            root = kvbench_home() / "prefill_cache"
            _remove_orphans(root)
            self._folder = root / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        self._folder.mkdir(parents=True, exist_ok=True)
        return self._folder

    def _write(self, slot: _Slot) -> None:
        """Move ``slot``'s entry from RAM to a safetensors file (each tensor stored in its dimension
        order, so a reload restores its strides)."""
        from safetensors.torch import save_file

        entry = slot.entry
        assert entry is not None
        slot.stat_order = list(entry.stats)
        named = {f"k.{i}": t for i, t in enumerate(entry.keys)}
        named.update({f"v.{i}": t for i, t in enumerate(entry.values)})
        named["logits"] = entry.logits
        for j, stat in enumerate(slot.stat_order):
            named.update({f"s{j}.{i}": t for i, t in enumerate(entry.stats[stat])})
        slot.layout = {name: _order(t) for name, t in named.items()}
        path = self.folder() / f"{uuid.uuid4().hex}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(
            {name: t.permute(slot.layout[name]).contiguous() for name, t in named.items()},
            str(tmp),
            metadata={"layout": json.dumps(slot.layout)},
        )
        os.replace(tmp, path)
        slot.path, slot.entry, slot.tier = path, None, "disk"

    def _read(self, slot: _Slot) -> PrefillEntry:
        from safetensors.torch import load_file

        assert slot.path is not None
        self.counts.disk_loads += 1
        raw = load_file(str(slot.path))
        tensors = {name: t.permute(_inverse(slot.layout[name])) for name, t in raw.items()}
        layers = sum(1 for name in tensors if name.startswith("k."))
        return PrefillEntry(
            keys=[tensors[f"k.{i}"] for i in range(layers)],
            values=[tensors[f"v.{i}"] for i in range(layers)],
            logits=tensors["logits"],
            dense_s=slot.dense_s,
            stats={stat: [tensors[f"s{j}.{i}"] for i in range(layers)] for j, stat in enumerate(slot.stat_order)},
            stat_s=slot.stat_s,
        )


def _remove_orphans(root: Path) -> None:
    """Spill folders of processes that no longer run (killed before they could clean up)."""
    if not root.is_dir():
        return
    for child in root.iterdir():
        pid = child.name.partition("-")[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except PermissionError:
            pass
