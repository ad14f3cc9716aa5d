"""The generation loop: prefill, greedy decode, stop tokens, and teacher-forced scoring.

This is the only code that drives a model. It computes logits for the last position only
(``logits_to_keep=1``): full-vocabulary logits of a 16k-token prompt would take gigabytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, overload

import torch
from torch.profiler import record_function

from kvbench.budget import BudgetConfig, ResolvedBudget
from kvbench.engine.attention import activate
from kvbench.engine.context import GenerationContext
from kvbench.engine.prefill_cache import PrefillSharing
from kvbench.engine.protocol import KVMethod
from kvbench.engine.settings import EngineSettings
from kvbench.errors import ContextTooLongError
from kvbench.models.loading import LoadedModel
from kvbench.profile import Profile
from kvbench.requests import Segment


@dataclass
class Generation:
    """One prompt's output and measurements."""

    tokens: list[int]  # generated ids, the stop token included when one ended the generation
    text: str  # decoded output without the stop token
    stop_reason: str  # "stop" | "length"
    prompt_tokens: int
    budget: ResolvedBudget
    telemetry: dict[str, Any] = field(default_factory=dict)


def _check_length(loaded: LoadedModel, total: int) -> None:
    if total > loaded.spec.max_length:
        raise ContextTooLongError(
            f"prompt plus generation ({total} tokens) exceeds model {loaded.spec.name}'s maximum of "
            f"{loaded.spec.max_length} tokens",
            "shorten the prompt (e.g. lower task.lengths or the task's truncation limit) or use a longer-context model",
        )


