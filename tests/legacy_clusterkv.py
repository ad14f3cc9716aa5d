"""ClusterKV as it decoded before the static decode step, kept as an independent reference.

:class:`LegacyClusterKV` is the pre-conversion decode code of :mod:`kvbench.methods.clusterkv`, copied
verbatim: the index rebuilt as an immutable :class:`~kvbench.methods.clusterkv.ClusterIndex` at every
recluster (inside ``select``, host-side), ``kv.n`` read at every step, the cluster walk by masks over
every clustered token (:func:`~kvbench.methods.clusterkv.cluster_take`), the cluster cache as a deque
of the last R steps' clusters and the hit rates as a list of tensors. It runs on the dynamic
per-layer step (``static_decode = False``); ``tests/test_static_clusterkv.py`` checks that the static
method attends exactly the same positions at every step and layer, generates the same tokens, moves
the same bytes and reports the same cluster hit rate.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods.clusterkv import ClusterIndex, ClusterKV, cluster_take


class LegacyClusterKV(ClusterKV):
    name = "_legacy_clusterkv"
    static_decode = False

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.index: dict[int, ClusterIndex] = {}  # type: ignore[assignment]
        self.history: dict[int, deque] = {}
        self.hits: list[torch.Tensor] = []  # per step and layer: mean cluster hit rate (0-d)
        self.iterations: list[int] = []

    def before_step(self, ctx: Any) -> None:
        """Nothing: the earlier method reclustered inside ``select``."""

    def decode_key(self) -> Any:
        return ()

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        if layer in self.dense_layers:
            return
        sink = self.ctx.budget.sink
        keys = key[0, :, sink:].to(kv.device)  # clustered where the model runs, not in the host tier
        if keys.shape[1] == 0:
            return
        count = self.params.clusters or max(1, round(keys.shape[1] / 80))
        labels, centroids = self._cluster(keys, count)
        slots = torch.arange(sink, sink + keys.shape[1], device=kv.device)
        self.index[layer] = ClusterIndex.build(slots, labels, centroids)  # type: ignore[assignment]
        self.history[layer] = deque(maxlen=self.params.cache_steps)

    def _maybe_recluster(self, layer: int, kv: LayerKV) -> ClusterIndex:
        index: ClusterIndex = self.index[layer]  # type: ignore[assignment]
        period = self.params.recluster_every
        current = kv.n - 1  # the current token is attended anyway
        if current - index.clustered_end >= period:
            start, end = index.clustered_end, index.clustered_end + period
            labels, centroids = self._cluster(kv.keys[:, start:end].to(kv.device), self.params.new_clusters)
            index = index.append(torch.arange(start, end, device=kv.device), labels, centroids)
            self.index[layer] = index  # type: ignore[assignment]
        return index

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        if layer not in self.index:
            return None
        budget, spec = self.ctx.budget, self.ctx.spec
        index = self._maybe_recluster(layer, kv)
        # tokens generated since the last clustering stay on the device until they are clustered
        kv.set_residency(budget.sink, kv.n - index.clustered_end)
        clustered = index.slots.numel()
        home, device = kv.home, kv.device
        recent = torch.arange(index.clustered_end, kv.n, device=device)
        sinks = torch.arange(0, min(budget.sink, kv.n), device=device)
        per_head = self.params.gqa == "per_query_head" and spec.group > 1
        rows = spec.n_heads if per_head else spec.n_kv_heads
        fixed = torch.cat([sinks, recent])
        if budget.select >= clustered:
            slots = torch.sort(torch.cat([fixed, index.slots])).values
            return Selection(slots=slots.to(home).expand(rows, -1))
        q = query[0, :, 0, :].to(device).float().view(spec.n_kv_heads, spec.group, -1)
        scores = torch.einsum("hgd,hcd->hgc", q, index.centroids.float())  # inner product q·μ
        if per_head:
            scores = scores.reshape(rows, -1)
            labels, sizes = index.per_row(spec.group)
        else:
            scores, labels, sizes = scores.sum(dim=1), index.labels, index.sizes
        take, clusters = cluster_take(scores, labels, budget.select, sizes)  # ascending token indices
        selected = index.slots[take]
        cached = self._cache_step(layer, clusters, labels, take)
        # sinks < clustered slots < recent ones, and each part is ascending: the slots need no sort
        slots = torch.cat([sinks.expand(rows, -1), selected, recent.expand(rows, -1)], dim=1)
        cached_full = torch.zeros_like(slots, dtype=torch.bool)
        if cached is not None:
            cached_full[:, sinks.numel() : sinks.numel() + selected.shape[1]] = cached
        # the selection is handed over in the host tier's terms (where the store gathers and recall reads)
        return Selection(
            slots=slots.to(home),
            selected=selected.to(home),
            candidates=index.slots_on(home),
            cached=cached_full.to(home),
        )

    def _cache_step(
        self, layer: int, clusters: torch.Tensor, labels: torch.Tensor, take: torch.Tensor
    ) -> torch.Tensor | None:
        """Hit rate of this step's clusters against the last R steps; which selected tokens (``take``:
        indices into the clustered tokens) were cached."""
        history = self.history[layer]
        cached = None
        if history:
            previous = torch.zeros_like(clusters)
            for past in history:  # clusters appended since then were not selected then
                previous[:, : past.shape[1]] |= past
            hit = (clusters & previous).sum(dim=1).float() / clusters.sum(dim=1).clamp_min(1)
            self.hits.append(hit.mean())  # a tensor: read once, in telemetry() (no sync per step)
            cached = torch.gather(previous, 1, torch.gather(labels, 1, take))
        history.appendleft(clusters)
        return cached

    def snapshot(self) -> tuple[dict[int, ClusterIndex], dict[int, deque]]:  # type: ignore[override]
        """The cluster index (decode appends clusters of generated tokens; an index is never modified
        in place) and the cluster cache's history of the last R steps."""
        return dict(self.index), {layer: deque(h, maxlen=h.maxlen) for layer, h in self.history.items()}  # type: ignore[arg-type]

    def restore(self, state: tuple[dict[int, ClusterIndex], dict[int, deque]]) -> None:  # type: ignore[override]
        index, history = state
        self.index = dict(index)  # type: ignore[arg-type]
        self.history = {layer: deque(h, maxlen=h.maxlen) for layer, h in history.items()}

    def telemetry(self) -> dict[str, Any]:
        return {
            "cluster_hit_rate": float(sum(float(h) for h in self.hits) / len(self.hits)) if self.hits else None,
            "clusters": {str(k): int(v.centroids.shape[1]) for k, v in list(self.index.items())[:1]},
            "kmeans_iters_mean": float(sum(self.iterations) / len(self.iterations)) if self.iterations else None,
        }
