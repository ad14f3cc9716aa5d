"""Render an experiment's runs beside the paper's published numbers (``kvbench reproduce``, ``report --html``).

An experiment's ``reproduce.render`` is a list of items, each one mapping with one key naming its kind:

``table``  — ours beside the paper's, cell by cell, with the delta::

    - table: {rows: [dataset], cols: [method, token_ratio], value: score, split: [model], where: {...}}

  Cells read ``ours / paper (Δ ours − paper)``; a row or column the paper has and we did not run shows
  ``– / paper``, and the reverse ``ours / –``. Our values are per run, or per subset for tasks that
  report one (``dataset``: LongBench's datasets, InfiniteBench's tasks, PG19's lengths, with the run's
  mean as ``average``, the papers' Average row). The paper's rows are joined on every one of its dims
  that names one of our columns (``dataset``, ``method``, ``token_ratio``, ``comm_ratio``,
  ``budget_tokens``, ``question_position``, method parameters such as ``cache_policy``) and on its
  ``fixed`` keys; ``reproduce.join`` renames a dim, ``reproduce.stand_ins`` maps one of our values to
  the paper's (a staged Chinese QA set standing in for an English one), and shows it. One table per
  ``split`` group (default: per model, since the paper's model is not ours). The paper's numbers join
  only a table whose ``value`` is the artifact's declared ``column`` (``results/papers``: ``column:
  score``): a hit-rate table is not set beside a TPOT reduction. ``compare: none`` shows ours alone.

``claims`` — numbers the paper states in prose (ranges, bounds) against ours, computed by an ``op``::

    - claims: {split: [model], rows: [{quantity: ttft_speedup, baseline: full,
               ours: {op: ratio, metric: ttft_s, a: {method: full}, b: {method: cacheblend}}}]}

  The row's keys besides ``ours`` pick the paper's row. Ops: ``value`` (mean of ``a``), ``ratio``
  (a / b), ``diff`` (a − b), ``max_diff`` (largest a − b over rows aligned on ``over``; a side
  without that key, one run, meets every row),
  ``rel_gain_over_best`` (100 · (a / max over the ``among`` rows − 1)), ``rel_gap`` (100 · (b − a) / b,
  the reduction of a from b), ``gap_ratio`` ((a − max over the ``among`` rows) / (a − b): how many times
  smaller b's gap to a is than the best of the others'; none when b's gap is 0);
  ``scale`` multiplies the result. ``holds`` grades ours against the claim as it is worded (``sided``:
  ``at_least``, ``at_most``, ``up_to``, ``range``, from the paper's row or inferred from its relation;
  a claim row may set ``sided`` itself): ``yes``, ``no``, ``exceeds`` (better than a one-sided claim's
  stated range or best case) or ``–`` (nothing to grade).

``curve`` — y against x, one line per ``series``, one panel per ``split`` (recall vs budget, PPL,
latency vs context, quality vs TTFT); ``source: samples`` reads per-sample columns (``meta.length``,
``telemetry.tt2t_s``), ``source: bench`` the benchmark's rows; ``y`` may list several columns; ``per``
names a column every ``y`` is divided by (``per: telemetry.decode_steps`` turns a request's decode-time
totals into per-step times).

``figure`` — the task's own comparison figure of the runs (NIAH heatmap panels like PQCache Fig. 9,
PG19 perplexity curves), titled by the ``title`` columns, one per ``split`` group; ``kind`` picks one
of the task's figures (``kvbench report --figure-kind``: the rag task's ``pipelines``, ``scaling``,
``storage``, ...), which place the runs by their settings.

``paired`` — methods compared on the same samples against a ``baseline`` run: mean difference,
bootstrap 95 % interval, McNemar (0/100 scores) or paired permutation p-value (:mod:`kvbench.stats`).

``agreement`` — each run's answers against the ``baseline`` run's on the same samples (exact agreement
after the task's answer normalisation, ROUGE-L F1, Jaccard of token sets, with bootstrap 95 % intervals;
:mod:`kvbench.agreement`): a quality signal that needs no gold answer::

    - agreement: {baseline: {method: full}, by: [method], split: [model, config.task.dataset]}

``bench`` — the benchmark's rows as a table; ``columns`` lists the columns to show, or maps each to its
label (a column a benchmark computes rather than measures says so in its label).

Every item may give ``title`` (for tables: the section title) and ``where`` (filters on our rows).
Column names: ``model``, ``method``, ``task``, ``budget`` (label), ``token_ratio``, ``comm_ratio``,
``budget_tokens``, ``question``, ``dataset``, metrics (``score``, ``recall``, ``hit_rate``, ``ttft_s``,
``tt2t_s``, ``tpot_s``, ...), any flattened key (``config.method.m``), or a bare method / task / budget
parameter (``m``, ``cache_steps``, ``recompute_ratio``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

KINDS = ("table", "claims", "curve", "figure", "paired", "agreement", "bench")
ALIASES = {
    "model": "config.model.name",
    "method": "config.method.name",
    "task": "config.task.name",
    "token_ratio": "config.budget.token_ratio",
    "comm_ratio": "config.budget.comm_ratio",
    "budget_tokens": "config.budget.tokens",
    "compensate": "config.budget.compensate",
    "question": "config.task.question_position",
    "question_position": "config.task.question_position",
    "budget": "budget.label",
    "lengths": "config.task.lengths",
}
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
    "agreement": {"baseline", "split", "by", "match", "where", "title"},
    "bench": {"columns", "title"},
}
OPS = ("value", "ratio", "diff", "max_diff", "rel_gain_over_best", "rel_gap", "gap_ratio")


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


@dataclass
class Section:
    """One rendered piece of an artifact: markdown for the terminal, LaTeX / CSV files, figures, and a
    frame of display strings for the HTML page."""

    title: str
    markdown: str = ""
    latex: str | None = None
    csv: str | None = None
    frame: Any = None
    figures: list[Path] = field(default_factory=list)
    note: str | None = None


# ---------------------------------------------------------------------- values and columns
def is_missing(value: Any) -> bool:
    if value is None:
        return True
    try:
        return isinstance(value, float) and math.isnan(value)
    except TypeError:
        return False


def norm(value: Any) -> str:
    """A key as text, the same for ``256``, ``256.0`` and ``"256"``; ``–`` for missing."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(norm(v) for v in value) + "]"
    if is_missing(value):
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{float(value):.10g}"
    text = str(value)
    try:
        return f"{float(text):.10g}"
    except ValueError:
        return text


