"""Display text: numbers for a table cell (:func:`fmt`), and a frame of display strings as markdown or
a LaTeX tabular."""

from __future__ import annotations

from typing import Any

from kvbench.render.frames import Section, is_missing


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


def table_section(
    title: str,
    shown: Any,
    csv: str | None = None,
    *,
    note: str | None = None,
    figures: list[Any] | None = None,
) -> Section:
    """A :class:`Section` of one displayed table ``shown``: its markdown, LaTeX and frame; ``csv`` the numbers
    behind it (default: ``shown`` itself)."""
    return Section(
        title,
        markdown=to_markdown(shown),
        latex=to_latex(shown),
        csv=shown.to_csv(index=False) if csv is None else csv,
        frame=shown,
        figures=list(figures or []),
        note=note,
    )
