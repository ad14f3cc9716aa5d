"""The render items an experiment's ``reproduce.render`` may list, checked when experiments load
(the kinds and their options: :mod:`kvbench.render`)."""

from __future__ import annotations

from typing import Any

from kvbench.errors import ConfigError

KINDS = ("table", "claims", "curve", "figure", "paired", "agreement", "bench", "chunk_scores", "tune")
_ITEM_KEYS = {
    "table": {"rows", "cols", "value", "split", "where", "title", "digits", "compare"},  # compare: none = ours only
    "claims": {"rows", "split", "where", "title", "compare", "source"},
    "curve": {
        "x",
        "y",
        "series",
        "split",
        "where",
        "title",
        "source",
        "xlabel",
        "ylabel",
        "logx",
        "logy",
        "label",
        "explode",
        "per",
    },
    "figure": {"title", "split", "where", "panels", "kind"},
    "paired": {"baseline", "value", "split", "by", "match", "where", "title"},
    "agreement": {"baseline", "split", "by", "match", "where", "title", "versus"},
    "bench": {"columns", "title"},
    "chunk_scores": {"by", "deviation", "split", "where", "title", "resamples"},  # kvbench.render.chunk_scores
    "tune": {"baseline", "over", "cost", "quality", "target", "split", "where", "title"},  # kvbench.render.tune
}
OPS = ("value", "ratio", "diff", "max_diff", "rel_gain_over_best", "rel_gap", "rel_diff", "gap_ratio")


def check_render(item: Any) -> None:
    """One render item is ``{kind: {options}}`` with known options (used when experiments load)."""
    if not isinstance(item, dict) or len(item) != 1:
        raise ConfigError("a render item is one mapping {kind: {...}}", f"kinds: {', '.join(KINDS)}")
    ((kind, options),) = item.items()
    if kind not in KINDS:
        raise ConfigError(f"unknown render kind {kind!r}", f"kinds: {', '.join(KINDS)}")
    options = options or {}
    unknown = sorted(set(options) - _ITEM_KEYS[kind])
    if unknown:
        raise ConfigError(f"{kind}: unknown options {unknown}", f"{kind} takes {', '.join(sorted(_ITEM_KEYS[kind]))}")
    if kind == "agreement":
        from kvbench.agreement import check

        check(options)
    if kind == "tune":
        from kvbench.render.tune import check as check_tune

        check_tune(options)
    if kind == "claims":
        for row in options.get("rows") or []:
            op = (row.get("ours") or {}).get("op")
            if op not in OPS:
                raise ConfigError(f"claims: op {op!r} is not one of {', '.join(OPS)}", "fix the claim's ours.op")
            from kvbench.papers import SIDES

            if "sided" in row and row["sided"] not in SIDES:
                raise ConfigError(
                    f"claims: sided {row['sided']!r} is not one of {', '.join(SIDES)}", "fix the claim's sided"
                )