def column(frame: Any, key: str) -> str | None:
    """The frame column ``key`` names (an alias, a flattened key, or a bare method/task/budget key)."""
    for candidate in (key, ALIASES.get(key), f"config.method.{key}", f"config.task.{key}", f"config.budget.{key}"):
        if candidate and candidate in frame.columns:
            return candidate
    return None


def values(frame: Any, key: str) -> Any:
    """The column ``key`` of ``frame`` as normalised text (``–`` where absent)."""
    import pandas as pd

    name = column(frame, key)
    if name is None:
        return pd.Series(["–"] * len(frame), index=frame.index)
    return frame[name].map(norm)


def select(frame: Any, selector: Mapping[str, Any] | None) -> Any:
    """Rows whose columns equal the selector's values (a list means any of them)."""
    if not selector or frame.empty:
        return frame
    keep = None
    for key, wanted in selector.items():
        options = {norm(w) for w in (wanted if isinstance(wanted, list) else [wanted])}
        match = values(frame, key).isin(options)
        keep = match if keep is None else keep & match
    return frame[keep]


def fmt(value: Any, digits: int = 2, measured: bool = False) -> str:
    """``value`` for a table: integers bare (counts, budgets), others to ``digits`` places.
    ``measured``: a measured float keeps its places even when whole (a column reads 75.00 beside
    90.83, not 75)."""
    if is_missing(value):
        return "–"
    if isinstance(value, (int, float)):
        if float(value).is_integer() and abs(value) < 1e6 and not (measured and isinstance(value, float)):
            return f"{int(value)}"
        fixed = 1e-2 <= abs(value) < 1e5 or (measured and value == 0)
        return f"{value:.{digits}f}" if fixed else f"{value:.3g}"
    return str(value)


def groups(frame: Any, split: Sequence[str]) -> list[tuple[str, Any]]:
    """``(label, rows)`` per split group of ``frame`` (one group, labelled '', without a split)."""
    if frame.empty or not split:
        return [("", frame)]
    keys = [values(frame, s) for s in split]
    label = keys[0].copy()
    for extra in keys[1:]:
        label = label + " · " + extra
    return [(name, frame[label == name]) for name in dict.fromkeys(label)]


# ---------------------------------------------------------------------- our results
def long_frame(runs: Any) -> Any:
    """Our runs, one row per run, plus one row per subset where a run reports subsets (``dataset`` = the
    subset, score only); the run's own row then gets ``dataset=average`` (the papers' Average: the
    unweighted mean over the run's subsets)."""
    import pandas as pd

    rows = []
    for _, run in runs.iterrows():
        base = run.to_dict()
        subsets = {
            c.removeprefix("per_subset."): base[c]
            for c in runs.columns
            if c.startswith("per_subset.") and not is_missing(base.get(c))
        }
        for name, score in subsets.items():
            rows.append(
                {
                    **{
                        k: v
                        for k, v in base.items()
                        if k.startswith("config.") or k in ("run_id", "run_dir", "budget.label", "n", "state", "status")
                    },
                    "dataset": name,
                    "score": score,
                    RUN_LEVEL: False,
                }
            )
        rows.append({**base, "dataset": AVERAGE if subsets else None, RUN_LEVEL: True})
    return pd.DataFrame(rows)


RUN_LEVEL = "_run_level"  # long_frame: the run's own row (not a subset's)
AVERAGE = "average"  # long_frame: the dataset name of a run's own row when it has per-set scores


def rows_for(frame: Any, keys: Sequence[str]) -> Any:
    """The rows a view of ``keys`` reads: per subset only when it names ``dataset``, else one per run."""
    if RUN_LEVEL not in frame.columns or "dataset" in keys:
        return frame
    return frame[frame[RUN_LEVEL].astype(bool)]


# ---------------------------------------------------------------------- the paper's numbers
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


