"""The paper's published numbers beside ours: the artifact's rows, the keys they join on, how a number
is printed, and whether ours holds against a claim as it is worded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvbench.errors import ConfigError
from kvbench.render.frames import column, is_missing
from kvbench.render.text import fmt


def paper_rows(exp: Any, compare: str | None = None) -> tuple[Any, Any]:
    """``(artifact, frame)`` of the published numbers ``exp`` compares with (or the item's own ``compare``
    artifact); the frame is empty when the paper gives no numbers."""
    from kvbench.papers import get_artifact, values_frame

    art = get_artifact(compare or exp.compare)
    frame = values_frame(art.paper, art.id)
    on_01 = frame["unit"].astype(str).str.contains("(0-1)", regex=False)  # scores a paper prints on 0-1
    for key in ("value", "low", "high"):
        frame[key] = [
            v * exp.paper_factor if scaled and not is_missing(v) else v for v, scaled in zip(frame[key], on_01)
        ]
    if exp.paper_factor != 1.0:
        frame.loc[on_01, "unit"] = f"score (the paper's 0-1 x {exp.paper_factor:g})"
    return art, frame


def join_keys(exp: Any, art: Any, ours: Any) -> list[tuple[str, str]]:
    """``(paper key, our key)`` pairs to join on: the artifact's dims and fixed keys that name one of our
    columns (through ``reproduce.join``)."""
    pairs = []
    for key in (*art.dims, *art.fixed):
        ours_key = exp.join.get(key, key)
        if ours_key and (ours_key == "dataset" or column(ours, ours_key) is not None):
            pairs.append((key, ours_key))
    return pairs


def paper_text(row: Mapping[str, Any] | None, digits: int = 2) -> str:
    """A published number as printed: ``47.4``, ``≤ 0.02``, ``~4``, ``2.2–3.3``."""
    if row is None:
        return "–"
    relation = row.get("relation") or "="
    sign = {"=": "", "~": "~", "<": "< ", "<=": "≤ ", ">": "> ", ">=": "≥ "}[relation]
    if not is_missing(row.get("low")):
        return f"{sign}{fmt(row['low'], digits)}–{fmt(row['high'], digits)}"
    return f"{sign}{fmt(row.get('value'), digits)}"


def sided(row: Mapping[str, Any] | None) -> str | None:
    """How a published number is graded: the row's ``sided`` (``kvbench.papers``), else what its relation
    says — ``>``/``>=`` ``at_least``, ``<``/``<=`` ``at_most``, a range with ``=``/``~`` ``range`` — or
    None (a single ``=``/``~`` number, which is not graded)."""
    if row is None:
        return None
    given = row.get("sided")
    if isinstance(given, str) and given:
        return given
    relation = row.get("relation") or "="
    if relation in (">", ">="):
        return "at_least"
    if relation in ("<", "<="):
        return "at_most"
    return "range" if not is_missing(row.get("low")) else None


def holds(ours: float | None, row: Mapping[str, Any] | None, interval: Sequence[float] | None = None) -> str:
    """Whether ``ours`` satisfies the paper's claim, graded as the claim is worded (:func:`sided`).

    With ``interval`` (our 95 % interval, ``(low, high)``) a one-sided claim whose bound lies inside it is
    ``undecided`` (at this power: the data cannot tell the paper's number from ours); otherwise:

    * ``at_least`` — ``no`` below the floor (``low``, or the value: strictly below it for ``>``), ``yes``
      from there to the top of a stated range, ``exceeds`` above that top;
    * ``at_most`` — the mirror: ``no`` above the ceiling, ``yes`` down to the bottom of a stated range,
      ``exceeds`` below it;
    * ``up_to`` — the paper's best case: ``yes`` at or below it, ``exceeds`` above it;
    * ``range`` — two-sided: ``yes`` inside, ``no`` outside;
    * ``–`` — no number of ours, or a single ``=``/``~`` number (nothing to grade).
    """
    side = sided(row)
    if row is None or side is None or is_missing(ours):
        return "–"
    relation = row.get("relation") or "="
    ranged = not is_missing(row.get("low"))
    low = row["low"] if ranged else row["value"]
    high = row["high"] if ranged else row["value"]
    strict = relation in ("<", ">")
    if interval is not None and side in ("at_least", "at_most", "up_to"):
        bound = low if side == "at_least" else high
        if min(interval) <= bound <= max(interval):
            return "undecided"
    if side == "range":
        return "yes" if low <= ours <= high else "no"
    if side == "at_least":
        if ours < low or (strict and ours == low):
            return "no"
        return "exceeds" if ranged and ours > high else "yes"
    if side == "at_most":
        if ours > high or (strict and ours == high):
            return "no"
        return "exceeds" if ranged and ours < low else "yes"
    if side == "up_to":
        return "exceeds" if ours > high else "yes"
    raise ConfigError(f"unknown sided {side!r}", "use at_least, at_most, up_to or range")