def _new_context(
    loaded: LoadedModel,
    method: KVMethod,
    budget: BudgetConfig,
    prompt_len: int,
    extra: int,
    profile: Profile,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> GenerationContext:
    _check_length(loaded, prompt_len + extra)
    resolved = method.resolve_budget(budget, prompt_len, prompt_len + extra, loaded.spec.n_layers)
    ctx = GenerationContext(
        loaded, method, resolved, profile=profile, capacity=prompt_len + extra, engine=engine, sharing=sharing
    )
    method.start(ctx)
    return ctx


@contextmanager
def serving(
    loaded: LoadedModel,
    method: KVMethod,
    ids: torch.Tensor,
    segments: tuple[Segment, ...] | None,
    extra: int,
    budget: BudgetConfig | None = None,
    profile: Profile | None = None,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Iterator[GenerationContext]:
    """One request's life, shared by every loop (:func:`generate`, :func:`teacher_force`,
    :func:`kvbench.engine.conversation.converse`): a context sized for the prompt ``ids`` plus ``extra``
    tokens, the method's ``prepare`` (recorded as ``telemetry.prepared``), then the caller's prefill and
    decode inside inference mode with the context active; the method's ``release`` at the end, also when
    the request failed."""
    ctx = _new_context(
        loaded, method, budget or BudgetConfig(), int(ids.numel()), extra, profile or Profile(), engine, sharing
    )
    try:
        with torch.inference_mode():
            ctx.telemetry.prepared = method.prepare(ctx, ids, segments)
        with torch.inference_mode(), activate(ctx):
            yield ctx
    finally:
        method.release()  # (threads and pools, also when the request failed)


class Picker:
    """Greedy choice of the next token; until ``min_new_tokens`` tokens exist the stop ids cannot be
    chosen (their logits masked, as transformers' ``min_new_tokens`` / LongBench's ``min_length``)."""

    def __init__(self, stops: set[int], min_new_tokens: int, device: torch.device) -> None:
        self.min_new_tokens = min_new_tokens
        self.stop_index = torch.tensor(sorted(stops), dtype=torch.long, device=device)

    def __call__(self, logits: torch.Tensor, produced: int = 0) -> int:
        if produced < self.min_new_tokens and self.stop_index.numel():
            logits = logits.clone()
            logits[:, self.stop_index] = float("-inf")
        return int(torch.argmax(logits, dim=-1))


def eager_decode(
    ctx: GenerationContext,
    token: int,
    start: int,
    *,
    pick: Callable[[torch.Tensor, int], int],
    max_new_tokens: int,
    stops: set[int],
    stop_texts: Sequence[str],
    after_step: Callable[[], None],
) -> tuple[list[int], str]:
    """The eager decode loop of every generating request: the tokens from ``token`` (already chosen, to be
    placed at position ``start``) on, one forward per token, until a stop id, a stop text or
    ``max_new_tokens``; (tokens, stop reason). Each step's time leaves out what the method marks as
    excluded; ``after_step`` runs after every step (the retrieval guard after the first)."""
    clock, tele = ctx.clock, ctx.telemetry
    device, tokenizer = torch.device(ctx.spec.device), ctx.loaded.tokenizer
    tokens = [token]
    while True:
        if token in stops:
            return tokens, "stop"
        if len(tokens) >= max_new_tokens:
            return tokens, "length"
        tele.excluded_s = 0.0
        step_start = clock.now()
        with record_function("kvbench.decode_step"):
            logits = ctx.forward(torch.tensor([[token]], device=device), start=start + len(tokens) - 1)
        token = pick(logits, len(tokens))
        tele.step_s.append(clock.now() - step_start - tele.excluded_s)
        after_step()
        tokens.append(token)
        if stop_texts and _find_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop_texts) >= 0:
            return tokens, "stop_text"


def generate(
    loaded: LoadedModel,
    method: KVMethod,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    budget: BudgetConfig | None = None,
    stop_ids: Sequence[int] = (),
    stop_texts: Sequence[str] = (),
    min_new_tokens: int = 0,
    segments: Sequence[Segment] | None = None,
    profile: Profile | None = None,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Generation:
    """Greedy generation of up to ``max_new_tokens`` tokens with ``method`` managing the KV cache.

    Generation stops at any of the model's stop ids or ``stop_ids`` (e.g. LongBench's newline for
    samsum). Until ``min_new_tokens`` tokens exist the stop ids cannot be chosen (their logits are
    masked, as transformers' ``min_new_tokens`` / LongBench's ``min_length`` do). Generation also ends
    once the decoded output contains one of ``stop_texts`` (e.g. GSM8k's "\nQuestion:"); the text is cut
    before it. Greedy decoding is causal, so stopping early changes nothing before the cut.
    """
    engine = engine or EngineSettings()
    prompt_len = len(input_ids)
    stops = set(loaded.spec.stop_ids) | {int(i) for i in stop_ids}
    pick = Picker(stops, min_new_tokens, torch.device(loaded.spec.device))
    ids = torch.tensor(list(input_ids), dtype=torch.long)
    parts = tuple(segments) if segments is not None else None
    with serving(loaded, method, ids, parts, max_new_tokens, budget, profile, engine, sharing) as ctx:
        with record_function("kvbench.prefill"):  # (a label in torch.profiler traces; no cost without one)
            logits = ctx.prefill(ids, parts)
        if engine.decode == "static":
            tokens, stop_reason = _static_generation(
                ctx, logits, max_new_tokens, min_new_tokens, stops, stop_texts, loaded.tokenizer
            )
        else:
            tokens, stop_reason = _dynamic_generation(ctx, logits, pick, max_new_tokens, stops, stop_texts, prompt_len)
        method.after_request(ctx, parts)
    return _generation(ctx, method, loaded, tokens, stop_reason, stop_texts, prompt_len)


def _dynamic_generation(
    ctx: GenerationContext,
    logits: torch.Tensor,
    pick: Callable[[torch.Tensor, int], int],
    max_new_tokens: int,
    stops: set[int],
    stop_texts: Sequence[str],
    prompt_len: int,
) -> tuple[list[int], str]:
    """The eager path: the first token picked from the prefill's logits (inside TTFT), then
    :func:`eager_decode` with the retrieval guard after its first step; (tokens, stop reason)."""
    clock, tele = ctx.clock, ctx.telemetry
    picked_at = clock.now()
    token = pick(logits, 0)
    assert tele.prefill_s is not None  # (measured by the prefill)
    tele.prefill_s += clock.now() - picked_at
    ctx.check_after_prefill()

    def after_step() -> None:
        if len(tele.step_s) == 1:
            ctx.check_after_first_step()

    return eager_decode(
        ctx,
        token,
        prompt_len,
        pick=pick,
        max_new_tokens=max_new_tokens,
        stops=stops,
        stop_texts=stop_texts,
        after_step=after_step,
    )


def _static_generation(
    ctx: GenerationContext,
    logits: torch.Tensor,
    max_new_tokens: int,
    min_new_tokens: int,
    stops: set[int],
    stop_texts: Sequence[str],
    tokenizer: Any,
) -> tuple[list[int], str]:
    """The decode loop on the static step (:mod:`kvbench.engine.decode`): the first token chosen on the
    device from the prefill's logits (inside TTFT, as the dynamic loop's pick), then :func:`greedy`."""
    from kvbench.engine.decode import greedy

    clock, tele = ctx.clock, ctx.telemetry
    decoder = ctx.decoder(max_new_tokens)  # buffers for the whole generation, before the clock
    decoder.begin(0, min_new_tokens, sorted(stops))
    picked_at = clock.now()
    decoder.choose_first(logits)
    assert tele.prefill_s is not None  # (measured by the prefill)
    tele.prefill_s += clock.now() - picked_at
    ctx.check_after_prefill()
    return greedy(
        decoder,
        max_new_tokens=max_new_tokens,
        stops=stops,
        stop_texts=stop_texts,
        tokenizer=tokenizer,
        on_first_step=ctx.check_after_first_step,
    )


def _generation(
    ctx: GenerationContext,
    method: KVMethod,
    loaded: LoadedModel,
    tokens: list[int],
    stop_reason: str,
    stop_texts: Sequence[str],
    prompt_len: int,
) -> Generation:
    body = tokens[:-1] if stop_reason == "stop" else tokens
    text = loaded.tokenizer.decode(body, skip_special_tokens=True)
    cut = _find_stop(text, stop_texts)
    if cut >= 0:
        text = text[:cut]
    return Generation(
        tokens=tokens,
        text=text,
        stop_reason=stop_reason,
        prompt_tokens=prompt_len,
        budget=ctx.budget,
        telemetry=_telemetry(ctx, method, len(tokens)),
    )


@dataclass
class Scoring:
    """Teacher-forced negative log-likelihoods of a continuation, with the run's budget and telemetry."""

    nll: list[float]
    budget: ResolvedBudget
    telemetry: dict[str, Any] = field(default_factory=dict)


def _find_stop(text: str, stop_texts: Sequence[str]) -> int:
    """Index of the earliest stop text in ``text``, or -1."""
    hits = [i for i in (text.find(stop) for stop in stop_texts if stop) if i >= 0]
    return min(hits) if hits else -1


def teacher_force(
    loaded: LoadedModel,
    method: KVMethod,
    prefix_ids: Sequence[int],
    continuation_ids: Sequence[int],
    *,
    budget: BudgetConfig | None = None,
    profile: Profile | None = None,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Scoring:
    """Negative log-likelihood of each continuation token, decode mode.

    The prefix is prefilled densely (the method evicts or indexes as usual); then every
    continuation token is predicted by one decode step with the method active, and the true token
    is fed next — the way ClusterKV and Quest measure PG19 perplexity.
    """
    prefix_len = len(prefix_ids)
    targets = list(continuation_ids)
    engine = engine or EngineSettings()
    device = torch.device(loaded.spec.device)
    nll: list[float] = []
    ids = torch.tensor(list(prefix_ids), dtype=torch.long)
    with serving(loaded, method, ids, None, len(targets), budget, profile, engine, sharing) as ctx:
        logits = ctx.prefill(ids, None)
        ctx.check_after_prefill()
        if engine.decode == "static" and targets:
            nll = _static_scoring(ctx, logits, targets)
            targets = []
        for i, target in enumerate(targets):
            nll.append(float(-torch.log_softmax(logits.float(), dim=-1)[0, target]))
            if i == len(targets) - 1:
                break
            ctx.telemetry.excluded_s = 0.0
            step_start = ctx.clock.now()
            logits = ctx.forward(torch.tensor([[target]], device=device), start=prefix_len + i)
            ctx.telemetry.step_s.append(ctx.clock.now() - step_start - ctx.telemetry.excluded_s)
            if i == 0:
                ctx.check_after_first_step()
    return Scoring(nll=nll, budget=ctx.budget, telemetry=_telemetry(ctx, method, len(nll)))


def _static_scoring(ctx: GenerationContext, logits: torch.Tensor, targets: list[int]) -> list[float]:
    """Teacher forcing on the static step: every target's NLL computed on the device, read once."""
    decoder = ctx.decoder(len(targets))
    decoder.begin(0)
    decoder.start_scoring(targets)
    decoder.score_first(logits)
    for i in range(len(targets) - 1):
        decoder.step()
        if i == 0:
            decoder.flush()
            ctx.check_after_first_step()
    return decoder.read_scores(len(targets))


def _telemetry(ctx: GenerationContext, method: KVMethod, new_tokens: int) -> dict[str, Any]:
    stats = ctx.store.stats()
    element = next(ctx.model.parameters()).element_size()
    full_bytes = ctx.budget.context * ctx.spec.kv_bytes_per_token(element)
    summary = ctx.telemetry.summary()
    steps = summary["decode_steps"]
    summary.update(
        {
            "prompt_tokens": ctx.budget.context,
            "new_tokens": new_tokens,
            "kv_bytes_full": full_bytes,
            "kv_bytes_ratio": (summary["kv_bytes_after_prefill"] / full_bytes) if full_bytes else None,
            **{key: value for key, value in stats.to_dict().items()},
            "bytes_h2d_index_per_step": stats.bytes_h2d_index / steps if steps else None,
            "bytes_h2d_kv_per_step": (stats.bytes_h2d_fetch + stats.bytes_h2d_cache_fill) / steps if steps else None,
            "method": method.telemetry(),
        }
    )
    return summary


def perplexity(nll: Sequence[float]) -> float:
    return math.exp(sum(nll) / len(nll)) if nll else float("nan")


@overload
def prefill_kv(
    loaded: LoadedModel, input_ids: Sequence[int], *, query_rows: None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]: ...


@overload
def prefill_kv(
    loaded: LoadedModel, input_ids: Sequence[int], *, query_rows: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]: ...


def prefill_kv(
    loaded: LoadedModel, input_ids: Sequence[int], *, query_rows: torch.Tensor | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """K (post-RoPE, at positions ``0..n-1``) and V of every layer after a dense prefill of
    ``input_ids``, exactly as ``full`` computes them (``[kv_heads, n, head_dim]`` each); with
    ``query_rows``, also every layer's post-RoPE queries of those rows (``[heads, rows, head_dim]``).

    Reuse methods precompute chunk caches with it, and ``profile.deviation`` its full-prefill
    reference, outside any measured time.
    """
    from kvbench.engine.prefill import DensePrefill

    ids = torch.tensor(list(input_ids), dtype=torch.long)
    ctx = _new_context(loaded, KVMethod(), BudgetConfig(), len(ids), 0, Profile())  # (the protocol's dense default)
    queries: list[torch.Tensor] = []
    plan = DensePrefill(ctx, ids, torch.arange(len(ids)))
    if query_rows is not None:
        dense_attend = plan.attend

        def capture(
            layer: int,
            module: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            scaling: float,
        ) -> torch.Tensor:
            queries.append(query[0][:, query_rows.to(query.device)].clone())
            return dense_attend(layer, module, query, key, value, scaling)

        plan.attend = capture  # type: ignore[method-assign]  # this one plan also hands over its queries
    with torch.inference_mode(), activate(ctx):
        ctx.run_prefill(plan)
    keys = [layer.keys.clone() for layer in ctx.store.layers]
    values = [layer.values.clone() for layer in ctx.store.layers]
    return (keys, values, queries) if query_rows is not None else (keys, values)