def holds(ours: float | None, row: Mapping[str, Any] | None) -> str:
    """Whether ``ours`` satisfies the paper's claim, graded as the claim is worded (:func:`sided`):

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


# ---------------------------------------------------------------------- kinds
def render_table(exp: Any, spec: Mapping[str, Any], runs: Any) -> list[Section]:
    """``table``: see the module doc."""
    import pandas as pd

    rows_keys, cols_keys = list(spec.get("rows") or []), list(spec.get("cols") or [])
    value, digits = spec.get("value", "score"), int(spec.get("digits", 2))
    split = list(spec.get("split", ["model"]))
    art, paper = paper_rows(exp, None if spec.get("compare") in (None, "none") else spec["compare"])
    # cells sit beside the paper's only when they measure what its numbers measure (its `column`);
    # deviations, reductions and ratios are compared through `claims`
    if spec.get("compare") == "none" or "quantity" in art.dims or art.column != value:
        paper = paper.iloc[0:0]
    shown_keys = [*rows_keys, *cols_keys, *split, *(spec.get("where") or {})]
    ours = select(rows_for(long_frame(runs), shown_keys), spec.get("where")) if not runs.empty else pd.DataFrame()
    pairs = join_keys(exp, art, ours) if not ours.empty else [(k, exp.join.get(k, k)) for k in (*art.dims, *art.fixed)]
    shown = rows_keys + cols_keys
    # our side: display keys, join keys (stand-ins applied), value
    ours_tab = pd.DataFrame(index=ours.index)
    for key in dict.fromkeys(shown + [o for _, o in pairs] + split):
        ours_tab[key] = values(ours, key) if not ours.empty else pd.Series([], dtype=object)
    join_cols = []
    for paper_key, ours_key in pairs:
        name = f"_join_{paper_key}"
        mapping = {norm(k): norm(v) for k, v in (exp.stand_ins.get(ours_key) or {}).items()}
        ours_tab[name] = (
            ours_tab[ours_key].map(lambda v, m=mapping: m.get(v, v)) if len(ours_tab) else pd.Series([], dtype=object)
        )
        join_cols.append((paper_key, ours_key, name))
    ours_col = column(ours, value) if not ours.empty else None
    ours_tab["ours"] = ours[ours_col].values if ours_col else math.nan
    ci_col = "score_ci95" if value == "score" and "score_ci95" in ours.columns else None
    ours_tab["ours_ci"] = ours[ci_col].values if ci_col else None
    for _, ours_key, name in join_cols:  # a stand-in shows both names
        if ours_key in shown and len(ours_tab):
            changed = ours_tab[name] != ours_tab[ours_key]
            ours_tab.loc[changed, ours_key] = ours_tab.loc[changed, ours_key] + " → " + ours_tab.loc[changed, name]
    # the paper's side
    paper_tab = pd.DataFrame({f"_join_{p}": paper[p].map(norm) if p in paper.columns else "–" for p, _ in pairs})
    for key in shown:
        paper_key = next((p for p, o in pairs if o == key), key)
        paper_tab[key] = paper[paper_key].map(norm) if paper_key in paper.columns else "–"
    paper_tab["_row"] = range(len(paper))
    sections = []
    ours_groups = groups(ours_tab, split) if len(ours_tab) else [("", ours_tab)]
    for label, group in ours_groups:
        merged = _merge(group, paper_tab, [n for _, _, n in join_cols], shown)
        title = spec.get("title") or (f"{value}: ours / paper (Δ)" if not paper.empty else f"{value} (ours)")
        sections.append(
            _table_section(
                f"{title}{' — ' + label if label else ''}",
                merged,
                rows_keys,
                cols_keys,
                paper,
                digits,
                split_label=label,
                split=split,
                value=value,
            )
        )
    return sections


def _merge(ours: Any, paper: Any, join: list[str], shown: list[str]) -> Any:
    """Outer join of our cells and the paper's on ``join``; display keys from whichever side has them."""
    import pandas as pd

    if not join:
        merged = ours.assign(_row=None)
        merged = merged.assign(**{k: merged[k] for k in shown})
        return merged
    left = ours.assign(_ours_pos=range(len(ours)))
    right = (
        paper[[*join, "_row", *[k for k in shown if k not in left.columns or k not in join]]].copy()
        if len(paper)
        else pd.DataFrame(columns=[*join, "_row"])
    )
    right = right.rename(columns={k: f"{k}_paper" for k in shown if k in right.columns})
    # an outer merge sorts by the join keys ("–", an unset budget, after "0.1"): keep our runs' order
    # (the sweep's), then the paper's rows that match none of ours in the paper's order
    merged = left.merge(right, on=join, how="outer")
    merged = merged.sort_values(["_ours_pos", "_row"], na_position="last", kind="stable").drop(columns="_ours_pos")
    for key in shown:
        theirs = f"{key}_paper"
        if theirs in merged.columns:
            mine = merged[key] if key in merged.columns else pd.Series([None] * len(merged), index=merged.index)
            merged[key] = mine.where(
                mine.notna() & (mine != "–") if key in merged.columns else mine.notna(), merged[theirs]
            )
            merged[key] = merged[key].fillna("–")
    return merged


