"""``table`` (ours beside the paper's, cell by cell) and ``bench`` (a benchmark's rows) render items
(:mod:`kvbench.render`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvbench.render.frames import (
    AVERAGE,
    Section,
    column,
    groups,
    is_missing,
    long_frame,
    norm,
    rows_for,
    select,
    values,
)
from kvbench.render.paper import join_keys, paper_rows, paper_text
from kvbench.render.text import fmt, table_section


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
    return table_section(title, grid, csv)


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


def render_bench(spec: Mapping[str, Any], bench_rows: Any, notes: Sequence[str]) -> list[Section]:
    if bench_rows is None or bench_rows.empty:
        return [Section(spec.get("title") or "benchmark", markdown="(not measured yet)")]
    wanted = spec.get("columns") or list(bench_rows.columns)
    labels = dict(wanted) if isinstance(wanted, Mapping) else {c: c for c in wanted}
    frame = bench_rows[[c for c in labels if c in bench_rows.columns]].rename(columns=labels)
    shown = frame.map(lambda v: fmt(v, 4))
    return [
        table_section(spec.get("title") or "benchmark", shown, frame.to_csv(index=False), note="; ".join(notes) or None)
    ]
