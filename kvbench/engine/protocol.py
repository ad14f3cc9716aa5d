"""The KV-method protocol: what the engine asks of a method (one small class of policy per method).

It lives in the engine, which owns the model, the store and the decode step; methods (``methods/``)
subclass it and import from the engine, never the other way (``tests/test_layers.py`` walks the
imports).

Why this shape. The three families of KV methods differ in *when* they decide and *where* the
tokens live, not in how attention is computed:

1. **eviction** (StreamingLLM, H2O, SnapKV, PyramidKV) decides after the dense prefill of a layer which
   tokens to keep (:meth:`KVMethod.on_prefill` calls ``kv.keep``), and, for H2O, keeps evicting
   during decode from the attention it observes (:meth:`KVMethod.after_attention`). The store
   forgets the rest, so held bytes really shrink.
2. **retrieval** (Oracle, SparQ, InfLLM, Quest, PQCache, ClusterKV) keeps every token, builds an
   index at prefill (:meth:`KVMethod.on_prefill`), and at each decode step returns a
   :class:`Selection` per head from :meth:`KVMethod.select`; the store fetches those tokens,
   through its host tier and block cache when the method offloads.
3. **reuse** (CacheBlend, full KV reuse, prefix caching) builds the prefill cache from stored
   per-chunk caches instead of a dense prefill: :meth:`KVMethod.prepare` makes sure the chunks' K/V
   exist (precomputed outside the measured TTFT), and :meth:`KVMethod.prefill_plan` returns a
   :class:`~kvbench.engine.prefill.PrefillPlan` that installs re-rotated cached K/V layer by layer and
   recomputes a chosen subset of rows, in the same engine and the same store.

The engine (``kvbench.engine``) is the only code that drives the model: it runs the decoder layers
itself with explicit positions and calls these hooks from an attention function registered with
transformers' ``AttentionInterface`` and bound to the active generation, so any
Llama/Mistral/Qwen/GLM-family model works unchanged. A method never moves K/V bytes itself (the store
counts them) and never times itself (telemetry does).

Each family carries its own rules as class attributes and methods, so the engine never compares
family names: whether it needs a budget (:attr:`KVMethod.needs_budget`), how its budget reads in a
table (:meth:`KVMethod.budget_label`), whether it can extend a held cache by several tokens at once
(:attr:`KVMethod.extends_with_many_tokens`), and its silent-failure guard
(:meth:`KVMethod.check_after_prefill`, :meth:`KVMethod.check_after_first_step`): a method asked to
compress that kept or attended everything fails the run.

Per-sample state lives on the method object between :meth:`KVMethod.start` and the end of the
sample; the engine calls ``start`` before every prompt. When several questions share one compressed
context (:mod:`kvbench.engine.conversation`), the engine rolls the store back after each answer and
the method's own state with it: :meth:`KVMethod.snapshot` / :meth:`KVMethod.restore`.

Within a sweep, methods whose prefill is the stock dense one (:attr:`KVMethod.shares_prefill`) take
it from a cache shared by the sweep's methods (:mod:`kvbench.engine.prefill_cache`): the engine
installs the cached K/V layer by layer and calls :meth:`KVMethod.on_prefill` as a dense prefill
would, but without the prefill's queries. A method whose ``on_prefill`` reads the queries declares
what it computes from them (:class:`QueryStatistic`, :meth:`KVMethod.prefill_statistics`) and reads
it through :meth:`KVMethod.query_statistic`; the shared prefill computes it once while the queries
exist.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvbench.budget import BudgetConfig, MethodBudgetDefaults, ResolvedBudget, full_budget, resolve_budget
from kvbench.params import Params, describe, parse

if TYPE_CHECKING:
    from kvbench.engine.context import GenerationContext
    from kvbench.engine.prefill import PrefillPlan
    from kvbench.kv.store import LayerKV
    from kvbench.requests import Segment


@dataclass(frozen=True)
class QueryStatistic:
    """A per-layer tensor that ``on_prefill`` computes from the layer's prefill queries and keys.

    ``function(query [H, s, d], key [H_kv, s, d], *args, **dict(kwargs))`` (post-RoPE, no batch axis)
    must be a module-level function of its inputs only: the statistic is a cache key (two methods
    asking for the same function with the same arguments share one computation) and a shared prefill
    computes it without the method. Examples: SnapKV's observation-window votes, H2O's accumulated
    attention, InfLLM's local attention received.
    """

    function: Callable[..., torch.Tensor]
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def compute(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """The statistic of one layer from its ``query`` ``[1, H, s, d]`` and ``key`` ``[1, H_kv, s, d]``."""
        return self.function(query[0], key[0], *self.args, **dict(self.kwargs))

    @property
    def label(self) -> str:
        """A readable name (``window_votes(32, 0.125)``)."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.function.__name__}({', '.join(parts)})"