def _table_section(
    title: str,
    merged: Any,
    rows: list[str],
    cols: list[str],
    paper: Any,
    digits: int,
    split_label: str,
    split: list[str],
    value: str = "score",
) -> Section:
    import pandas as pd

    unlike = _unlike_averages(merged, rows + cols) if not merged.empty else {}

    def cell(r: Any) -> str:
        ours = r.get("ours")
        if paper.empty:  # nothing published to compare with: ours alone
            return fmt(ours, digits, measured=True)
        theirs = paper.iloc[int(r["_row"])] if not is_missing(r.get("_row")) else None
        text = f"{fmt(ours, digits, measured=True)} / {paper_text(theirs, digits) if theirs is not None else '–'}"
        if r.name in unlike and theirs is not None and not is_missing(ours):
            n_ours, n_paper = unlike[r.name]
            text += f" (means of {n_ours} and {n_paper} sets)"
        elif theirs is not None and not is_missing(ours) and not is_missing(theirs.get("value")):
            text += f" ({float(ours) - float(theirs['value']):+.{digits}f})"
        return text

    if merged.empty:
        return Section(title, markdown="(no runs and no published numbers)")
    merged = merged.copy()
    merged["cell"] = [cell(r) for _, r in merged.iterrows()]
    order = {key: _axis_order(merged.sort_values("_row", na_position="last"), key) for key in rows + cols}
    csv_rows = []
    for _, r in merged.iterrows():
        theirs = paper.iloc[int(r["_row"])] if not is_missing(r.get("_row")) else None
        ours = r.get("ours")
        paper_value: Any = theirs.get("value") if theirs is not None else None
        csv_rows.append(
            {
                **({"split": split_label} if split else {}),
                **{k: r[k] for k in rows + cols},
                "ours": ours,
                "ours_ci95": r.get("ours_ci"),
                "paper": paper_value,
                "paper_low": theirs.get("low") if theirs is not None else None,
                "paper_high": theirs.get("high") if theirs is not None else None,
                "relation": theirs.get("relation") if theirs is not None else None,
                "delta": float(ours) - float(paper_value)
                if not is_missing(ours) and not is_missing(paper_value) and r.name not in unlike
                else None,
            }
        )
    csv = pd.DataFrame(csv_rows).to_csv(index=False)
    dupes = merged.duplicated(subset=rows + cols, keep=False)
    if dupes.any():  # several of our runs in one cell (a key the table does not show differs): list them
        merged = merged.assign(cell=merged.groupby(rows + cols, dropna=False)["cell"].transform(" ; ".join))
        merged = merged.drop_duplicates(subset=rows + cols)
    if cols:
        grid = merged.pivot(index=rows, columns=cols, values="cell")
        grid = grid.reindex(
            index=_ordered(grid.index, [order[k] for k in rows]),
            columns=_ordered(grid.columns, [order[k] for k in cols]),
        ).fillna("–")
        grid.columns = [" · ".join(c) if isinstance(c, tuple) else str(c) for c in grid.columns]
        grid = grid.reset_index()
    else:
        grid = merged.set_index(rows)[["cell"]].rename(
            columns={"cell": value if paper.empty else f"{value}: ours / paper"}
        )
        grid = grid.reindex(_ordered(grid.index, [order[k] for k in rows])).reset_index()
    grid.columns = [str(c) for c in grid.columns]
    return Section(title, markdown=to_markdown(grid), latex=to_latex(grid), csv=csv, frame=grid)


def _unlike_averages(merged: Any, keys: list[str]) -> dict[Any, tuple[int, int]]:
    """The ``average`` cells whose two means cover different data sets: ``{row index: (our count, the
    paper's count)}``. Our average is the mean over the subsets we ran (one staged LongBench set, say),
    the paper's over its own rows (14 for PQCache's Table 2); their difference mixes the model's gap
    with the choice of sets, so such a cell shows both means and no Δ. Cells are grouped by the
    table's other keys (method, budget); a paper that publishes only its average cannot be checked
    and keeps the Δ."""
    if "dataset" not in keys:
        return {}
    name = "_join_dataset" if "_join_dataset" in merged.columns else "dataset"
    others = [k for k in keys if k != "dataset"]
    unlike: dict[Any, tuple[int, int]] = {}
    for _, group in merged.groupby(others, dropna=False, sort=False) if others else [(None, merged)]:
        sets = group[group[name] != AVERAGE]
        ours = set(sets.loc[sets["ours"].map(lambda v: not is_missing(v)), name])
        published = set(sets.loc[sets["_row"].map(lambda v: not is_missing(v)), name])
        if published and ours != published:
            for index in group.index[group[name] == AVERAGE]:
                unlike[index] = (len(ours), len(published))
    return unlike


_UNSET = ("–", "None", "")  # how a missing value reads once normalised: no key, a null, an empty cell


def _axis_order(merged: Any, key: str) -> list[str]:
    """The order of ``key``'s values along a table axis. Numbers (budgets, chunk counts) go by value,
    whichever side has them — 8, 16, 32, 64, not the paper's one stated row first — after the unset
    ones ("–": a run without the key, a published number that holds across the axis). Otherwise the
    paper's rows come first in the paper's order, then ours in the order of the sweep."""
    every = [v for v in dict.fromkeys(merged[key]) if v not in _UNSET]
    if every and all(_as_number(v) is not None for v in every):
        return [v for v in dict.fromkeys(merged[key]) if v not in every] + sorted(every, key=float)
    published = list(dict.fromkeys(merged.loc[merged["_row"].notna(), key]))
    rest = [v for v in dict.fromkeys(merged[key]) if v not in published]
    unset = [v for v in rest if v in _UNSET]
    given = [v for v in rest if v not in unset]
    if given and all(_as_number(v) is not None for v in given):
        rest = unset + sorted(given, key=float)
    return published + rest


def _as_number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _ordered(index: Any, orders: list[list[str]]) -> Any:
    """``index`` sorted level by level by the given orders (one list per level, from ``_axis_order``);
    a value missing from its level's order goes last."""
    import pandas as pd

    def key(item: Any) -> tuple:
        item = item if isinstance(item, tuple) else (item,)
        return tuple(order.index(v) if v in order else len(order) for v, order in zip(item, orders))

    ordered = sorted(index, key=key)
    return (
        pd.MultiIndex.from_tuples(ordered, names=index.names)
        if isinstance(index, pd.MultiIndex)
        else pd.Index(ordered, name=index.name)
    )


