"""The state of one generation: model, method, store, budget and telemetry.

:meth:`GenerationContext.attend` is called by the registered attention function for every layer of
every forward pass. It appends the new K/V to the store, runs dense attention at prefill (and lets
the method evict or index), and at decode asks the method for a selection, gathers it through the
store and records what was attended.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvbench.budget import ResolvedBudget
from kvbench.engine import attention
from kvbench.errors import CompressionNotApplied, ConfigError
from kvbench.kv.store import KVStore
from kvbench.profile import Profile
from kvbench.methods.selection import exact_topk
from kvbench.telemetry import Clock, Telemetry

if TYPE_CHECKING:
    from kvbench.methods.base import KVMethod, Selection
    from kvbench.models.loading import LoadedModel


class GenerationContext:
    def __init__(
        self,
        loaded: LoadedModel,
        method: KVMethod,
        budget: ResolvedBudget,
        *,
        profile: Profile,
        capacity: int,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.spec = loaded.spec
        self.method = method
        self.budget = budget
        self.profile = profile
        device = torch.device(self.spec.device)
        self.clock = Clock(device)
        self.telemetry = Telemetry(self.spec.n_layers, self.clock)
        dtype = next(self.model.parameters()).dtype
        self.store = KVStore(
            self.spec.n_layers,
            self.spec.n_kv_heads,
            self.spec.head_dim,
            dtype=dtype,
            device=device,
            offload=method.offload,
            capacity=capacity,
        )

    # ------------------------------------------------------------------ model
    def forward(self, input_ids: torch.Tensor, *, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[1, vocab]`` of the last of ``input_ids`` (``[1, t]``), placed at positions
        ``start..start+t-1`` or at explicit ``positions`` (``[t]``; reuse methods recompute scattered tokens)."""
        t = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(start, start + t, device=input_ids.device)
        out = self.model(input_ids=input_ids, position_ids=positions.view(1, t), use_cache=False, logits_to_keep=1)
        return out.logits[:, -1, :]

    # ------------------------------------------------------------------ attention
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        if query.shape[0] != 1:
            raise ConfigError("kvbench generates with batch size 1", "run one prompt at a time")
        layer = module.layer_idx
        kv = self.store[layer]
        past = kv.n
        t = query.shape[2]
        kv.append(key[0], value[0])
        if past == 0:
            out = attention.dense(module, query, key, value, scaling)
            self.method.on_prefill(layer, query, key, value, kv)
            return out
        if t > 1:
            if self.method.family not in ("dense", "reuse"):
                raise ConfigError(
                    f"method {self.method.name} does not support extending a prefilled cache with several tokens",
                    "feed extra prompt tokens one at a time (decode steps)",
                )
            query_positions = torch.arange(kv.seen - t, kv.seen)
            return attention.with_past(query, kv.keys, kv.values, kv.positions, query_positions, scaling)
        return self._decode(module, layer, query, kv, scaling)

    def _decode(self, module: torch.nn.Module, layer: int, query: torch.Tensor, kv, scaling: float) -> torch.Tensor:
        # host-side timers (no device sync, so they never serialise a CUDA pipeline)
        started = time.perf_counter()
        selection = None if layer in self.method.dense_layers else self.method.select(layer, query, kv)
        selected_at = time.perf_counter()
        self.telemetry.select_s += selected_at - started
        if selection is None or selection.attended == kv.n:
            # Nothing left out (slots are unique): the dense path, bit-identical to ``full``.
            keys, values = kv.keys, kv.values
            out = attention.dense(module, query, keys[None], values[None], scaling)
            attended = kv.n
        else:
            keys, values = kv.gather(selection.slots, selection.cached)
            self.telemetry.fetch_s += time.perf_counter() - selected_at
            out = attention.selected(query, keys, values, scaling)
            attended = selection.attended
        probs = attention.probabilities(query, keys, scaling) if self.method.needs_attention_probs else None
        self.method.after_attention(layer, query, selection, kv, probs)
        recall = self._recall(query, selection, kv, scaling) if self.profile.recall else None
        self.telemetry.record_decode(layer, attended, kv.seen, recall)
        return out

    def _recall(self, query: torch.Tensor, selection: Selection | None, kv, scaling: float) -> float | None:
        if selection is None or selection.selected is None or selection.candidates is None:
            return None
        k = selection.selected.shape[1]
        if k == 0:
            return None
        start = self.clock.now()
        reference = exact_topk(
            query,
            kv.keys,
            selection.candidates,
            k,
            group=self.spec.group,
            per_query_head=selection.rows == self.spec.n_heads and self.spec.group > 1,
            rule=self.profile.recall_rule,
            scale=scaling,
        )
        hit = torch.zeros(reference.shape[0], kv.n, dtype=torch.bool, device=reference.device)
        hit.scatter_(1, reference, True)
        found = hit.gather(1, selection.selected.to(reference.device)).sum(dim=1).float() / k
        value = float(found.mean())
        self.telemetry.excluded_s += self.clock.now() - start
        return value

    # ------------------------------------------------------------------ silent-failure guard
    def _compressing_layers(self) -> list[int]:
        dense = set(self.method.dense_layers)
        return [layer for layer in range(self.spec.n_layers) if layer not in dense]

    def check_after_prefill(self) -> None:
        self.telemetry.kept_after_prefill = self.store.held_tokens()
        self.telemetry.kv_bytes_after_prefill = self.store.nbytes()
        if self.method.family != "eviction" or not self.budget.compresses:
            return
        lazy = [
            layer
            for layer in self._compressing_layers()
            if self.store[layer].n >= self.store[layer].seen > self.budget.sink + self.budget.layer_budget(layer)
        ]
        if lazy:
            raise CompressionNotApplied(
                f"method {self.method.name} was asked to keep {self.budget.total} of {self.budget.context} tokens "
                f"but layer(s) {lazy[:5]} kept all of them",
                "this is a bug in the method; report it with the run's config.yaml",
            )

    def check_after_first_step(self) -> None:
        if self.method.family != "retrieval" or not self.budget.compresses:
            return
        lazy = [
            layer
            for layer in self._compressing_layers()
            if self.telemetry.attended[layer] and self.telemetry.attended[layer][0] >= self.telemetry.available[layer][0]
        ]
        if lazy:
            raise CompressionNotApplied(
                f"method {self.method.name} was asked to attend {self.budget.total} of {self.budget.context} prompt "
                f"tokens but layer(s) {lazy[:5]} attended all of them",
                "this is a bug in the method; report it with the run's config.yaml",
            )
