"""What a run measures beyond the always-on timings (the ``profile.*`` config keys)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    recall: bool = False  # recall of the exact top-k (an exact scoring pass per decode step)
    recall_rule: str = "softmax_sum"  # GQA rule of the exact reference for per-KV-head selections
    deviation: bool = False  # reuse methods: KV and attention deviation from a full prefill (costs one, untimed)