def claim_value(frame: Any, spec: Mapping[str, Any]) -> float | None:
    """Our number for one claim (see ``claims`` in the module doc)."""
    import numpy as np

    op, metric = spec["op"], spec.get("metric", "score")
    scale = float(spec.get("scale", 1.0))

    def mean(selector: Any) -> float | None:
        rows = select(rows_for(frame, list(selector or {})), selector)
        name = column(rows, metric)
        vals = [float(v) for v in (rows[name] if name else []) if not is_missing(v)]
        return float(np.mean(vals)) if vals else None

    a = mean(spec.get("a"))
    if op == "value":
        result = a
    elif op in ("rel_gain_over_best", "gap_ratio"):
        among = select(rows_for(frame, list(spec.get("among") or {})), spec.get("among"))
        name = column(among, metric)
        best = max((float(v) for v in (among[name] if name else []) if not is_missing(v)), default=None)
        if op == "rel_gain_over_best":
            result = 100.0 * (a / best - 1.0) if a is not None and best else None
        else:
            b = mean(spec.get("b"))
            result = (a - best) / (a - b) if a is not None and b is not None and best is not None and a != b else None
    elif op == "max_diff":
        over = spec.get("over", "dataset")
        if RUN_LEVEL in frame.columns:  # over subsets: the subsets' rows, else the runs'
            frame = frame[~frame[RUN_LEVEL].astype(bool)] if over == "dataset" else frame[frame[RUN_LEVEL].astype(bool)]
        left, right = select(frame, spec.get("a")), select(frame, spec.get("b"))
        name_l, name_r = column(left, metric), column(right, metric)
        if name_l is None or name_r is None:
            return None
        a_map = dict(zip(values(left, over), left[name_l]))
        b_map = dict(zip(values(right, over), right[name_r]))
        # a side without the key (full recompute has no recompute ratio; `values` gives "–") is one
        # run: it meets every row of the other side
        if list(a_map) == [norm(None)]:
            a_map = dict.fromkeys(b_map, a_map[norm(None)])
        elif list(b_map) == [norm(None)]:
            b_map = dict.fromkeys(a_map, b_map[norm(None)])
        diffs = [
            float(a_map[k]) - float(b_map[k])
            for k in a_map
            if k in b_map and not is_missing(a_map[k]) and not is_missing(b_map[k])
        ]
        result = max(diffs) if diffs else None
    else:
        b = mean(spec.get("b"))
        if a is None or b is None:
            return None
        if op == "ratio":
            result = a / b if b else None
        elif op == "diff":
            result = a - b
        else:  # rel_gap: how far a is below b, relative to b
            result = 100.0 * (b - a) / b if b else None
    return None if result is None else result * scale


def _check_metric(frame: Any, metric: str, kind: str = "claims") -> None:
    """A claim's metric (a curve's y) must name a column of the rows it reads, else every "ours" would
    print as missing (a curve as "no data yet"), which reads like runs that measured nothing: the error
    lists the columns ending alike."""
    import difflib

    if column(frame, metric) is not None:
        return
    leaf = metric.rsplit(".", 1)[-1]
    close = [c for c in frame.columns if str(c).endswith(leaf)] or difflib.get_close_matches(
        metric, [str(c) for c in frame.columns], n=3
    )
    raise ConfigError(
        f"{kind}: metric {metric!r} is not a column of the rows it reads",
        f"use one of {', '.join(map(str, close))}" if close else f"fix the {kind} item's metric",
    )


def render_claims(
    exp: Any, spec: Mapping[str, Any], runs: Any, bench_rows: Any = None, samples: Any = None
) -> list[Section]:
    """``claims``: see the module doc (``source: samples`` computes from per-sample columns)."""
    import pandas as pd

    art, paper = paper_rows(exp, spec.get("compare"))
    if bench_rows is not None:
        frame = bench_rows
    elif spec.get("source") == "samples":
        frame = select(samples, spec.get("where")) if samples is not None and not samples.empty else pd.DataFrame()
    else:
        frame = select(long_frame(runs), spec.get("where")) if not runs.empty else pd.DataFrame()
    split = list(spec.get("split", ["model"] if bench_rows is None else []))
    if not frame.empty:
        for claim in spec.get("rows") or []:
            _check_metric(frame, claim["ours"].get("metric", "score"))
    out = []
    for label, group in groups(frame, split) if not frame.empty else [("", frame)]:
        for claim in spec.get("rows") or []:
            keys = {k: v for k, v in claim.items() if k not in ("ours", "sided")}
            match = paper
            for key, wanted in keys.items():
                if key in match.columns:
                    match = match[match[key].map(norm) == norm(wanted)]
            row = match.iloc[0].to_dict() if len(match) else None
            if row is not None and claim.get("sided"):  # the experiment grades it otherwise (its notes say why)
                row["sided"] = claim["sided"]
            ours = claim_value(group, claim["ours"]) if not group.empty else None
            out.append(
                {
                    **({"split": label} if split else {}),
                    **{k: norm(v) for k, v in keys.items()},
                    "ours": fmt(ours, 3),
                    "paper": paper_text(row, 3) if row else "–",
                    "unit": (row or {}).get("unit") or "",
                    "sided": (sided(row) or "–").replace("_", " "),
                    "holds": holds(ours, row),
                    "quote": (row or {}).get("quote") or "",
                }
            )
    table = pd.DataFrame(out)
    if table.empty:
        return [Section(spec.get("title") or "claims", markdown="(no claims)")]
    shown = table.drop(columns=["quote"])
    return [
        Section(
            spec.get("title") or "the paper's stated numbers against ours",
            markdown=to_markdown(shown),
            latex=to_latex(shown),
            csv=table.to_csv(index=False),
            frame=shown,
        )
    ]


