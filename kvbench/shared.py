"""What the runs of one sweep share: dense prefills and chunk stores.

A sweep (``kvbench run -m``, ``kvbench reproduce``, ``kvbench check``) runs many methods over the same
prompts. Two things computed for one run are valid for the others: a prompt's dense prefill
(:mod:`kvbench.engine.prefill_cache`) and a chunk's precomputed K/V (:class:`kvbench.kv.chunks.ChunkStore`:
an entry is a pure function of its key, whichever run computed it). Whoever runs the sweep makes one
:class:`Sweep`, hands it to every :func:`kvbench.runner.run` of the sweep, and closes it at the end; the
runner decides per run what it takes from it (``prefill_cache``: ``null`` shares inside a sweep, ``true``
/ ``false`` force it; a task whose runs must start on an empty store, a request stream, gets its own).
Nothing here is module state: two sweeps in one process share nothing, and a run without a sweep shares
nothing with the run before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.engine.prefill_cache import PrefillCache
    from kvbench.kv.chunks import ChunkStore, StoreConfig


@dataclass
class Sweep:
    """One sweep's shared resources. ``points``: the resolved configs of its points, when known (a new
    shared prefill then also computes the query statistics the later points' methods will read); the
    prefill cache and the chunk stores are made on first use."""

    points: tuple[Mapping[str, Any], ...] = ()
    _prefills: PrefillCache | None = field(default=None, repr=False)
    _stores: dict[tuple[Any, ...], ChunkStore] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, points: Sequence[Mapping[str, Any]] = ()) -> Sweep:
        return cls(points=tuple(dict(p) for p in points))

    def prefill_cache(self) -> PrefillCache:
        """The sweep's dense-prefill cache (the environment's caps; made on first use)."""
        if self._prefills is None:
            from kvbench.engine.prefill_cache import environment_cache

            self._prefills = environment_cache()
        return self._prefills

    def chunk_store(self, config: StoreConfig) -> ChunkStore:
        """The sweep's chunk store of this configuration, its figures restarted for the next run
        (:meth:`~kvbench.kv.chunks.ChunkStore.restart_stats`): each chunk is precomputed once per sweep
        instead of once per run. Outputs do not change, and precomputation is never part of TTFT; what a
        run reports as precomputed is what it had to compute itself."""
        from kvbench.kv.chunks import ChunkStore

        key = tuple(sorted(vars(config).items()))
        store = self._stores.get(key)
        if store is None:
            store = self._stores[key] = ChunkStore(config)
        store.restart_stats()
        return store

    def close(self) -> None:
        """Drop what the sweep holds (the prefill cache's spill files with it)."""
        if self._prefills is not None:
            self._prefills.clear()
        self._prefills = None
        self._stores.clear()

    def __enter__(self) -> Sweep:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
