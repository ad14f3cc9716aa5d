"""What a run measures beyond the always-on timings (the ``profile.*`` config keys).

``recall_rule`` picks the definition of ``recall`` (see :mod:`kvbench.telemetry` for each):

* ``attended`` (default) — the ClusterKV paper's Fig. 11 quantity, the same for every method: per
  query head, the prompt tokens the step attends against the exact top-B of raw ``q·k`` over all
  prompt keys, ``B = sink + budget`` tokens;
* ``softmax_sum`` / ``logit_sum`` / ``max`` — kvbench's earlier rule, kept so that runs recorded with
  it keep their meaning: only the tokens a method *chose* (sinks and the local window left out), against
  the exact top-k of its candidates with k = the number it chose; per query head for a per-query-head
  selection, else per KV head with the named GQA reduction. Its values depend on each method's
  selection shape and budget split, so they do not compare across methods.

The rule is part of the run's config (``config.yaml``), hence of its run id.

``selection_digest`` records, per sample, a digest of the prompt positions every layer holds right
after prefill and of the positions every selecting layer attends at every decode step (sorted per head,
so a reordering of store slots leaves it unchanged; a different kept or attended token changes it).
``kvbench check`` turns it on so that a change in *what a method keeps or selects* fails a golden check
even when the few generated tokens of a smoke-scale prompt happen to stay the same. It is not in
``conf/config.yaml`` (adding a key there would change the run id of every existing run); pass
``+profile.selection_digest=true`` to record it in a run of your own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param

RECALL_RULES = ("attended", "softmax_sum", "logit_sum", "max")


@dataclass(frozen=True)
class Profile(Params):
    """The ``profile.*`` config keys (their defaults in ``conf/config.yaml``; ``selection_digest`` is not
    there, so that it names no run)."""

    recall: bool = param(False, "recall of the exact top-B per decode step (costs an exact scoring pass)")
    recall_rule: Literal["attended", "softmax_sum", "logit_sum", "max"] = param(
        "attended", "attended: ClusterKV Fig. 11 | softmax_sum | logit_sum | max: the earlier chosen-part rule"
    )
    deviation: bool = param(False, "reuse methods: KV and attention deviation from a full prefill (one untimed)")
    selection_digest: bool = param(False, "a digest of the positions kept after prefill and attended per step")

    def __post_init__(self) -> None:  # (also when built directly, not through parse)
        self.validate()

    def validate(self) -> None:
        if self.recall_rule not in RECALL_RULES:
            raise ConfigError(
                f"unknown profile.recall_rule={self.recall_rule!r}",
                f"use one of {', '.join(RECALL_RULES)} (attended: the ClusterKV Fig. 11 recall)",
            )


def profile_settings(node: Any) -> Profile:
    """The ``profile`` node, parsed and checked (an unknown key, a wrong type or choice: one line)."""
    from kvbench.params import parse

    return parse(Profile, dict(node or {}), owner="profile", prefix="profile.")  # type: ignore[return-value]
