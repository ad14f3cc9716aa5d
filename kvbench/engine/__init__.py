"""The engine: the only code that drives a model (prefill, decode, teacher forcing).

:func:`execute` runs one request of a task (:mod:`kvbench.requests`) with a KV method and returns its
:class:`~kvbench.requests.Output`; :mod:`kvbench.engine.generate` holds the loops, and
:mod:`kvbench.engine.conversation` several questions about one compressed context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.requests import GenerateRequest, MultiQueryRequest, Output, Request, ScoreRequest

if TYPE_CHECKING:
    from kvbench.budget import BudgetConfig
    from kvbench.engine.prefill_cache import PrefillSharing
    from kvbench.engine.protocol import KVMethod
    from kvbench.engine.settings import EngineSettings
    from kvbench.models.loading import LoadedModel
    from kvbench.profile import Profile


def execute(
    loaded: LoadedModel,
    method: KVMethod,
    request: Request,
    budget: BudgetConfig,
    profile: Profile,
    engine: EngineSettings | None = None,
    sharing: PrefillSharing | None = None,
) -> Output:
    """Run ``request`` with ``method`` managing the KV cache (``engine``: how decode steps run; ``sharing``:
    the run's shared dense prefills, :mod:`kvbench.engine.prefill_cache`)."""
    from kvbench.engine.generate import generate, teacher_force

    if isinstance(request, GenerateRequest):
        out = generate(
            loaded,
            method,
            request.input_ids,
            max_new_tokens=request.max_new_tokens,
            min_new_tokens=request.min_new_tokens,
            stop_ids=request.stop_ids,
            stop_texts=request.stop_texts,
            segments=request.segments,
            budget=budget,
            profile=profile,
            engine=engine,
            sharing=sharing,
        )
        return Output(
            text=out.text,
            tokens=out.tokens,
            stop_reason=out.stop_reason,
            prompt_tokens=out.prompt_tokens,
            budget=out.budget.to_dict(),
            telemetry=out.telemetry,
        )
    if isinstance(request, ScoreRequest):
        scoring = teacher_force(
            loaded,
            method,
            request.prefix_ids,
            request.continuation_ids,
            budget=budget,
            profile=profile,
            engine=engine,
            sharing=sharing,
        )
        return Output(
            nll=scoring.nll,
            prompt_tokens=len(request.prefix_ids),
            budget=scoring.budget.to_dict(),
            telemetry=scoring.telemetry,
        )
    if isinstance(request, MultiQueryRequest):
        from kvbench.engine.conversation import converse

        talk = converse(loaded, method, request, budget=budget, profile=profile, engine=engine, sharing=sharing)
        turns = [
            Output(
                text=t.text,
                tokens=t.tokens,
                stop_reason=t.stop_reason,
                prompt_tokens=t.question_tokens,
                telemetry=t.telemetry,
            )
            for t in talk.turns
        ]
        return Output(
            text=turns[0].text,
            tokens=turns[0].tokens,
            stop_reason=turns[0].stop_reason,
            prompt_tokens=talk.prompt_tokens,
            budget=talk.budget.to_dict(),
            telemetry=talk.telemetry,
            turns=turns,
        )
    raise TypeError(f"unknown request type {type(request).__name__}")