@dataclass
class Selection:
    """What one decode step of one layer attends.

    ``slots``: ``[rows, k]`` sorted store slots, rows = KV heads (one selection shared by the query
    heads of a group) or query heads (one selection per query head; row ``h`` reads KV head
    ``h // group``). It includes sinks, the local window and the current token.
    ``selected``: ``[rows, k_sel]`` the part the method *chose* among ``candidates`` (for recall of the
    exact top-k); ``candidates``: 1-D slots it chose from (``None`` when the method did not rank);
    ``cached``: like ``slots``, true where the method keeps the token on the device itself (a
    cluster cache), so the store counts a hit instead of a fetch.
    ``valid``: like ``slots``, true where an entry is attended: a selection of fixed shape (the static
    decode step's) pads the entries it does not use (they point at any held slot and are masked);
    ``None``: every entry is attended.
    """

    slots: torch.Tensor
    selected: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    cached: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.slots.shape[0])

    @property
    def attended(self) -> int:
        return int(self.slots.shape[1])


class KVMethod:
    """Base class: a method that attends everything (``full``). Subclasses override hooks."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = "dense"  # dense | eviction | retrieval | reuse (a label; rules live in the class)
    #: the method compresses and needs ``budget.token_ratio`` or ``budget.tokens``
    needs_budget: ClassVar[bool] = False
    #: a prefilled cache may be extended by several tokens in one pass (causal by position)
    extends_with_many_tokens: ClassVar[bool] = True
    #: the method's parameters (``method.<key>``), declared in the method's own module (the engine
    #: knows only the empty base; every shipped method names its own); an instance, parsed and validated
    #: from the config, is ``self.params``
    Params: ClassVar[type[Params]] = Params
    #: "(C)" eligibility; sink size and local-window share for a method whose ``Params`` do not
    #: declare ``sink`` / ``local_fraction`` (``budget.sink`` / ``budget.local`` override all of them)
    budget_defaults: ClassVar[MethodBudgetDefaults] = MethodBudgetDefaults()
    #: the method needs the decode step's attention probabilities (H2O's accumulated scores)
    needs_attention_probs: ClassVar[bool] = False
    #: the method's decode hooks fit the static decode step (:mod:`kvbench.engine.decode`): ``select`` and
    #: ``after_attention`` read lengths from the store's device counters (``kv.length``, ``kv.bucket_end``)
    #: rather than from ``kv.n``, issue the same ops at every step of one :meth:`decode_key`, read nothing
    #: back to the host and change no Python state (host-side work goes in :meth:`before_step`). A method
    #: that evicts during decode (H2O) keeps the earlier per-layer step (``False``); StreamingLLM slides its
    #: window by a device-side selection instead of evicting, and is static.
    static_decode: ClassVar[bool] = True

    def __init__(self, cfg: Mapping[str, Any] | None = None) -> None:
        """``cfg``: the method's parameters (its config node without ``name``); an unknown key, a wrong
        type or a value out of range raises :class:`~kvbench.errors.ConfigError`."""
        self.params = parse(self.Params, cfg, owner=f"method {self.name}", prefix="method.")
        self._ctx: GenerationContext | None = None

    @property
    def ctx(self) -> GenerationContext:
        """The generation this method serves, set by :meth:`start`; every hook runs after that, so reading
        it earlier is a bug (``started`` tells whether it is set)."""
        if self._ctx is None:
            raise RuntimeError(f"method {self.name} was used before start(ctx)")
        return self._ctx

    @ctx.setter
    def ctx(self, ctx: GenerationContext) -> None:
        self._ctx = ctx

    @property
    def started(self) -> bool:
        """Whether :meth:`start` has given the method a generation (``ctx``)."""
        return self._ctx is not None

    # ------------------------------------------------------------------ configuration
    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers that always attend everything (e.g. Quest/ClusterKV leave layers 0-1 dense)."""
        return ()

    @property
    def offload(self) -> bool:
        """Whether middle tokens live in the host tier (retrieval methods have an ``offload`` parameter)."""
        return False

    def defaults(self) -> MethodBudgetDefaults:
        base = self.budget_defaults
        return MethodBudgetDefaults(
            sink=getattr(self.params, "sink", base.sink),
            local_fraction=getattr(self.params, "local_fraction", base.local_fraction),
            compensable=base.compensable,
        )

    def resolve_budget(self, budget: BudgetConfig, context: int, capacity: int, n_layers: int) -> ResolvedBudget:
        """Concrete token counts for a prompt of ``context`` tokens in a cache of at most ``capacity``
        (PyramidKV adds per-layer budgets). A method that does not compress keeps everything."""
        if not self.needs_budget:
            return full_budget(context)
        return resolve_budget(budget, context, self.defaults(), self.name, capacity)

    def budget_label(self, budget: BudgetConfig) -> str:
        """How this run's budget reads in a table: ``ratio 0.1``, ``256 tokens``, ``, comm 1/128`` with
        an extra-communication budget, `` (C)`` when a dropping method was compensated for it."""
        if not self.needs_budget:
            return "full cache"
        size = f"{budget.tokens} tokens" if budget.tokens is not None else f"ratio {budget.token_ratio:g}"
        if budget.comm_ratio:
            inverse = 1 / float(budget.comm_ratio)
            size += (
                f", comm 1/{round(inverse)}"
                if abs(inverse - round(inverse)) < 1e-6
                else f", comm {budget.comm_ratio:g}"
            )
        return size + (" (C)" if budget.compensate and self.defaults().compensable else "")

    def describe(self) -> dict[str, Any]:
        """The method's effective settings, recorded with every sample."""
        return {"name": self.name, "family": self.family, **describe(self.params)}

    # ------------------------------------------------------------------ lifecycle
    def start(self, ctx: GenerationContext) -> None:
        """Reset per-sample state; ``ctx.budget`` and ``ctx.store`` are ready."""
        self.ctx = ctx

    def prepare(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> dict[str, Any]:
        """Work done before the request's clock starts (reuse: precompute missing chunk caches, as a
        store would hold them from earlier requests); returns figures recorded apart from TTFT."""
        return {}

    def prefill_plan(
        self, ctx: GenerationContext, input_ids: torch.Tensor, segments: tuple[Segment, ...] | None
    ) -> PrefillPlan:
        """How the prompt ``input_ids`` ``[n]`` is prefilled: a dense prefill unless a reuse method says
        otherwise (called inside the measured TTFT)."""
        from kvbench.engine.prefill import DensePrefill

        return DensePrefill(ctx, input_ids, torch.arange(input_ids.numel()))

    @property
    def shares_prefill(self) -> bool:
        """Whether the method may start from a dense prefill computed once for the sweep's methods
        (:mod:`kvbench.engine.prefill_cache`) instead of its own: true when its prefill is the stock
        dense plan, whose K/V and logits do not depend on the method. A method that changes its
        prefill (a reuse plan, or work timed against the prefill such as PQCache's overlapped
        k-means) returns false, and its TTFT is always measured on its own prefill."""
        return type(self).prefill_plan is KVMethod.prefill_plan

    def prefill_statistics(self) -> tuple[QueryStatistic, ...]:
        """The statistics of the prefill queries that :meth:`on_prefill` reads through
        :meth:`query_statistic` (called after :meth:`start`); a method that reads none returns ``()``,
        and a shared prefill then hands its ``on_prefill`` no queries (``query=None``)."""
        return ()

    def query_statistic(
        self, stat: QueryStatistic, layer: int, query: torch.Tensor | None, key: torch.Tensor
    ) -> torch.Tensor:
        """``stat`` of ``layer``: computed now from ``query``/``key`` during the method's own prefill, or
        taken from the shared prefill that computed it (which must be among
        :meth:`prefill_statistics`)."""
        shared = getattr(self._ctx, "prefill_statistic", None)  # (a test's stand-in context has none)
        if shared is not None:
            return shared(stat, layer, query, key)
        assert query is not None, "only a shared prefill hands on_prefill no queries"
        return stat.compute(query, key)

    def after_request(self, ctx: GenerationContext, segments: tuple[Segment, ...] | None) -> None:
        """After the request is answered, outside any measured time (prefix caching may store the prompt)."""

    def release(self) -> None:
        """Free what this request holds (PQCache's k-means threads). The engine calls it after every
        request — generation, teacher forcing, a conversation — answered or failed; idempotent."""

    def on_prefill(
        self, layer: int, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, kv: LayerKV
    ) -> None:
        """After the dense prefill attention of ``layer``: build an index or evict.

        ``query`` is ``[1, q_heads, s, d]``, ``key``/``value`` ``[1, kv_heads, s, d]`` (post-RoPE);
        ``kv`` already holds the ``s`` tokens. From a shared prefill ``query`` is ``None``: what the
        method needs of the queries comes through :meth:`query_statistic`.
        """

    def select(self, layer: int, query: torch.Tensor, kv: LayerKV) -> Selection | None:
        """Tokens to attend at a decode step (``query`` ``[1, q_heads, 1, d]``; ``kv`` holds the
        current token in its last slot). ``None`` attends every held token."""
        return None

    def decode_key(self) -> Any:
        """What, besides the length buckets, fixes the ops of a static decode step: a value that changes only
        when the method's selection changes form (a budget that starts to leave tokens out, a recluster
        epoch). Read on the host before every step (the store's ``n`` already counts the step's token);
        steps with equal keys must issue equal op streams."""
        return ()

    def recall_candidates(self, kv: LayerKV) -> torch.Tensor | None:
        """1-D slots a static selection chose from, for the earlier recall rule (``profile.recall_rule``
        other than ``attended``; eager, host-side): what a dynamic ``select`` put in
        :attr:`Selection.candidates`."""
        return None

    def before_step(self, ctx: GenerationContext) -> None:
        """Host-side work before a decode step (the store's ``n`` already counts the step's token, whose K/V
        the step writes): reclustering, building a completed block. May read ``kv.n`` and issue any ops;
        runs outside a captured graph."""

    def after_attention(
        self, layer: int, query: torch.Tensor, selection: Selection | None, kv: LayerKV, probs: torch.Tensor | None
    ) -> None:
        """Decode bookkeeping after attention; ``probs`` is ``[q_heads, attended]`` when
        :attr:`needs_attention_probs` is set."""

    def telemetry(self) -> dict[str, Any]:
        """Method-specific per-sample figures (e.g. K-means iterations used)."""
        return {}

    # ------------------------------------------------------------------ rollback (multi-query)
    def snapshot(self) -> Any:
        """The per-sample state that decode steps change, copied, for :meth:`restore`.

        The engine takes it right after a shared context's prefill (with the store's own snapshot) and
        restores both after each answer, so the next question finds what the context left. The default
        (nothing) is right for a method whose decode steps change only the store (``full``, the Oracle,
        SparQ, SnapKV, PyramidKV, StreamingLLM's sliding window, the reuse methods); a method that keeps
        decode-time state beside the store (H2O's scores, Quest's page bounds, ClusterKV's clusters,
        InfLLM's blocks, PQCache's codes of new tokens) overrides both. Telemetry counters are not state:
        they keep counting across questions."""
        return None

    def restore(self, state: Any) -> None:
        """Return to what :meth:`snapshot` returned (called after the store was restored)."""

    # ------------------------------------------------------------------ silent-failure guards
    def check_after_prefill(self, ctx: GenerationContext) -> None:
        """Fail the run if the prefill did not do what the method was asked (eviction: kept everything)."""

    def check_after_first_step(self, ctx: GenerationContext) -> None:
        """Fail the run if the first decode step did not do what was asked (retrieval: attended everything)."""

    def attend_limit(self, ctx: GenerationContext, layer: int) -> int:
        """The most tokens one head may attend at ``layer``'s first decode step under a compressing budget:
        the sinks, the layer's budget and the current token. A method whose unit is coarser than a token
        (Quest's pages, InfLLM's blocks) states its own bound; the engine fails a run that attends more
        (:meth:`~kvbench.engine.context.GenerationContext.check_after_first_step`)."""
        budget = ctx.budget
        return budget.sink + budget.layer_budget(layer) + 1