def render_curve(
    exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any, bench_rows: Any, out_dir: Path, stem: str
) -> list[Section]:
    """``curve``: see the module doc."""
    import pandas as pd

    source = spec.get("source", "runs")
    keys = [spec["x"], *(spec.get("series") or []), *(spec.get("split") or []), *(spec.get("where") or {})]
    frame = {
        "runs": lambda: rows_for(long_frame(runs), keys) if not runs.empty else pd.DataFrame(),
        "samples": lambda: samples,
        "bench": lambda: bench_rows,
    }[source]()
    frame = select(frame, spec.get("where")) if frame is not None and not frame.empty else pd.DataFrame()
    x = spec["x"]
    ys = spec["y"] if isinstance(spec["y"], list) else [spec["y"]]
    per = spec.get("per")
    for y in [*ys, *([per] if per else [])] if not frame.empty else []:
        _check_metric(frame, y, "curve")
    if spec.get("explode") and not frame.empty:
        frame = _explode(frame, spec["y"], spec["x"])
    series = list(spec.get("series") or [])
    split = list(spec.get("split", ["model"] if source != "bench" else []))
    title = spec.get("title") or f"{', '.join(ys)} vs {x}"
    if frame.empty or column(frame, x) is None:
        return [Section(title, markdown="(no data yet)")]
    points = []
    for label, group in groups(frame, split):
        xs = pd.to_numeric(group[column(group, x)], errors="coerce")
        names = values(group, series[0]) if series else pd.Series([""] * len(group), index=group.index)
        for extra in series[1:]:
            names = names + " · " + values(group, extra)
        for y in ys:
            y_col = column(group, y)
            if y_col is None:
                continue
            line = names + (f" · {y}" if len(ys) > 1 or not series else "")
            line = line.str.strip(" ·")
            ys_of = pd.to_numeric(group[y_col], errors="coerce")
            if per:  # (a zero divisor gives NaN: the point is dropped, never infinite)
                ys_of = ys_of / pd.to_numeric(group[column(group, per)], errors="coerce").replace(0, float("nan"))
            part = pd.DataFrame({"split": label, "series": line, "x": xs, "y": ys_of})
            if spec.get("label"):
                part["label"] = values(group, spec["label"]).values
            points.append(part)
    data = pd.concat(points).dropna(subset=["x", "y"]) if points else pd.DataFrame()
    if data.empty:
        return [Section(title, markdown="(no data yet)")]
    keys = ["split", "series", "x"] + (["label"] if "label" in data.columns else [])
    data = data.groupby(keys, sort=False, as_index=False)["y"].mean()
    path = out_dir / f"{stem}.png"
    from kvbench.plots import curves_figure

    curves_figure(
        data,
        path,
        title=title,
        xlabel=spec.get("xlabel") or x,
        ylabel=spec.get("ylabel") or ", ".join(ys),
        logx=bool(spec.get("logx")),
        logy=bool(spec.get("logy")),
    )
    table = data.assign(y=data["y"].map(lambda v: fmt(v, 3, measured=True)))
    index = ["split", "series"] if data["split"].nunique() > 1 else ["series"]
    grid = table.pivot_table(
        index=index + (["label"] if "label" in data.columns else []),
        columns="x",
        values="y",
        aggfunc="first",
        sort=False,
    )
    if grid.isna().to_numpy().mean() > 0.5:  # a scatter (x not shared between series): the points, one per row
        grid = table.assign(x=table["x"].map(lambda v: fmt(v, 3)))[
            [*index, *(["label"] if "label" in table else []), "x", "y"]
        ]
    else:
        grid = grid.sort_index(axis=1).reset_index()  # x ascending, whatever order the runs came in
        grid.columns = [f"{c:g}" if isinstance(c, float) else str(c) for c in grid.columns]  # 0, 0.05, 0.1
        grid = grid.fillna("–")
    return [
        Section(
            title,
            markdown=to_markdown(grid),
            latex=to_latex(grid),
            csv=data.to_csv(index=False),
            frame=grid,
            figures=[path],
        )
    ]


def _explode(frame: Any, y: str, x: str) -> Any:
    """Rows whose ``y`` holds a list (a per-layer curve) as one row per element, its index in ``x``."""
    name = column(frame, y)
    if name is None:
        return frame
    rows = []
    for _, row in frame.iterrows():
        items = row[name] if isinstance(row[name], list) else [row[name]]
        for index, item in enumerate(items):
            rows.append({**row.to_dict(), name: item, x: index})
    import pandas as pd

    return pd.DataFrame(rows)


def render_figure(exp: Any, spec: Mapping[str, Any], runs: Any, out_dir: Path, stem: str) -> list[Section]:
    """``figure``: the task's comparison figure of the runs, per split group."""
    from kvbench.report import FigureRun
    from kvbench.results import RunDir, run_records
    from kvbench.tasks import REGISTRY

    frame = select(runs, spec.get("where")) if not runs.empty else runs
    kind = spec.get("kind")
    titles = list(spec.get("title") or ["method", "budget"])
    split = list(spec.get("split", ["model"]))
    if frame.empty:
        return [Section("figure", markdown="(no finished runs yet)")]
    sections = []
    for index, (label, group) in enumerate(groups(frame, split)):
        task = REGISTRY.get(str(values(group, "task").iloc[0]))
        task.check_figure_kind(kind, option="the figure's kind")
        panels: list[tuple[str, list[dict[str, Any]]]] = []  # FigureRuns: (title, records) with their config
        for _, row in group.iterrows():
            name = " · ".join(norm(row.get(column(group, t)) if column(group, t) else "–") for t in titles)
            score = row.get("score")
            title = f"{name}\n({fmt(score, 1, measured=True)})" if not is_missing(score) else name
            shards = row.get("shard_dirs")
            first = Path(shards[0] if isinstance(shards, list) and shards else row["run_dir"])
            panels.append(FigureRun(title, run_records(row), RunDir(first).config()))
        path = out_dir / f"{stem}-{index}.png"
        task.draw_figure(panels, path, kind)
        sections.append(Section(f"{task.name} runs{' — ' + label if label else ''}", figures=[path]))
    return sections


