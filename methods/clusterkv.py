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

Static decode step (:mod:`kvbench.engine.decode`). The index lives in :class:`ClusterBuffers`, allocated
for the layer's capacity: room for the prompt's clusters plus ``new_clusters`` per recluster the
capacity allows, labels and cluster-sorted slots for every slot up to the capacity. Reclustering is a
host-known event (every ``recluster_every`` tokens): :meth:`ClusterKV.before_step` runs it eagerly,
appending to the buffers in place, and sets the layer's residency. The clusters and clustered tokens in
use are a prefix of the buffers fixed within a *recluster epoch*, which is part of
:meth:`ClusterKV.decode_key`: the step reads views of that prefix, so clusters not yet made are never
scored or picked (their sizes stay 0). A step then issues the same ops every time:

* the **cluster walk** (:func:`cluster_walk`) in O(C log C + B) instead of masks over every clustered
  token: clusters sorted by score (``argsort(stable=True, descending=True)``, the order
  :func:`cluster_take` uses), prefix sums of their sizes, and for each of the B output positions its
  cluster (``searchsorted``) and offset, read from the cluster-sorted slots, each stored with its
  cluster (a cluster's tokens are in position order, so the cut cluster gives its lowest positions),
  then a sort of the B slots. It selects exactly what :func:`cluster_take` selects
  (``tests/test_static_clusterkv.py``);
* the **recent tokens**, whose count grows until the next recluster, as a fixed-width region from the
  clustered end (``min(bucket end, clustered end + recluster_every)``), the slots not held yet masked
  (``Selection.valid``) and pointed at the current token;
* the **cluster cache** as a device ring ``[R, KV heads, rows per head, C_max, 2]`` of the last R
  steps' clusters, each entry (chosen, 1), so that one matmul of a step's 0/1 clusters with it counts
  hits and clusters (exact integer sums); written at ``length mod R`` (consecutive steps have
  consecutive lengths). The hit rates (the earlier float32 ``hits / clusters`` per row, averaged over
  the rows) add up in a float64 device scalar in the earlier order, read in
  :meth:`ClusterKV.telemetry`: the earlier Python sum of the same floats. The first selecting step has
  no history (no hit recorded, nothing cached): a host-known regime.

Not-yet-held slots of the recent region point at the current token (a held slot: nothing is counted or
read past the length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvbench.engine.protocol import Selection
from kvbench.kv.store import LayerKV
from kvbench.methods import register
from kvbench.methods.params import HeadGranularity, KMeansInit, RetrievalParams
from kvbench.methods.primitives.kmeans import kmeans
from kvbench.methods.retrieval import RetrievalMethod
from kvbench.params import param


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


@dataclass
class ClusterBuffers:
    """One layer's index in buffers allocated for the whole generation (the static decode step): the
    same arrays as :class:`ClusterIndex`, of which the first ``clusters`` clusters and ``clustered``
    tokens are in use, and the cluster cache's ring. Reclustering appends in place (:meth:`append`);
    the properties are views of the part in use."""

    centroid_buf: torch.Tensor  # [kv_heads, C_max, d] float32
    count_buf: torch.Tensor  # [kv_heads, 2, C_max]: tokens per cluster, and their prefix sums (cluster ends)
    label_buf: torch.Tensor  # [kv_heads, N_max] cluster of each clustered token (token i is slot sink + i)
    # [kv_heads, N_max, 2]: the clustered slots sorted by cluster (ties by position), each with its cluster
    sorted_buf: torch.Tensor
    # the cluster cache: [R, kv_heads, rows per KV head, C_max, 2] float32, (chosen by one of the last R
    # steps, 1): a step's clusters (a 0/1 row) times it give (hits, clusters) in one matmul
    ring: torch.Tensor | None
    blank: torch.Tensor | None  # [kv_heads, rows per KV head, C_max] zeros: a step's clusters are scattered on it
    sink: int
    clusters: int = 0
    clustered: int = 0

    @staticmethod
    def allocate(
        like: torch.Tensor, clusters: int, tokens: int, sink: int, ring: tuple[int, int] | None
    ) -> ClusterBuffers:
        """Empty buffers for ``clusters`` clusters and ``tokens`` tokens, shaped after centroids ``like``
        ``[kv_heads, k, d]``; ``ring``: (R, rows per KV head), or ``None`` without a cluster cache."""
        heads, _, dim = like.shape
        device = like.device
        cache = None
        if ring is not None:
            cache = torch.zeros(ring[0], heads, ring[1], clusters, 2, dtype=torch.float32, device=device)
            cache[..., 1] = 1
        return ClusterBuffers(
            centroid_buf=torch.zeros(heads, clusters, dim, dtype=torch.float32, device=device),
            count_buf=torch.zeros(heads, 2, clusters, dtype=torch.long, device=device),
            label_buf=torch.zeros(heads, tokens, dtype=torch.long, device=device),
            sorted_buf=torch.zeros(heads, tokens, 2, dtype=torch.long, device=device),
            ring=cache,
            blank=None if cache is None else torch.zeros(cache.shape[1:-1], dtype=torch.float32, device=device),
            sink=sink,
        )

    # the part in use (ClusterIndex's names)
    @property
    def clustered_end(self) -> int:
        """Slots below this are clustered (or sinks)."""
        return self.sink + self.clustered

    @property
    def centroids(self) -> torch.Tensor:
        return self.centroid_buf[:, : self.clusters]

    @property
    def sizes(self) -> torch.Tensor:
        return self.count_buf[:, 0, : self.clusters]

    @property
    def prefix(self) -> torch.Tensor:
        return self.count_buf[:, 1, : self.clusters]

    @property
    def labels(self) -> torch.Tensor:
        return self.label_buf[:, : self.clustered]

    @property
    def sorted_slots(self) -> torch.Tensor:
        return self.sorted_buf[:, : self.clustered, 0]

    @property
    def sorted_pairs(self) -> torch.Tensor:
        """``[kv_heads, n, 2]``: (slot, cluster) in cluster order."""
        return self.sorted_buf[:, : self.clustered]

    @property
    def slots(self) -> torch.Tensor:
        """The clustered slots, ascending (made on request: they are ``[sink, clustered_end)``)."""
        return torch.arange(self.sink, self.clustered_end, device=self.label_buf.device)

    @property
    def room(self) -> tuple[int, int]:
        """(clusters, tokens) the buffers hold."""
        return self.centroid_buf.shape[1], self.label_buf.shape[1]

    def append(self, labels: torch.Tensor, centroids: torch.Tensor) -> None:
        """Add the clusters ``centroids`` ``[kv_heads, k, d]`` of the next ``t`` tokens (``labels``
        ``[kv_heads, t]``, relative to the new centroids), in place. The new labels all exceed the old
        ones, so the cluster-sorted slots of the earlier tokens stay and the new ones follow them."""
        c, n = self.clusters, self.clustered
        k, t = centroids.shape[1], labels.shape[1]
        sizes = torch.zeros(labels.shape[0], k, dtype=torch.long, device=labels.device)
        sizes.scatter_add_(1, labels, torch.ones_like(labels))
        self.centroid_buf[:, c : c + k] = centroids
        self.count_buf[:, 0, c : c + k] = sizes
        self.count_buf[:, 1, c : c + k] = n + torch.cumsum(sizes, dim=1)
        self.label_buf[:, n : n + t] = labels + c
        ordered = torch.sort(labels, dim=1, stable=True)
        self.sorted_buf[:, n : n + t, 0] = ordered.indices + (self.sink + n)
        self.sorted_buf[:, n : n + t, 1] = ordered.values + c
        self.clusters, self.clustered = c + k, n + t

    def resized(self, clusters: int, tokens: int) -> ClusterBuffers:
        """A copy with room for ``clusters`` clusters and ``tokens`` tokens (the part in use copied)."""
        ring = None if self.ring is None else (self.ring.shape[0], self.ring.shape[2])
        out = ClusterBuffers.allocate(self.centroid_buf, clusters, tokens, self.sink, ring)
        out.load(self)
        return out

    def saved(self) -> ClusterBuffers:
        """A copy of the part in use (no spare room): what a rollback restores."""
        c, n = self.clusters, self.clustered
        return ClusterBuffers(
            centroid_buf=self.centroids.clone(),
            count_buf=self.count_buf[:, :, :c].clone(),
            label_buf=self.labels.clone(),
            sorted_buf=self.sorted_pairs.clone(),
            ring=None if self.ring is None else self.ring[..., :c, :].clone(),
            blank=None if self.blank is None else self.blank[..., :c].clone(),
            sink=self.sink,
            clusters=c,
            clustered=n,
        )

    def load(self, saved: ClusterBuffers) -> bool:
        """Hold what ``saved`` holds, in place (the buffers a captured step reads stay); false, and nothing
        changed, when it does not fit."""
        c, n = saved.clusters, saved.clustered
        if self.ring is None or saved.ring is None:
            ring_fits = self.ring is None and saved.ring is None
        else:
            ring_fits = self.ring.shape[:3] == saved.ring.shape[:3]
        if c > self.room[0] or n > self.room[1] or not ring_fits:
            return False
        self.centroid_buf[:, :c] = saved.centroids
        self.count_buf[:, :, :c] = saved.count_buf[:, :, :c]
        self.label_buf[:, :n] = saved.labels
        self.sorted_buf[:, :n] = saved.sorted_pairs
        if self.ring is not None and saved.ring is not None:
            self.ring[..., 0].zero_()  # (clusters made later were chosen by no earlier step)
            self.ring[..., :c, :] = saved.ring[..., :c, :]
        self.sink, self.clusters, self.clustered = saved.sink, c, n
        return True


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


def cluster_walk(
    scores: torch.Tensor, counts: torch.Tensor, sorted_pairs: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cluster_take` in O(C log C + B) per row, with shapes fixed by ``C`` and ``B`` (the static
    decode step): the same tokens and the same contributing clusters.

    ``scores`` ``[h, g, C]`` (``g`` rows per KV head), ``counts`` ``[h, 2, C]`` (tokens per cluster and
    their prefix sums: where each cluster ends in ``sorted_pairs``), ``sorted_pairs`` ``[h, n, 2]`` (the
    clustered slots sorted by cluster, ties by position, each with its cluster), ``positions``
    ``[h, g, B]``: ``arange(B)`` in every row, ``B`` < n (contiguous: ``searchsorted`` would copy an
    expanded one at every call).

    Clusters in score order (ties to the lower index, as :func:`cluster_take`) fill output positions
    ``0..B-1`` in turn: position ``j`` falls in the cluster of rank ``r`` whose prefix sum first
    exceeds ``j``, at offset ``j - (filled[r] - size[r])`` from that cluster's start in ``sorted_pairs``
    (``end[r] - size[r]``), i.e. at ``j + end[r] - filled[r]``. The cut cluster thus gives its lowest
    positions. Returns the ``[h, g, B]`` slots ascending, the permutation from walk order to them, and
    the cluster of each position ``j`` in walk order (read with its slot: one gather)."""
    heads, group, clusters = scores.shape
    budget = positions.shape[2]
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    wide = (heads, group, 2, clusters)
    ranked = torch.gather(counts.view(heads, 1, 2, -1).expand(wide), 3, order.view(heads, group, 1, -1).expand(wide))
    filled = torch.cumsum(ranked[:, :, 0], dim=-1)  # tokens in the clusters ranked <= r
    rank = torch.searchsorted(filled, positions, right=True)
    at = positions + torch.gather(ranked[:, :, 1] - filled, 2, rank)
    pairs = sorted_pairs.view(heads, 1, -1, 2).expand(heads, group, -1, 2)
    taken = torch.gather(pairs, 2, at.view(heads, group, budget, 1).expand(heads, group, budget, 2))
    slots, perm = torch.sort(taken[..., 0], dim=-1)
    return slots, perm, taken[..., 1]


@dataclass(frozen=True)
class ClusterKVParams(RetrievalParams):
    sink: int = param(16, "always attended, never clustered, outside the budget", min=0)
    local_fraction: float = param(0.0, "no window: unclustered recent tokens are attended on top", min=0, max=1)
    dense_layers: tuple[int, ...] = param((0, 1), "layers that attend every token (ClusterKV: 0-1)", min=0)
    clusters: int | None = param(
        None, "prefill clusters; null: round((L - sink) / 80) (paper); authors' code: 400", min=1
    )
    kmeans_iters: int = param(20, "k-means iteration cap", min=1)
    until_stable: bool = param(True, "stop once no label changes (paper: until convergence)")
    metric: Literal["cosine", "l2", "ip"] = param("cosine", "k-means metric: cosine (paper) | l2 | ip")
    seed: int = param(42, "k-means initialisation seed")
    init: KMeansInit = param("random", "random key vectors (paper) | kmeans++ (the authors' accuracy code)")
    recluster_every: int = param(320, "decode tokens per incremental clustering", min=1)
    new_clusters: int = param(4, "clusters per recluster_every new tokens (paper; efficiency code: 8)", min=1)
    gqa: HeadGranularity = param("per_query_head", "each query head ranks clusters | shared: one ranking per KV head")
    cache_steps: int = param(1, "R: clusters selected in the last R steps count as device-resident", min=0)


@register
class ClusterKV(RetrievalMethod):
    name = "clusterkv"
    Params = ClusterKVParams
    params: ClusterKVParams

    static_decode = True

    def start(self, ctx: Any) -> None:
        super().start(ctx)
        self.index: dict[int, ClusterBuffers] = {}
        self.iterations: list[int] = []
        self._selecting = 0  # selecting (non-covering) steps so far: the first has no cache history
        self._version = 0  # bumped when a layer's buffers are replaced (a captured step read the old ones)
        self._hit_sum = torch.zeros((), dtype=torch.float64, device=ctx.spec.device)  # hit rates, summed
        self._hit_count = 0  # (step, layer) hit rates in the sum
        rows = (ctx.spec.n_kv_heads, ctx.spec.group if self._per_head else 1, ctx.budget.select)
        self._positions = torch.arange(rows[2], device=ctx.spec.device).expand(rows).contiguous()  # (cluster_walk)

    @property
    def _per_head(self) -> bool:
        return self.params.gqa == "per_query_head" and self.ctx.spec.group > 1

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

    def _room(self, kv: LayerKV, clusters: int, clustered_end: int) -> tuple[int, int]:
        """(clusters, tokens) a layer's buffers need for ``kv``'s capacity: the clusters made so far plus
        ``new_clusters`` for every recluster the capacity allows, and every slot up to the capacity."""
        p = self.params
        reclusters = max(0, (kv.capacity - 1 - clustered_end) // p.recluster_every)
        added = max(1, min(p.new_clusters, p.recluster_every))  # (what _cluster makes of recluster_every tokens)
        return clusters + reclusters * added, kv.capacity - self.ctx.budget.sink

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
        clusters, tokens = self._room(kv, centroids.shape[1], sink + keys.shape[1])
        steps = self.params.cache_steps
        ring = (steps, self.ctx.spec.group if self._per_head else 1) if steps else None
        index = ClusterBuffers.allocate(centroids, clusters, max(tokens, keys.shape[1]), sink, ring)
        index.append(labels, centroids)
        self.index[layer] = index

    # ------------------------------------------------------------------ host side of a step
    def before_step(self, ctx: Any) -> None:
        """Every indexed layer's host work (:meth:`_prepare`), then the step's count (:meth:`_count_step`)."""
        for layer in self.index:
            self._prepare(layer, ctx.store[layer])
        self._count_step()

    def _prepare(self, layer: int, kv: LayerKV) -> None:
        """Room for the layer's capacity (buffers replaced only when the store grew), the recluster of
        the ``recluster_every`` tokens after the clustered end once that many wait (the current token
        excepted), and the resident range: sinks and the unclustered tokens."""
        index = self.index[layer]
        clusters, tokens = self._room(kv, index.clusters, index.clustered_end)
        if clusters > index.room[0] or tokens > index.room[1]:
            index = self.index[layer] = index.resized(max(clusters, index.room[0]), max(tokens, index.room[1]))
            self._version += 1
        period, start = self.params.recluster_every, index.clustered_end
        if kv.n - 1 - start >= period:
            labels, centroids = self._cluster(
                kv.keys[:, start : start + period].to(kv.device), self.params.new_clusters
            )
            index.append(labels, centroids)
        # tokens generated since the last clustering stay on the device until they are clustered
        kv.set_residency(self.ctx.budget.sink, kv.n - index.clustered_end)

    def _count_step(self) -> None:
        """Count a selecting step: the first has no cache history; later ones add a hit rate per layer."""
        if not self.index or self._covering():
            return
        self._selecting += 1
        if self._history():
            self._hit_count += len(self.index)

    def _covering(self) -> bool:
        """Whether the budget takes every clustered token (every indexed layer clustered as many)."""
        return self.ctx.budget.select >= next(iter(self.index.values())).clustered

    def _history(self) -> bool:
        """Whether this step's clusters meet earlier ones in the cluster cache."""
        return self.params.cache_steps > 0 and self._selecting > 1

    def _index_of(self, kv: LayerKV) -> ClusterBuffers | None:
        return next((index for layer, index in self.index.items() if self.ctx.store[layer] is kv), None)

    def covers(self, kv: LayerKV) -> bool:
        """Whether the budget takes every clustered token of ``kv`` (the earlier select then attended
        every held token: the dense step)."""
        index = self._index_of(kv)
        return index is None or self.ctx.budget.select >= index.clustered

    def decode_key(self) -> tuple[Any, ...]:
        """The covering regime, the recluster epoch (clusters in use), whether the cluster cache has a
        history, and the buffers' version."""
        if not self.index:
            return ()
        return (self._covering(), next(iter(self.index.values())).clusters, self._history(), self._version)

    def recall_candidates(self, kv: LayerKV) -> torch.Tensor | None:
        """The clustered slots (the earlier select's candidates)."""
        index = self._index_of(kv)
        return None if index is None else torch.arange(index.sink, index.clustered_end, device=kv.home)

    # ------------------------------------------------------------------ the device step
    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """Clusters by centroid score (:func:`cluster_walk`) plus sinks and the unclustered tokens; the
        dense step when the budget takes every clustered token."""
        if layer not in self.index:
            return None
        index = self.index[layer]
        budget, spec = self.ctx.budget.select, self.ctx.spec
        if budget >= index.clustered:
            return None
        q = query[0, :, 0, :].view(spec.n_kv_heads, spec.group, -1)
        if q.device != kv.device or q.dtype != torch.float32:  # (a no-op .to() is still an op in the step)
            q = q.to(kv.device, torch.float32)
        # inner product q·μ: the earlier einsum("hgd,hcd->hgc") is this bmm (the same kernel, less overhead)
        scores = torch.matmul(q, index.centroids.transpose(1, 2))
        if not self._per_head and spec.group > 1:
            scores = scores.sum(dim=1, keepdim=True)
        counts = index.count_buf[:, :, : index.clusters]
        selected, perm, clusters = cluster_walk(scores, counts, index.sorted_pairs, self._positions)
        cached = None if index.ring is None else self._cache_step(index, clusters, perm, kv)
        return self._compose(index, selected.view(-1, budget), cached, kv)

    def _cache_step(
        self, index: ClusterBuffers, clusters: torch.Tensor, perm: torch.Tensor, kv: LayerKV
    ) -> torch.Tensor | None:
        """This step's clusters (``clusters``: the cluster of each walk position) into the ring; with a
        history, their hit rate against the last R steps into the device sum, and (offload) which
        selected tokens were cached, in slot order (``perm``)."""
        ring, c = index.ring, index.clusters
        assert ring is not None and index.blank is not None
        heads, group = ring.shape[1:3]
        chosen = torch.scatter(index.blank[..., :c], 2, clusters, 1.0)  # 0/1 per cluster
        cached = None
        if self._history():
            previous = ring[0, ..., :c, :] if ring.shape[0] == 1 else ring[..., :c, :].amax(dim=0)
            counts = torch.matmul(chosen.view(heads, group, 1, c), previous)  # (hits, clusters): exact sums
            taken = counts[..., 1] if clusters.shape[2] else counts[..., 1].clamp_min(1)
            hit = torch.true_divide(counts[..., 0], taken)  # the earlier int / int as float32
            self._hit_sum.add_(hit.view(-1).mean())
            if kv.offload:
                cached = torch.gather(torch.gather(previous[..., 0], 2, clusters), 2, perm) > 0
        if ring.shape[0] == 1:
            ring[0, ..., :c, 0].copy_(chosen)
        else:  # consecutive steps have consecutive lengths: the slot written R steps ago is the oldest
            assert kv.length is not None
            ring[..., :c, 0].index_copy_(0, torch.remainder(kv.length, ring.shape[0]), chosen[None])
        return cached

    def _compose(
        self, index: ClusterBuffers, selected: torch.Tensor, cached: torch.Tensor | None, kv: LayerKV
    ) -> Selection:
        """Sinks, ``selected`` (``[rows, B]`` ascending) and the unclustered region: ``[rows, sink + B + W]``
        ascending slots, ``W = min(bucket end, clustered end + recluster_every) - clustered end`` (it holds
        every unclustered token until the next recluster); its slots not held yet are masked and point at
        the current token."""
        rows, start = selected.shape[0], index.clustered_end
        width = min(kv.bucket_end - start, self.params.recluster_every)
        sinks = kv.iota(index.sink).expand(rows, -1)
        recent = kv.iota(kv.bucket_end)[start : start + width].expand(rows, -1)
        slots = torch.cat([sinks, selected, recent], dim=1)
        assert kv.length is not None and kv.current is not None, "a static step needs the decoder's counters"
        valid = slots < kv.length
        if cached is not None:
            off = torch.zeros(rows, index.sink + width, dtype=torch.bool, device=slots.device)
            cached = torch.cat([off[:, : index.sink], cached.reshape(rows, -1), off[:, index.sink :]], dim=1)
        return Selection(slots=torch.minimum(slots, kv.current), selected=selected, cached=cached, valid=valid)

    # ------------------------------------------------------------------ rollback, figures
    def snapshot(self) -> tuple[dict[int, ClusterBuffers], int]:
        """Every layer's index in use and its cluster cache's ring (reclustering appends in place, every
        step writes the ring), copied, and the count of selecting steps (whether the next has a history)."""
        return {layer: index.saved() for layer, index in self.index.items()}, self._selecting

    def restore(self, state: tuple[dict[int, ClusterBuffers], int]) -> None:
        """Back to :meth:`snapshot`'s state, in the same buffers when they hold it."""
        saved, self._selecting = state
        for layer, kept in saved.items():
            index = self.index.get(layer)
            if index is None or not index.load(kept):
                self.index[layer] = kept.resized(*kept.room)  # (a copy: the snapshot may be restored again)
                self._version += 1

    def telemetry(self) -> dict[str, Any]:
        hits = float(self._hit_sum) / self._hit_count if self._hit_count else None
        return {
            "cluster_hit_rate": hits,
            "clusters": {str(k): v.clusters for k, v in list(self.index.items())[:1]},
            "kmeans_iters_mean": float(sum(self.iterations) / len(self.iterations)) if self.iterations else None,
        }
