"""The state of one generation: model, method, store, budget and telemetry.

The context drives the model layer by layer (:class:`~kvbench.engine.driver.ModelDriver`) with
explicit positions: :meth:`GenerationContext.run_prefill` runs a prompt under a
:class:`~kvbench.engine.prefill.PrefillPlan`, :meth:`GenerationContext.forward` runs new tokens
(decode steps). :meth:`GenerationContext.attend` is called by the registered attention function for
every layer of every pass: during a prefill it hands the layer's Q/K/V to the plan; at a decode step
it appends the new K/V, asks the method for a selection, gathers it through the store and records
what was attended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from kvbench.budget import ResolvedBudget
from kvbench.engine import attention
from kvbench.engine.driver import ModelDriver
from kvbench.engine.recall import attended_recall, exact_topk
from kvbench.engine.settings import EngineSettings
from kvbench.errors import CompressionNotApplied, ConfigError
from kvbench.kv.store import KVStore
from kvbench.profile import Profile
from kvbench.telemetry import Clock, Telemetry

if TYPE_CHECKING:
    from kvbench.engine.decode import StaticDecoder
    from kvbench.engine.prefill import PrefillPlan
    from kvbench.engine.prefill_cache import PrefillEntry, PrefillSharing
    from kvbench.engine.protocol import KVMethod, QueryStatistic, Selection
    from kvbench.models.loading import LoadedModel
    from kvbench.requests import Segment


class GenerationContext:
    def __init__(
        self,
        loaded: LoadedModel,
        method: KVMethod,
        budget: ResolvedBudget,
        *,
        profile: Profile,
        capacity: int,
        engine: EngineSettings | None = None,
        sharing: PrefillSharing | None = None,
    ) -> None:
        self.loaded = loaded
        self.engine = engine or EngineSettings()
        self.sharing = sharing  # the run's shared dense prefills (kvbench.engine.prefill_cache), or None
        self.model = loaded.model
        self.spec = loaded.spec
        self.method = method
        self.budget = budget
        self.profile = profile
        self.capacity = capacity  # tokens the store holds: prompt plus generation
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
            resident=method.dense_layers,
        )
        self.driver = ModelDriver(self.model)
        self.plan: PrefillPlan | None = None
        self._positions: torch.Tensor | None = None  # positions of the rows in the running layer
        self._replaying: PrefillEntry | None = None  # the shared prefill being installed
        self._statistic_s = 0.0  # seconds its statistics took when it was made (the ones read)
        self.next_position = 0  # where the next token goes (the prompt's length after its prefill)
        self._decoder: StaticDecoder | None = None  # the static decode step (engine.decode=static)
        self.decoder_active: StaticDecoder | None = None  # set while a static step runs module layers
        self._counted = False  # a dynamic step of a static method: the store already counts its token

    # ------------------------------------------------------------------ model
    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor, after_layer=None) -> torch.Tensor:
        """Run every decoder layer on ``hidden`` (rows at ``positions``); ``after_layer(i)`` may return
        indices of the rows that stay active."""
        rotary = self.driver.rotary(hidden, positions.to(hidden.device))
        for layer in range(self.driver.n_layers):
            self._positions = positions
            if self.plan is not None:
                self.plan.active = positions
                self.plan.before_layer(layer)
            cut_rows = self.plan.rows_after_attention if self.plan is not None and self.plan.cuts_in_layer else None
            if cut_rows is not None:
                hidden, cut = self.driver.layer_cut(layer, hidden, rotary, positions.to(hidden.device), cut_rows)
            else:
                hidden, cut = self.driver.layer(layer, hidden, rotary, positions.to(hidden.device)), False
            keep = after_layer(layer) if after_layer is not None else None
            if keep is not None:
                keep = keep.to(hidden.device)
                if not cut:  # (a layer that cut its rows itself already holds only the kept ones)
                    hidden = hidden.index_select(1, keep)
                positions = positions[keep.to(positions.device)]
                cos, sin = rotary
                rotary = (cos.index_select(1, keep), sin.index_select(1, keep))
        self._positions = None
        return hidden

    def prefill(
        self,
        input_ids: torch.Tensor,
        segments: tuple[Segment, ...] | None,
        check: Callable[[PrefillPlan], None] | None = None,
    ) -> torch.Tensor:
        """Prefill the prompt ``input_ids`` ``[n]`` for the method (inside ``activate(self)``); returns the
        last token's logits ``[1, vocab]`` and records ``telemetry.prefill_s`` and ``prefill_shared``.

        When the run shares prefills (``self.sharing``: :mod:`kvbench.engine.prefill_cache`) and the method's prefill is
        the dense one, the K/V come from the cache (computed now on a miss) and are installed by
        :meth:`replay_prefill`; ``prefill_s`` is then the entry's measured dense time plus its
        statistics' time plus the replay's (the module's timing rule). Otherwise the method's own plan
        runs (``check`` may refuse it before it runs), timed as it goes. Cache lookups, loads and stores
        are outside ``prefill_s``.
        """
        from kvbench.engine import prefill_cache

        clock, tele = self.clock, self.telemetry
        self.next_position = int(input_ids.numel())
        sharing = self.sharing
        if sharing is None or not self.method.shares_prefill:
            start = clock.now()
            plan = self.method.prefill_plan(self, input_ids, segments)
            if check is not None:
                check(plan)
            logits = self.run_prefill(plan)
            tele.prefill_s = clock.now() - start
            tele.prefill_plan = plan.telemetry()
            tele.prefill_shared = False
            return logits
        stats, cache = tuple(self.method.prefill_statistics()), sharing.cache
        key = cache.key(self.loaded, input_ids)
        entry = cache.get(key, stats, torch.device(self.spec.device))
        tele.prefill_shared = entry is not None
        if entry is None:  # also compute what the sweep's later methods will read of this prompt
            later = sharing.anticipated(self, input_ids.numel())
            entry = prefill_cache.capture(self, input_ids, stats + tuple(s for s in later if s not in stats))
            cache.put(key, entry)
        start = clock.now()
        logits = self.replay_prefill(entry)
        tele.prefill_s = entry.dense_s + self._statistic_s + clock.now() - start
        return logits

    def replay_prefill(self, entry: PrefillEntry) -> torch.Tensor:
        """Install a shared dense prefill: per layer, append its K/V to the store and call the method's
        ``on_prefill`` as :class:`~kvbench.engine.prefill.DensePrefill` does (without the queries: the
        statistics the method reads come from the entry, see :meth:`prefill_statistic`); returns the
        entry's last-token logits."""
        self._replaying, self._statistic_s = entry, 0.0
        positions = torch.arange(entry.tokens)
        try:
            for layer in range(self.spec.n_layers):
                kv = self.store[layer]
                if kv.n:
                    raise RuntimeError(f"a shared prefill found layer {layer} already holding {kv.n} tokens")
                key, value = entry.keys[layer], entry.values[layer]
                kv.append(key[0], value[0], positions)
                self.method.on_prefill(layer, None, key, value, kv)
        finally:
            self._replaying = None
        return entry.logits.clone()

    def prefill_statistic(
        self, stat: QueryStatistic, layer: int, query: torch.Tensor | None, key: torch.Tensor
    ) -> torch.Tensor:
        """``stat`` of ``layer``: from the shared prefill being replayed (its time then is credited to this
        prefill), else computed now from ``query`` and ``key``."""
        entry = self._replaying
        if entry is None:
            if query is None:
                raise RuntimeError(f"method {self.method.name} asked for {stat.label} without the prefill's queries")
            return stat.compute(query, key)
        if stat not in entry.stats:
            raise RuntimeError(
                f"method {self.method.name} reads {stat.label} in on_prefill but its "
                "prefill_statistics() does not declare it, so a shared prefill lacks it"
            )
        self._statistic_s += entry.stat_s[stat][layer]
        return entry.stats[stat][layer]

    def run_prefill(self, plan: PrefillPlan) -> torch.Tensor:
        """Prefill under ``plan``; returns the logits ``[1, vocab]`` of the prompt's last token."""
        self.plan = plan
        try:
            hidden = self.driver.embed(plan.input_ids.view(1, -1).to(self.driver.model.device))
            hidden = self._layers(hidden, plan.positions, after_layer=plan.after_layer)
        finally:
            self.plan = None
        return self.driver.logits(hidden)

    def forward(
        self, input_ids: torch.Tensor, *, start: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[1, vocab]`` of the last of ``input_ids`` (``[1, t]``) appended to the held cache,
        placed at positions ``start..start+t-1`` or at explicit ``positions`` (``[t]``). One token at the
        next position is a static decode step (``engine.decode=static``)."""
        t = input_ids.shape[1]
        if t == 1 and positions is None and self.engine.decode == "static":
            self.next_position = start
            return self.decoder().step(int(input_ids.reshape(-1)[0]), timed=False)  # (the caller times it)
        if positions is None:
            positions = torch.arange(start, start + t)
        self._counted = t == 1 and self.method.static_decode
        if self._counted:  # the static methods' contract: the step's token counted before their hooks
            position = int(positions[0])
            for kv in self.store.layers:
                kv.reserve(1)
                kv.n += 1
                kv.seen = max(kv.seen, position + 1)
            self.method.before_step(self)
        try:
            hidden = self.driver.embed(input_ids)
            logits = self.driver.logits(self._layers(hidden, positions.cpu()))
        finally:
            self._counted = False
        self.next_position = int(positions.max()) + 1
        return logits

    def decoder(self, steps: int | None = None) -> StaticDecoder:
        """This generation's static decode step, made at its first use with room for ``steps`` more tokens
        (default: what the context's capacity leaves)."""
        from kvbench.engine.decode import StaticDecoder

        if self._decoder is None:
            room = self.capacity - max(layer.n for layer in self.store.layers)
            self._decoder = StaticDecoder(self, self.engine, max(steps or 0, room, 1))
        return self._decoder

    # ------------------------------------------------------------------ attention
    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        if query.shape[0] != 1:
            raise ConfigError("kvbench generates with batch size 1", "run one prompt at a time")
        # an int on transformers' attention modules (nn.Module's attribute typing knows only submodules)
        layer = cast(int, module.layer_idx)
        if self.plan is not None:
            return self.plan.attend(layer, module, query, key, value, scaling)
        if self.decoder_active is not None:
            return self.decoder_active.attend(layer, query, key, value)
        kv = self.store[layer]
        positions = self._positions
        t = query.shape[2]
        if kv.n == 0:
            raise RuntimeError("a decode step ran before any prefill")
        if self._counted:  # (a static method on the dynamic step: the token was counted before the step)
            assert positions is not None
            kv.write_slot(kv.n - 1, key[0], value[0], positions.to(kv.device))
        else:
            kv.append(key[0], value[0], positions)
        if t > 1:
            if not self.method.extends_with_many_tokens:
                raise ConfigError(
                    f"method {self.method.name} does not support extending a prefilled cache with several tokens",
                    "feed extra prompt tokens one at a time (decode steps)",
                )
            assert positions is not None  # (set by _layers, which runs the model's layers)
            keys, values = kv.held()
            return attention.with_past(query, keys, values, kv.positions, positions, scaling)
        return self._decode(module, layer, query, kv, scaling)

    def dynamic_decode(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, position: int
    ) -> torch.Tensor:
        """A layer of a method without a static step (decode-time eviction) inside a static decoder's
        step: the earlier per-layer code, with the position given by the host."""
        kv = self.store[layer]
        kv.append(key[0], value[0], torch.tensor([position]))
        return self._decode(self.driver.layers[layer].self_attn, layer, query, kv, scaling)

    def profile_step(self, layer: int, query: torch.Tensor, selection: Selection | None, kv, scaling: float) -> None:
        """``profile.recall`` / ``profile.selection_digest`` of a static step's layer (eager: host reads)."""
        if self.profile.selection_digest:
            self._digest_step(layer, selection, kv)
        if selection is not None and selection.candidates is None and self.profile.recall_rule != "attended":
            selection = replace(selection, candidates=self.method.recall_candidates(kv))
        if selection is not None and selection.valid is not None:  # padded entries attend nothing
            filler = torch.full_like(selection.slots, kv.n - 1)  # (the current token: attended anyway)
            selection = replace(selection, slots=torch.where(selection.valid, selection.slots, filler), valid=None)
        recall = self._recall(layer, query, selection, kv, scaling) if self.profile.recall else None
        if recall is not None:
            self.telemetry.recall[layer].append(float(recall))

    def _decode(self, module: torch.nn.Module, layer: int, query: torch.Tensor, kv, scaling: float) -> torch.Tensor:
        if self.method.static_decode:  # (engine.decode=dynamic: counters made from the host's, every step)
            bucket = self.engine.bucket_tokens
            length = torch.full((1,), kv.n, dtype=torch.long, device=kv.device)
            kv.bind(length, length - 1, min(kv.capacity, -(-kv.n // bucket) * bucket))
        # host-side timers (no device sync, so they never serialise a CUDA pipeline)
        started = time.perf_counter()
        selection = None if layer in self.method.dense_layers else self.method.select(layer, query, kv)
        selected_at = time.perf_counter()
        self.telemetry.select_s += selected_at - started
        if selection is None or (selection.valid is None and selection.attended == kv.n):
            # Nothing left out (slots are unique): the dense path, the static step's kernel on the same
            # bucket of slots (bit-identical to ``full``)
            keys, values = kv.held()  # (an offloaded layer's budget covers it: all of it crosses)
            prob_valid = None
            if kv.offload:
                out = attention.selected(query, keys, values, scaling)
            else:
                bucket = self.engine.bucket_tokens
                kv.bucket_end = min(kv.capacity, -(-kv.n // bucket) * bucket)
                length = torch.full((1,), kv.n, dtype=torch.long, device=kv.device)
                mask = attention.length_mask(kv.iota(kv.bucket_end), length, query.dtype)
                keys_b, values_b = kv.bucket()
                out = attention.decode_dense(
                    query, keys_b, values_b, mask, scaling, self.engine.decode_attention, self.engine.split_tokens
                )
                if self.method.static_decode:  # (its after_attention reads the static step's bucket)
                    keys, prob_valid = keys_b, (kv.iota(kv.bucket_end) < length).expand(keys_b.shape[0], -1)
            attended = kv.n
        else:
            keys, values = kv.gather(selection.slots, selection.cached)
            self.telemetry.fetch_s += time.perf_counter() - selected_at
            valid = selection.valid
            mask = None
            if valid is not None:
                zero = torch.zeros((), dtype=query.dtype, device=query.device)
                mask = attention.valid_mask(valid, zero, torch.full_like(zero, float("-inf")))
            out = attention.selected(query, keys, values, scaling, mask)
            attended = selection.attended if valid is None else float(valid.sum()) / valid.shape[0]
            prob_valid = valid
        probs = attention.probabilities(query, keys, scaling, prob_valid) if self.method.needs_attention_probs else None
        self.method.after_attention(layer, query, selection, kv, probs)
        recall = self._recall(layer, query, selection, kv, scaling) if self.profile.recall else None
        if self.profile.selection_digest:
            self._digest_step(layer, selection, kv)
        self.telemetry.record_decode(layer, attended, kv.seen, recall)
        return out

    def _digest_step(self, layer: int, selection: Selection | None, kv) -> None:
        """Fold the positions this step attends into the selection digest (``profile.selection_digest``;
        untimed). A dense step (nothing left out) folds every held position."""
        start = self.clock.now()
        held = kv.positions  # [kv_heads or query heads, n]
        if selection is None or (selection.valid is None and selection.attended == kv.n):
            attended = held
        else:
            rows = held if held.shape[0] == selection.rows else held.repeat_interleave(self.spec.group, dim=0)
            attended = rows.gather(1, selection.slots.to(rows.device))
            if selection.valid is not None:  # a fixed-shape selection's padding attends nothing
                attended = attended[selection.valid.to(rows.device)].view(selection.rows, -1)
        self.telemetry.digest_positions("step", layer, attended)
        self.telemetry.excluded_s += self.clock.now() - start

    def _recall(self, layer: int, query: torch.Tensor, selection: Selection | None, kv, scaling: float) -> float | None:
        """Recall of this step under ``profile.recall_rule`` (definitions: :mod:`kvbench.telemetry`).

        ``attended`` (default): every prompt token the step attends against the exact top-B of each
        query head, ``B = sink + the layer's budget`` (:func:`~kvbench.engine.recall.attended_recall`).
        ``softmax_sum`` / ``logit_sum`` / ``max``: the earlier rule, kept for old runs — only the part
        the method *chose* against the exact top-k of its candidates, ``k`` = the number it chose, per
        query head for a per-query-head selection, else per KV head under that GQA rule.
        A layer that attends everything by design (``selection is None``) has no recall, nor has a selection
        that ranked nothing (``selected is None``: StreamingLLM's sliding window).
        """
        if selection is None or selection.selected is None:  # (StreamingLLM's window ranks nothing)
            return None
        rule = self.profile.recall_rule
        start = self.clock.now()
        if rule == "attended":
            b = self.budget.sink + self.budget.layer_budget(layer)
            value = float(attended_recall(query, kv.keys, kv.positions, selection.slots, self.budget.context, b).mean())
            self.telemetry.recall_b = b
        else:
            if selection.selected is None or selection.candidates is None or selection.selected.shape[1] == 0:
                return None
            k = selection.selected.shape[1]
            reference = exact_topk(
                query,
                kv.keys,
                selection.candidates,
                k,
                group=self.spec.group,
                per_query_head=selection.rows == self.spec.n_heads and self.spec.group > 1,
                rule=rule,
                scale=scaling,
            )
            hit = torch.zeros(reference.shape[0], kv.n, dtype=torch.bool, device=reference.device)
            hit.scatter_(1, reference, True)
            found = hit.gather(1, selection.selected.to(reference.device)).sum(dim=1).float() / k
            value = float(found.mean())
        self.telemetry.excluded_s += self.clock.now() - start
        return value

    # ------------------------------------------------------------------ silent-failure guard
    def compressing_layers(self) -> list[int]:
        """Layers the method is asked to compress (all but its dense layers)."""
        dense = set(self.method.dense_layers)
        return [layer for layer in range(self.spec.n_layers) if layer not in dense]

    def check_after_prefill(self) -> None:
        self.store.check_written()  # no slot the decode steps attend may be a never-written one
        self.telemetry.kept_after_prefill = self.store.held_tokens()
        self.telemetry.kv_bytes_after_prefill = self.store.nbytes()
        if self.profile.selection_digest:
            for layer in range(self.spec.n_layers):
                self.telemetry.digest_positions("kept", layer, self.store[layer].positions)
        self.method.check_after_prefill(self)

    def check_after_first_step(self) -> None:
        self.method.check_after_first_step(self)  # (its own words first: "attended all of them")
        self.check_attended()

    def check_attended(self) -> None:
        """Fail the run when a compressing layer attended more at the first decode step than its budget
        allows (:meth:`KVMethod.attend_limit`): a budget the report names must be the one that ran."""
        if not (self.method.needs_budget and self.budget.compresses):
            return
        attended = self.telemetry.attended
        firsts = [(layer, attended[layer][0]) for layer in self.compressing_layers() if attended[layer]]
        limits = [(layer, count, self.method.attend_limit(self, layer)) for layer, count in firsts]
        over = [(layer, count, limit) for layer, count, limit in limits if count > limit]
        if over:
            layer, count, limit = over[0]
            raise CompressionNotApplied(
                f"method {self.method.name} attended {count:g} tokens at layer {layer}'s first decode step, more "
                f"than its budget allows ({limit}: {self.budget.source}, sink {self.budget.sink}); "
                f"{len(over)} layer(s) over",
                "this is a bug in the method; report it with the run's config.yaml",
            )
