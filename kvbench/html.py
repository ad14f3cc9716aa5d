"""``kvbench report --html DIR``: a self-contained web report, one page per paper artifact.

Each page holds what ``kvbench reproduce`` prints for the artifact — the tables beside the paper's
numbers, claims, paired statistics, the protocol-difference table, our runs — with its figures
embedded as base64 PNG data, so every file opens offline, alone, in any browser (no script, no
external stylesheet, font or image). ``index.html`` lists the artifacts with how many of their runs
are finished. Nothing is run: the pages show the finished runs under the results folder.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .6em 0; font-size: 12.5px; }
th, td { border: 1px solid #d0d0d0; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
code { background: #f1f1f1; padding: 0 3px; border-radius: 3px; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
nav { margin-bottom: 1em; } .note { color: #555; }
"""


def _inline(text: str) -> str:
    """Escape ``text`` and turn `code` spans into <code>."""
    escaped = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)


def table_html(frame: Any) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in frame.itertuples(index=False)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def markdown_html(text: str) -> str:
    """The small markdown subset the reports use: paragraphs, pipe tables, `code`."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if not block:
            return
        if block[0].startswith("|"):
            cells = [
                [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
                for line in block
                if not re.match(r"^\|[-|: ]+\|$", line.strip())
            ]
            head = "".join(f"<th>{_inline(c)}</th>" for c in cells[0])
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in cells[1:])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            out.append(f"<p>{_inline(' '.join(block))}</p>")
        block.clear()

    for line in text.splitlines():
        if not line.strip():
            flush()
        elif block and line.startswith("|") != block[0].startswith("|"):
            flush()
            block.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out)


def image_html(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def page(report: Any) -> str:
    """One artifact's page (``report``: a :class:`kvbench.reproduce.Report`)."""
    parts = [
        '<nav><a href="index.html">all artifacts</a></nav>',
        f"<h1>{html.escape(report.title)}</h1>",
        f'<p class="note">scale {html.escape(report.scale)} · <code>kvbench reproduce {html.escape(report.exp.ref)} '
        f"scale={html.escape(report.scale)}</code></p>",
    ]
    if getattr(report.exp, "notes", None):  # what the experiment file says no claim row can compare, and why
        parts.append(f'<p class="note">{_inline(" ".join(str(report.exp.notes).split()))}</p>')
    for section in report.sections:
        parts.append(f"<section><h2>{html.escape(section.title)}</h2>" if section.title else "<section>")
        if section.frame is not None:
            parts.append(table_html(section.frame))
            rest = section.markdown.split("\n\n", 1)[1] if "\n\nKeys that differ" in section.markdown else ""
            if rest:
                parts.append(markdown_html(rest))
        elif section.markdown:
            parts.append(markdown_html(section.markdown))
        parts += [image_html(figure, section.title) for figure in section.figures if Path(figure).exists()]
        if section.note:
            parts.append(f'<p class="note">{_inline(section.note)}</p>')
        parts.append("</section>")
    return _document(report.title, "\n".join(parts))


def _document(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def write_site(reports: Sequence[Any], out: Path, scale: str) -> Path:
    """``index.html`` and one ``<experiment>.html`` per report under ``out``; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for report in reports:
        name = f"{report.exp.name}.html"
        (out / name).write_text(page(report), encoding="utf-8")
        runs = "bench" if report.exp.bench else f"{report.finished}/{len(report.points)}"
        rows.append(
            f'<tr><td><a href="{name}">{html.escape(report.exp.ref)}</a></td>'
            f"<td>{html.escape(report.exp.description)}</td><td>{runs}</td></tr>"
        )
    body = (
        f"<h1>kvbench: the papers' artifacts beside ours (scale {html.escape(scale)})</h1>"
        "<p>Each page shows our finished runs beside the published numbers, the protocol differences "
        "and the figures; <code>kvbench reproduce &lt;artifact&gt;</code> runs what is missing.</p>"
        "<table><thead><tr><th>artifact</th><th>what</th><th>runs finished</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )
    index = out / "index.html"
    index.write_text(_document(f"kvbench reproduce ({scale})", body), encoding="utf-8")
    return index


def build(out: Path, scale: str, output_dir: Path, names: Sequence[str] | None = None) -> Path:
    """Render every experiment (or ``names``) at ``scale`` from the runs under ``output_dir``, into ``out``."""
    from kvbench.experiments import experiment_names
    from kvbench.reproduce import reproduce

    reports = []
    for name in names or experiment_names():
        reports.append(
            reproduce(name, scale, [f"output_dir={output_dir}"], run=False, write=False, out=out / "figures" / name)
        )
    return write_site(reports, out, scale)