def render_paired(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Section]:
    """``paired``: every run against the ``baseline`` run of its group, on their common samples."""
    import pandas as pd

    from kvbench.stats import paired

    if runs.empty or samples is None or samples.empty:
        return [Section(spec.get("title") or "paired comparison", markdown="(no finished runs yet)")]
    value = spec.get("value", "score")
    split, by = list(spec.get("split", ["model"])), list(spec.get("by", ["method", "budget"]))
    match = list(spec.get("match", []))
    frame = select(samples, spec.get("where"))
    # the row keys come from the run (samples carry the config but not the run's budget label)
    by_run = {k: dict(zip(runs["run_id"], values(runs, k))) for k in by}
    out = []
    for label, group in groups(frame, split):
        base_rows = select(group, spec["baseline"])
        for run_id, run in group.groupby("run_id", sort=False):
            if run_id in set(base_rows["run_id"]):
                continue
            base = base_rows
            for key in match:
                base = base[values(base, key) == values(run, key).iloc[0]]
            if base["run_id"].nunique() != 1:
                continue
            a = run.set_index("id")[value].dropna()
            b = base.set_index("id")[value].dropna()
            common = [i for i in a.index if i in b.index]
            if not common:
                continue
            result = paired([float(a[i]) for i in common], [float(b[i]) for i in common])
            ci = "–" if result.ci_low is None else f"[{result.ci_low:+.2f}, {result.ci_high:+.2f}]"
            out.append(
                {
                    **({"split": label} if split else {}),
                    **{k: by_run[k].get(run_id, values(run, k).iloc[0]) for k in by},
                    "n": result.n,
                    "mean": fmt(result.mean_a, measured=True),
                    "baseline": fmt(result.mean_b, measured=True),
                    "Δ": f"{result.diff:+.2f}",
                    "95% CI of Δ": ci,
                    "p": "–" if result.p is None else f"{result.p:.3g}",
                    "test": result.test
                    + (f" ({result.a_only}/{result.b_only} discordant)" if result.test == "mcnemar" else ""),
                }
            )
    title = (
        spec.get("title") or f"paired against {', '.join(f'{k}={v}' for k, v in spec['baseline'].items())} ({value})"
    )
    if not out:
        return [Section(title, markdown="(no pairs: the runs share no samples with the baseline)")]
    table = pd.DataFrame(out)
    return [
        Section(title, markdown=to_markdown(table), latex=to_latex(table), csv=table.to_csv(index=False), frame=table)
    ]


def render_agreement(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Section]:
    """``agreement``: see :mod:`kvbench.agreement`."""
    from kvbench.agreement import render_agreement as render

    return render(exp, spec, runs, samples)


def render_bench(spec: Mapping[str, Any], bench_rows: Any, notes: Sequence[str]) -> list[Section]:
    if bench_rows is None or bench_rows.empty:
        return [Section(spec.get("title") or "benchmark", markdown="(not measured yet)")]
    wanted = spec.get("columns") or list(bench_rows.columns)
    labels = dict(wanted) if isinstance(wanted, Mapping) else {c: c for c in wanted}
    frame = bench_rows[[c for c in labels if c in bench_rows.columns]].rename(columns=labels)
    shown = frame.map(lambda v: fmt(v, 4))
    return [
        Section(
            spec.get("title") or "benchmark",
            markdown=to_markdown(shown),
            latex=to_latex(shown),
            csv=frame.to_csv(index=False),
            frame=shown,
            note="; ".join(notes) or None,
        )
    ]


# ---------------------------------------------------------------------- protocol differences
ASPECTS = (
    "model",
    "data",
    "n",
    "truncation",
    "template",
    "question",
    "generation",
    "budget",
    "precision",
    "hardware",
    "metric",
    "notes",
)


def protocol_section(
    exp: Any, scale: str, runs: Any, reasons: Mapping[str, str], bench: Mapping[str, Any] | None
) -> Section:
    """The protocol-difference table: per aspect the paper's protocol, ours, and why they differ; then
    the keys that differ between our runs (the sweep) — ``kvbench report --diff`` over all of them."""
    import pandas as pd

    from kvbench.papers import get_artifact
    from kvbench.report import flat_protocol

    art = get_artifact(exp.compare)
    protocol = dict(art.protocol)
    paper = {
        "model": art.model_label
        or (", ".join(art.model) if isinstance(art.model, tuple) else art.model)
        or "not stated",
        "data": protocol.get("data", "–"),
        "truncation": protocol.get("truncation", "–"),
        "template": protocol.get("template", "–"),
        "question": str(art.fixed.get("question_position", "end (not stated)" if art.task else "–")),
        "generation": protocol.get("generation", "–"),
        "budget": protocol.get("budget", ", ".join(f"{k} {v}" for k, v in art.fixed.items()) or "–"),
        "precision": protocol.get("precision", "–"),
        "hardware": protocol.get("hardware", "–"),
        "metric": protocol.get("metric", art.metric if isinstance(art.metric, str) else "–"),
        "notes": protocol.get("notes", "–"),
        "n": protocol.get("n", "–"),
    }
    for key in ("lengths", "chunks", "criterion"):
        if key in protocol:
            paper["data"] = f"{paper['data']}; {key}: {protocol[key]}"
    flats = [flat_protocol(Path(p)) for p in runs["run_dir"]] if not runs.empty else []
    constant, varying = _split_keys(flats)
    ours = _ours_aspects(runs, constant, varying, bench) if (flats or bench) else {a: "(not run yet)" for a in ASPECTS}
    ours["notes"] = exp.notes or "–"
    rows = [
        {"aspect": a, "paper": str(paper.get(a, "–")), "ours": str(ours.get(a, "–")), "why": reasons.get(a, "")}
        for a in ASPECTS
        if paper.get(a, "–") != "–" or ours.get(a, "–") not in ("–", "") or reasons.get(a)
    ]
    table = pd.DataFrame(rows)
    markdown = to_markdown(table)
    if varying:
        sweep = pd.DataFrame([{"key": k, "values in our runs": ", ".join(v)} for k, v in varying.items()])
        markdown += (
            "\n\nKeys that differ between our runs (`kvbench report --diff` of any two of them):\n\n"
            + to_markdown(sweep)
        )
    return Section(
        f"protocol differences (scale {scale})",
        markdown=markdown,
        latex=to_latex(table),
        csv=table.to_csv(index=False),
        frame=table,
    )


