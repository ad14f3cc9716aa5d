"""One accounting of KV budgets for every method.

Papers state budgets in different currencies: a token ratio ("1/5 of the tokens", PQCache), an
absolute token count ("B = 1024", ClusterKV/Quest/SnapKV), an extra-communication ratio ("1/128 of
the keys' memory", PQCache), sink and local-window sizes, and the "(C)" compensation that gives
KV-dropping methods extra tokens. :func:`resolve_budget` turns these into concrete token counts for
one prompt, so that every method in a comparison attends (or keeps) the same number of tokens.

Accounting (the PQCache authors' code, the headline method of the harness):

* ``s`` is the prompt length. ``sink`` initial tokens are always attended and are *outside* the
  budget (PQCache: 32 sinks; ClusterKV: 16).
* ``B`` is the budget of the other tokens: ``budget.tokens`` when set (absolute, wins), else
  ``floor(token_ratio * (s - sink))``. Sizes are fixed at prefill, as in the PQCache code: as
  generation proceeds, the window slides and the selected share of a growing cache shrinks.
* A budget *covers* the cache when ``sink + B`` is at least the prompt plus the generated tokens
  (``budget.tokens >= prompt + max_new_tokens``): then every method attends everything and is
  token-identical to ``full``. A ``budget.tokens`` larger than that is an error.
* ``B`` splits into a ``local`` window of the most recent tokens (``budget.local``, or
  ``floor(B * local_fraction)`` with the method's fraction; PQCache uses 1/2) and ``select = B - local``
  tokens picked by the method (top-k, heavy hitters, clusters, pages, ...).
* At a decode step a selective method attends ``sink + local + select`` tokens plus the current one.
  (PQCache floors both halves of ``ratio*(s-sink)/2``; giving ``select`` the odd token keeps the
  attended count equal to the budget exactly.)

"(C)" compensation (``budget.compensate=true``, dropping methods only). Offloading methods hold
``B`` tokens' K and V on the device and additionally move ``comm_ratio`` of the keys' bytes, i.e.
``comm_ratio/2`` of the K+V bytes of the middle tokens. Matching bytes, a dropping method may keep
``floor(comm_ratio/2 * (s - sink))`` extra tokens: ``budget_C = (token_ratio + comm_ratio/2) * (s - sink)``.
This is PQCache's "(C)" rule read as byte matching (the paper gives no formula; the alternative
reading ``token_ratio + comm_ratio`` differs by at most ``comm_ratio/2 * s`` tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvbench.errors import BudgetError
from kvbench.params import Params, param


@dataclass(frozen=True)
class BudgetConfig(Params):
    """The user's ``budget.*`` keys, validated but not yet applied to a prompt (their defaults in
    ``conf/config.yaml``)."""

    token_ratio: float | None = param(
        None, "fraction of the prompt's non-sink tokens attended/kept, e.g. 0.1", min=0, max=1, example=0.1
    )
    tokens: int | None = param(None, "absolute non-sink token budget; wins over token_ratio", min=1, example=1024)
    comm_ratio: float = param(
        0.0, "extra communication as a fraction of the keys' bytes, e.g. 0.0078125", min=0, example=0.0078125
    )
    sink: int | None = param(None, "attention-sink tokens (null: the method's default)", min=0, example=32)
    local: int | None = param(None, "recent-window tokens (null: the method's share of the budget)", min=0, example=64)
    compensate: bool = param(False, "'(C)': dropping methods get comm_ratio/2 of the context extra")

    def __post_init__(self) -> None:  # (the ranges a declaration cannot say; also for a direct construction)
        if self.token_ratio is not None and not (0.0 < float(self.token_ratio) <= 1.0):
            raise BudgetError(
                f"budget.token_ratio={self.token_ratio} is outside (0, 1]",
                "use a fraction of the context such as budget.token_ratio=0.1",
            )
        if self.tokens is not None and int(self.tokens) < 1:
            raise BudgetError(f"budget.tokens={self.tokens} must be a positive token count", "e.g. budget.tokens=1024")
        if self.comm_ratio is None or float(self.comm_ratio) < 0 or float(self.comm_ratio) >= 1:
            raise BudgetError(
                f"budget.comm_ratio={self.comm_ratio} must be in [0, 1)", "e.g. budget.comm_ratio=0.0078125 (1/128)"
            )
        for key in ("sink", "local"):
            value = getattr(self, key)
            if value is not None and int(value) < 0:
                raise BudgetError(f"budget.{key}={value} is negative", f"set budget.{key} to 0 or more")

    @classmethod
    def from_mapping(cls, cfg: Any) -> BudgetConfig:
        """The ``budget`` node, parsed and checked: an unknown key, a wrong type or a value out of range is
        one :class:`BudgetError` line naming ``budget.<key>``."""
        from kvbench.errors import ConfigError
        from kvbench.params import parse

        try:
            return parse(cls, dict(cfg or {}), owner="budget", prefix="budget.")  # type: ignore[return-value]
        except BudgetError:
            raise
        except ConfigError as error:
            raise BudgetError(error.message, error.fix) from None

    @property
    def is_set(self) -> bool:
        return self.token_ratio is not None or self.tokens is not None


@dataclass(frozen=True)
class MethodBudgetDefaults:
    """How a method spends a budget when the user does not say."""

    sink: int = 32
    local_fraction: float = 0.5
    compensable: bool = False  # a KV-dropping method that "(C)" applies to


@dataclass(frozen=True)
class ResolvedBudget:
    """Concrete token counts for one prompt of ``context`` tokens."""

    context: int
    sink: int
    local: int
    select: int
    compensation: int = 0
    source: str = ""
    per_layer: tuple[int, ...] | None = field(default=None)
    comm_ratio: float = 0.0  # the extra-communication budget methods derive parameters from (PQ m·b, SparQ r, ...)

    @property
    def budget(self) -> int:
        """Non-sink prompt tokens attended or kept (``local + select``)."""
        return self.local + self.select

    @property
    def total(self) -> int:
        """Prompt tokens attended or kept, sinks included."""
        return self.sink + self.local + self.select

    @property
    def compresses(self) -> bool:
        return self.total < self.context

    def layer_budget(self, layer: int) -> int:
        """Non-sink budget of one layer (uniform unless a method such as PyramidKV set ``per_layer``)."""
        return self.per_layer[layer] if self.per_layer is not None else self.budget

    def with_per_layer(self, per_layer: list[int]) -> ResolvedBudget:
        return ResolvedBudget(
            context=self.context,
            sink=self.sink,
            local=self.local,
            select=self.select,
            compensation=self.compensation,
            source=self.source,
            per_layer=tuple(int(b) for b in per_layer),
            comm_ratio=self.comm_ratio,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["budget"] = self.budget
        data["total"] = self.total
        data["per_layer"] = list(self.per_layer) if self.per_layer is not None else None
        return data


def full_budget(context: int) -> ResolvedBudget:
    """The budget of a method that attends everything."""
    return ResolvedBudget(context=context, sink=0, local=0, select=context, source="full context")


def resolve_budget(
    cfg: BudgetConfig, context: int, defaults: MethodBudgetDefaults, method: str, capacity: int | None = None
) -> ResolvedBudget:
    """Apply ``cfg`` to a prompt of ``context`` tokens for a method with ``defaults``.

    ``capacity`` is the most tokens the cache will hold (prompt + generation; default the prompt).
    A ``budget.tokens`` beyond ``capacity`` covers the prompt: every token is attended, as the papers'
    code does for a sample shorter than its budget (ClusterKV's and Quest's 2048-token budgets on
    LongBench, whose samples vary in length); ``source`` says so. Where every prompt has a known
    length (needle tasks) a budget beyond the shortest is refused before the model loads
    (:mod:`kvbench.validate`). Raises :class:`BudgetError` when no budget is given.
    """
    capacity = max(capacity or context, context)
    if context <= 0:
        raise BudgetError(f"empty prompt for method {method}", "check the task's prompt construction")
    if not cfg.is_set:
        raise BudgetError(
            f"method {method} compresses the KV cache and needs a budget",
            "set budget.token_ratio=0.1 (fraction of the context) or budget.tokens=1024",
        )
    sink = min(int(cfg.sink if cfg.sink is not None else defaults.sink), context)
    room = context - sink
    if cfg.tokens is not None:
        budget = min(int(cfg.tokens), capacity - sink)
        source = f"budget.tokens={int(cfg.tokens)}"
        if int(cfg.tokens) > capacity:
            source += f" covers the context ({context} prompt tokens + {capacity - context} generated): all attended"
    else:
        assert cfg.token_ratio is not None  # a budget is set (checked above) and it is not budget.tokens
        budget = math.floor(float(cfg.token_ratio) * room)
        source = f"budget.token_ratio={cfg.token_ratio} of (s - sink)"
    compensation = 0
    if cfg.compensate and defaults.compensable and cfg.comm_ratio > 0:
        compensation = max(0, min(math.floor(float(cfg.comm_ratio) / 2 * room), capacity - sink - budget))
        budget += compensation
        source += f" + (C) comm_ratio/2={float(cfg.comm_ratio) / 2:g} of (s - sink)"
    if cfg.local is not None:
        local = int(cfg.local)
        if local > budget:
            raise BudgetError(
                f"budget.local={local} exceeds the resolved budget of {budget} tokens (context {context})",
                "lower budget.local or raise the budget",
            )
    else:
        local = math.floor(budget * defaults.local_fraction)
    return ResolvedBudget(
        context=context,
        sink=sink,
        local=local,
        select=budget - local,
        compensation=compensation,
        source=source,
        comm_ratio=float(cfg.comm_ratio),
    )
