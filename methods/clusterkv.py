"""``clusterkv``: recall tokens by semantic clusters of keys (Liu et al., DAC 2025; seed-clusterkv.md §1).

* **prefill** — per KV head, the post-RoPE keys of the prompt (the ``sink`` = 16 first tokens
  excepted, always attended) are clustered by cosine k-means (random initial keys, plain-mean
  centroids, up to ``kmeans_iters`` iterations, stopping once no label changes) into
  ``C0 = round((L - sink) / 80)`` clusters (``clusters`` fixes the count; the authors' accuracy code
  used 400). The index holds the paper's Fig. 8 arrays: centroids, sizes, prefix sums and the token
  indices sorted by cluster.
* **decode** — each query head scores its KV head's centroids by inner product, takes clusters in
  score order until ``select`` tokens are gathered and trims the last cluster (keeping its
  lowest-position tokens, as the authors' code does). Tokens generated since the last clustering are
  always attended; every ``recluster_every`` (320) generated tokens, those tokens are clustered into
  ``new_clusters`` (4) clusters appended to the index.
* **tiers** — sinks and the not-yet-clustered recent tokens are device-resident; clustered tokens live
  in the host tier and only the selected ones are fetched (cached-cluster tokens count as hits). The
  clustering and the index (centroids, labels, sorted slots) live on the compute device, as in the
  paper's system (clustering on the GPU during prefill, the cluster walk on the GPU at decode): only
  the chosen slots cross to the host tier, which gathers their K/V.
* **cache** — selected clusters stay on the device for ``cache_steps`` (R = 1) steps; tokens of a
  cluster selected in the previous R steps are hits. The cluster-level hit rate (|current ∩ previous
  R| / |current|, per head and step) is reported as ``cluster_hit_rate``.

Defaults follow ClusterKV's alignment with Quest: layers 0-1 dense, per-query-head selection
(``gqa: shared`` ranks once per KV head with the group's summed query). The budget ``B`` counts
cluster-selected tokens; the 16 sinks and the unclustered recent tokens are extra (the authors'
accuracy code counts the sinks inside B: their ``B = 256`` is ``budget.tokens=240`` here).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.base import Selection
from kvbench.methods.params import ClusterKVParams
from kvbench.methods.primitives.kmeans import kmeans
from kvbench.methods.retrieval import RetrievalMethod


@dataclass
class ClusterIndex:
    """The Fig. 8 arrays of one KV head group: ``[kv_heads, C, d]`` centroids, ``[kv_heads, C]`` sizes and
    prefix sums, ``[kv_heads, n]`` token slots sorted by cluster label (ties by position)."""

    centroids: torch.Tensor
    sizes: torch.Tensor
    prefix: torch.Tensor
    sorted_slots: torch.Tensor
    labels: torch.Tensor  # [kv_heads, n] cluster of each clustered token, in token order
    slots: torch.Tensor  # [n] the clustered slots, ascending
    clustered_end: int  # slots below this are clustered (or sinks)

    @staticmethod
    def build(slots: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> ClusterIndex:
        clusters = centroids.shape[1]
        sizes = torch.zeros(labels.shape[0], clusters, dtype=torch.long, device=labels.device)
        sizes.scatter_add_(1, labels, torch.ones_like(labels))
        order = torch.sort(labels, dim=1, stable=True).indices
        return ClusterIndex(
            centroids=centroids,
            sizes=sizes,
            prefix=torch.cumsum(sizes, dim=1),
            sorted_slots=slots[order],
            labels=labels,
            slots=slots,
            clustered_end=int(slots[-1]) + 1 if slots.numel() else 0,
        )

    def append(self, slots: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor) -> ClusterIndex:
        """Add clusters of new tokens (labels relative to the new centroids)."""
        shifted = labels + self.centroids.shape[1]
        merged_slots = torch.cat([self.slots, slots])
        merged_labels = torch.cat([self.labels, shifted], dim=1)
        return ClusterIndex.build(merged_slots, merged_labels, torch.cat([self.centroids, centroids], dim=1))

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """``slots`` on ``device`` (the host tier's copy, made once per index rather than every step)."""
        if self.slots.device == device:
            return self.slots
        cache: dict[torch.device, torch.Tensor] = self.__dict__.setdefault("_slots_on", {})
        if device not in cache:
            cache[device] = self.slots.to(device)
        return cache[device]

    def per_row(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``labels`` and ``sizes`` repeated for ``group`` query heads per KV head (row ``h`` reads KV
        head ``h // group``), made once per index rather than at every decode step (a cache outside the
        dataclass fields: derived data, not part of the index's state)."""
        if group == 1:
            return self.labels, self.sizes
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = self.__dict__.setdefault("_per_row", {})
        if group not in cache:
            cache[group] = (self.labels.repeat_interleave(group, dim=0), self.sizes.repeat_interleave(group, dim=0))
        return cache[group]


def cluster_take(
    scores: torch.Tensor, labels: torch.Tensor, budget: int, sizes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_by_clusters` on token indices: ``[rows, budget]`` indices into the clustered tokens
    (ascending) and the ``[rows, C]`` clusters that contributed. ``sizes`` ``[rows, C]``: tokens per
    cluster and row (counted from ``labels`` when not given). ``budget`` < the tokens per row.

    Clusters in score order are taken whole while they fit (ranks below ``cut``); the cluster ranked
    ``cut`` gives its ``room`` lowest tokens. That is the ``budget`` smallest ``(rank, position)`` keys,
    found with prefix sums over ``[rows, C]`` and masks over ``[rows, n]`` instead of a top-k and a sort.
    """
    rows, clusters = scores.shape
    n = labels.shape[1]
    device = scores.device
    if sizes is None:
        sizes = torch.zeros(rows, clusters, dtype=torch.long, device=device)
        sizes.scatter_add_(1, labels, torch.ones_like(labels))
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(clusters, device=device).expand(rows, -1))
    filled = torch.cumsum(torch.gather(sizes, 1, order), dim=1)  # tokens in the clusters ranked <= r
    cut = (filled <= budget).sum(dim=1, keepdim=True)  # clusters ranked below cut are taken whole
    whole = torch.gather(filled, 1, (cut - 1).clamp_min(0)).masked_fill_(cut == 0, 0)
    room = budget - whole  # tokens taken from the cluster ranked cut (its lowest positions)
    token_rank = torch.gather(rank, 1, labels)  # [rows, n]
    partial = token_rank == cut
    take = (token_rank < cut) | (partial & (partial.cumsum(dim=1) <= room))
    slot = torch.where(take, take.cumsum(dim=1) - 1, budget)  # column budget collects the rest
    index = torch.zeros(rows, budget + 1, dtype=torch.long, device=device)
    index.scatter_(1, slot, torch.arange(n, device=device).expand(rows, -1))
    chosen = ((rank < cut) & (sizes > 0)) | ((rank == cut) & (room > 0))
    return index[:, :budget], chosen


def select_by_clusters(
    scores: torch.Tensor, labels: torch.Tensor, slots: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Take whole clusters in score order until ``budget`` tokens, trimming the last one.

    ``scores`` ``[rows, C]``, ``labels`` ``[rows, n]`` (cluster of each clustered token, per row),
    ``slots`` ``[n]`` (ascending). Returns the selected slots ``[rows, budget]`` (ascending) and a boolean
    ``[rows, C]`` of the clusters that contributed. Within the cut cluster the lowest positions stay.
    """
    if budget >= labels.shape[1]:  # everything (the walk never cuts a cluster)
        chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        chosen.scatter_(1, labels, True)
        return slots.expand(scores.shape[0], -1), chosen
    take, chosen = cluster_take(scores, labels, budget)
    return slots[take], chosen


@register
class ClusterKV(RetrievalMethod):
    name = "clusterkv"
    Params = ClusterKVParams
    params: ClusterKVParams

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.index: dict[int, ClusterIndex] = {}
        self.history: dict[int, deque] = {}
        self.hits: list[torch.Tensor] = []  # per step and layer: mean cluster hit rate (0-d)
        self.iterations: list[int] = []

    def _cluster(self, keys: torch.Tensor, clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        result = kmeans(
            keys.float(),
            max(1, min(clusters, keys.shape[1])),
            iters=p.kmeans_iters,
            metric=p.metric,
            seed=p.seed,
            init=p.init,
            stop_when_stable=p.until_stable,
        )
        self.iterations.append(int(result.iterations))
        return result.labels, result.centroids

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
        self.index[layer] = ClusterIndex.build(slots, labels, centroids)
        self.history[layer] = deque(maxlen=self.params.cache_steps)

    def _maybe_recluster(self, layer: int, kv: LayerKV) -> ClusterIndex:
        index = self.index[layer]
        period = self.params.recluster_every
        current = kv.n - 1  # the current token is attended anyway
        if current - index.clustered_end >= period:
            start, end = index.clustered_end, index.clustered_end + period
            labels, centroids = self._cluster(kv.keys[:, start:end].to(kv.device), self.params.new_clusters)
            index = self.index[layer] = index.append(torch.arange(start, end, device=kv.device), labels, centroids)
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

    def snapshot(self) -> tuple[dict[int, ClusterIndex], dict[int, deque]]:
        """The cluster index (decode appends clusters of generated tokens; an index is never modified
        in place) and the cluster cache's history of the last R steps."""
        return dict(self.index), {layer: deque(h, maxlen=h.maxlen) for layer, h in self.history.items()}

    def restore(self, state: tuple[dict[int, ClusterIndex], dict[int, deque]]) -> None:
        index, history = state
        self.index = dict(index)
        self.history = {layer: deque(h, maxlen=h.maxlen) for layer, h in history.items()}

    def telemetry(self) -> dict[str, Any]:
        return {
            "cluster_hit_rate": float(sum(float(h) for h in self.hits) / len(self.hits)) if self.hits else None,
            "clusters": {str(k): int(v.centroids.shape[1]) for k, v in list(self.index.items())[:1]},
            "kmeans_iters_mean": float(sum(self.iterations) / len(self.iterations)) if self.iterations else None,
        }