def _split_keys(flats: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Keys every run shares (with the value) and keys that differ (with the values seen). A method
    parameter counts as differing only between runs of the same method: that the methods have
    different parameters is what makes them different methods."""
    keys = sorted({k for f in flats for k in f})
    constant, varying = {}, {}
    for key in keys:
        if key in ("config.output_dir", "config.progress"):
            continue
        seen = list(dict.fromkeys(norm(f.get(key)) for f in flats))
        if key.startswith("config.method.") and key != "config.method.name":
            per_method: dict[str, set[str]] = {}
            for f in flats:
                per_method.setdefault(norm(f.get("config.method.name")), set()).add(norm(f.get(key)))
            if all(len(v) == 1 for v in per_method.values()):
                continue
        if len(seen) == 1:
            constant[key] = seen[0]
        else:
            varying[key] = seen
    return constant, varying


def _ours_aspects(runs: Any, constant: dict[str, Any], varying: dict[str, list[str]], bench: Any) -> dict[str, str]:
    def pick(*words: str, prefix: str = "protocol.") -> str:
        found = [
            f"{k.removeprefix(prefix)}: {v}"
            for k, v in constant.items()
            if k.startswith(prefix) and any(w in k.lower() for w in words) and len(v) <= 160
        ]
        found += [
            f"{k.removeprefix(prefix)}: {' | '.join(v)}"
            for k, v in varying.items()
            if k.startswith(prefix) and any(w in k.lower() for w in words)
        ]
        return "; ".join(found) or "–"

    if bench is not None:
        options = bench.get("options", {})
        return {
            "model": str(options.get("model") or "the benchmark's default"),
            "data": f"kvbench bench {bench.get('name')}: synthetic prompts",
            "generation": str(options.get("new_tokens") or "the benchmark's default"),
            "hardware": f"{bench.get('device')} ({bench.get('cpus')} CPUs, torch {bench.get('torch')})",
        }
    models = " | ".join(dict.fromkeys(values(runs, "model")))
    task_keys = [
        k
        for k in list(constant) + list(varying)
        if k.startswith("config.task.")
        and k.split(".")[-1]
        in ("subsets", "dataset", "file", "lengths", "depths", "data_dir", "limit", "book", "chunk_tokens", "top_k")
    ]
    data = "; ".join(
        f"{k.removeprefix('config.task.')}: {constant.get(k) or ' | '.join(varying[k])}" for k in task_keys
    )
    ns = [int(n) for n in runs.get("n", []) if not is_missing(n)]
    n = (
        f"{min(ns)}–{max(ns)} samples per run, {len(ns)} runs"
        if ns and min(ns) != max(ns)
        else f"{ns[0]} samples per run, {len(ns)} runs"
        if ns
        else "–"
    )
    budgets = " | ".join(dict.fromkeys(values(runs, "budget")))
    envs = _environments(runs)
    return {
        "model": models,
        "data": f"{', '.join(dict.fromkeys(values(runs, 'task')))} — {data}",
        "n": n,
        "truncation": pick("max_length", "truncat", "overflow"),
        "template": pick("template", "chat", "prompt"),
        "question": ", ".join(dict.fromkeys(values(runs, "question"))),
        "generation": pick("max_new_tokens", "stop", "generation"),
        "budget": budgets,
        "precision": envs[0],
        "hardware": envs[1],
        "metric": pick("scorer", "metric", "extraction"),
    }


def _environments(runs: Any) -> tuple[str, str]:
    import json

    dtypes, devices = set(), set()
    for path in runs.get("run_dir", []):
        env = Path(path) / "env.json"
        if env.exists():
            data = json.loads(env.read_text())
            dtypes.add(str((data.get("model") or {}).get("dtype", "?")))
            threads = data.get("torch_threads")
            devices.add(
                f"{data.get('device_name')} ({data.get('device')}, {threads} thread{'' if threads == 1 else 's'})"
            )
    return ", ".join(sorted(dtypes)) or "–", ", ".join(sorted(devices)) or "–"


# ---------------------------------------------------------------------- text formats
def to_markdown(frame: Any) -> str:
    from kvbench.report import to_markdown as md

    return md(frame.astype(str).map(lambda s: s.replace("|", "\\|").replace("\n", " ")))


def to_latex(frame: Any) -> str:
    """A LaTeX tabular of display strings (special characters escaped)."""
    special = {
        "\\": r"\textbackslash{}",
        "&": r"\&",
        "%": r"\%",
        "$": r"\$",
        "#": r"\#",
        "_": r"\_",
        "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}",
        "^": r"\textasciicircum{}",
        "Δ": r"$\Delta$",
        "≤": r"$\le$",
        "≥": r"$\ge$",
        "→": r"$\to$",
        "–": "--",
        "·": r"$\cdot$",
        "±": r"$\pm$",
    }

    def esc(text: Any) -> str:
        return "".join(special.get(ch, ch) for ch in str(text))

    columns = list(frame.columns)
    lines = [
        r"\begin{tabular}{" + "l" * len(columns) + "}",
        r"\toprule",
        " & ".join(esc(c) for c in columns) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(esc(v) for v in row) + r" \\" for row in frame.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines)
