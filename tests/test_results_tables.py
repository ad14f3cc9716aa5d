"""benchmarks/RESULTS.md's tables against the records they were made from.

A sample of RESULTS.md's generated tables is recomputed here from the committed records in
``benchmarks/records/`` through the renderer ``kvbench reproduce`` uses (``kvbench.render``) or the
paired comparison ``kvbench report --paired`` prints (``kvbench.compare``; §7's Fig. 12 at full n), and
every number of those tables is compared with the text: a table and its records cannot drift apart. RESULTS
formats the tables by hand (row order, bold, "1/10" for 0.1, fewer places), so the comparison is by
cell — the row and column a number sits in — and numeric, within half a unit of the last place the
text prints. Each table is also checked to fail once one of its numbers is altered in a copy."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest

from kvbench import render
from kvbench.experiments import load_experiment
from kvbench.papers import values_frame

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
RECORDS = REPO / "benchmarks" / "records"

Cells = dict[tuple[str, str], float]


# ---------------------------------------------------------------------- the text
def table_in(text: str, heading: str, nth: int = 0) -> tuple[list[str], list[list[str]]]:
    """The ``nth`` markdown table under the heading that starts with ``heading``: (header, rows), cells
    stripped of bold. Raises when the heading or the table is not there."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    level = len(heading) - len(heading.lstrip("#"))
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(rf"^#{{1,{level}}} ", lines[i])),
        len(lines),
    )
    tables: list[list[str]] = []
    current: list[str] = []
    for line in lines[start:end]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    rows = [[cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")] for line in tables[nth]]
    return rows[0], [row for row in rows[2:]]


def number(text: str) -> tuple[float, float] | None:
    """A printed number and half a unit of its last place; None for a cell that is not one number."""
    match = re.fullmatch(r"[−-]?\d+(?:\.(\d+))?", text.strip().replace("−", "-"))
    if not match:
        return None
    places = len(match.group(1) or "")
    return float(text.strip().replace("−", "-")), 0.5 * 10.0**-places


def compare(printed: dict[tuple[str, str], str], computed: Cells) -> list[str]:
    """Every printed number against the one computed for its cell; the mismatches, described."""
    wrong = []
    for key, text in printed.items():
        parsed = number(text)
        if parsed is None:
            wrong.append(f"{key}: {text!r} is not a number")
            continue
        value, tolerance = parsed
        if key not in computed:
            wrong.append(f"{key}: RESULTS prints {text}, the records give no such cell")
        elif abs(computed[key] - value) > tolerance + 1e-9:
            wrong.append(f"{key}: RESULTS prints {text}, the records give {computed[key]:.6g}")
    return wrong


# ---------------------------------------------------------------------- the records
def runs_of(folder: str):
    from kvbench.results import load

    dirs = sorted(p.parent for p in (RECORDS / folder).glob("*/config.yaml"))
    runs = load(dirs)
    return runs[runs["state"] == "finished"]


@functools.cache
def rendered_tables(experiment: str, folder: str) -> dict[str, object]:
    """The experiment's ``table`` sections rendered from the records, by title."""
    exp = load_experiment(experiment)
    runs = runs_of(folder)
    out = {}
    for item in exp.render:
        if "table" in item:
            for section in render.render_table(exp, item["table"], runs):
                out[section.title] = section.frame
    return out


def ours(cell: str) -> float | None:
    """Our number of a rendered cell: ``15.17``, or ``15.17 / 27.30 (−12.13)`` beside the paper's."""
    head = str(cell).split(" / ")[0].strip()
    return None if head in ("–", "") else float(head.replace("−", "-"))


def ratio_label(text: str) -> str:
    """``1/10`` → ``0.1``, as the renderer names a token or communication ratio."""
    return render.norm(float(Fraction(text)))


# ---------------------------------------------------------------------- the tables
def fig11a(text: str) -> tuple[dict, Cells]:
    """§4i, ClusterKV Fig. 11a: recall by model · method and budget."""
    header, rows = table_in(text, "## 4i.")
    printed = {(row[0], col): cell for row in rows for col, cell in zip(header[1:], row[1:])}
    computed: Cells = {}
    for title, frame in rendered_tables("clusterkv_fig11a", "clusterkv-fig11a").items():
        model = title.split(" — ")[1]
        for _, r in frame.iterrows():
            for col in frame.columns[1:]:
                computed[(f"{model} · {r['method']}", str(col))] = float(r[col])
    return printed, computed


def fig10d(text: str) -> tuple[dict, Cells]:
    """§4k, PQCache Fig. 10d: score by method and communication ratio."""
    header, rows = table_in(text, "## 4k.")
    printed = {(row[0], ratio_label(col)): cell for row in rows for col, cell in zip(header[1:], row[1:])}
    (frame,) = rendered_tables("pqcache_fig10d", "pqcache-fig10d").values()
    computed = {
        (r["method"], render.norm(col)): float(r[col]) for _, r in frame.iterrows() for col in frame.columns[1:]
    }
    return printed, computed


def table2(text: str) -> tuple[dict, Cells]:
    """§4m, PQCache Table 2 on multi_news: ours and the paper's by method and token ratio."""
    header, rows = table_in(text, "## 4m.")
    columns = {"1/10": ("ours", "0.1"), "1/5": ("ours", "0.2"), "paper 1/10": ("paper", "0.1")}
    columns["paper 1/5"] = ("paper", "0.2")
    printed = {}
    for row in rows:
        method = row[0].removesuffix(" (C)")
        for col, cell in zip(header[1:], row[1:]):
            if col in columns:
                printed[(method, *columns[col])] = cell
    (frame,) = rendered_tables("pqcache_table2", "pqcache-table2").values()
    computed: Cells = {}
    multi_news = frame[frame["dataset"] == "multi_news"].iloc[0]
    for col in frame.columns[1:]:
        method, ratio = col.split(" · ")
        value = ours(multi_news[col])
        for r in ("0.1", "0.2") if ratio == "–" else (ratio,):  # full: one run, both columns
            if value is not None:
                computed[(method, "ours", r)] = value
    paper = values_frame("pqcache", "table2")
    for _, p in paper[paper["dataset"] == "multi_news"].iterrows():
        for r in ("0.1", "0.2") if render.is_missing(p["token_ratio"]) else (render.norm(p["token_ratio"]),):
            computed[(p["method"], "paper", r)] = float(p["value"])
    return printed, computed


def fig10a(text: str) -> tuple[dict, Cells]:
    """§4n, PQCache Fig. 10a: GSM8k accuracy by method and token ratio (full: one run, both columns)."""
    header, rows = table_in(text, "## 4n.")
    printed = {
        (row[0].removesuffix(" (C)"), ratio_label(col)): cell for row in rows for col, cell in zip(header[1:], row[1:])
    }
    (frame,) = rendered_tables("pqcache_fig10a", "pqcache-fig10a").values()
    computed: Cells = {}
    for _, r in frame.iterrows():
        for col in frame.columns[1:]:
            value = ours(r[col])
            for label in ("0.1", "0.2") if col == "–" else (render.norm(col),):
                if value is not None:
                    computed[(r["method"], label)] = value
    return printed, computed


def fig15c(text: str) -> tuple[dict, Cells]:
    """§7, CacheBlend Fig. 15c: the prefill_batch benchmark's record, rendered with the experiment's
    column labels (two of them computed, B × the batch-1 time)."""
    header, rows = table_in(text, "### Prefill vs decode against the batch size")
    keys = [
        "full_prefill_s",
        "full_prefill_s / B",
        "full_one_by_one_s",
        "cacheblend_prefill_s",
        "decode_s",
        "prefill share",
    ]
    assert len(header) == 1 + len(keys), header
    printed = {(row[0], key): cell for row in rows for key, cell in zip(keys, row[1:])}
    (record,) = (RECORDS / "fig15c-smollm2").glob("*.json")
    import pandas as pd

    bench = pd.DataFrame(json.loads(record.read_text(encoding="utf-8"))["rows"])
    exp = load_experiment("cacheblend_fig15c")
    (spec,) = [item["bench"] for item in exp.render if "bench" in item]
    (section,) = render.render_bench(spec, bench, [])
    labels = spec["columns"]
    computed = {
        (str(r[labels["batch"]]), key): float(r[labels[key]]) for _, r in section.frame.iterrows() for key in keys
    }
    return printed, computed


def table_after(text: str, marker: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table after the line that starts with ``marker``: (header, rows)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [
        [cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")] for line in lines[first:end]
    ]
    return rows[0], rows[2:]


def numbers_in(cell: str) -> list[str]:
    """The numbers a cell prints, in order (``+0.65 [−4.25, +5.30]`` → three), signs kept but ``+``."""
    return [n.replace("+", "") for n in re.findall(r"[+−-]?\d+(?:\.\d+)?", cell)]


@functools.cache
def paired_cells(folder: str, where: tuple[tuple[str, str], ...], baseline: str) -> dict[str, dict[str, list[float]]]:
    """``kvbench report --paired method=<baseline>``'s numbers by method: ``n``, ``mean``, ``baseline``,
    ``delta`` (Δ and its interval), ``p``, ``exact``, ``rouge``, ``jaccard`` (each mean and interval)."""
    from kvbench.compare import paired_report

    report = paired_report([RECORDS / folder], f"method={baseline}", where=dict(where))
    paired, agreement = report.split("## ")[1:3]
    columns = {"n": "n", "mean": "mean", "baseline": "baseline", "delta": "Δ", "ci": "95% CI of Δ", "p": "p"}
    out: dict[str, dict[str, list[float]]] = {}
    for section, names in (
        (paired, columns),
        (agreement, {"exact": "exact %", "rouge": "ROUGE-L F1", "jaccard": "Jaccard"}),
    ):
        header, rows = table_after(section, "")
        for row in rows:
            cells = dict(zip(header, row))
            got = out.setdefault(row[0], {})
            for name, column in names.items():
                got[name] = [float(v.replace("−", "-")) for v in numbers_in(cells[column])]
    for got in out.values():  # Δ and its interval, as RESULTS prints them together
        got["delta"] += got.pop("ci")
    return out


def fulln(marker: str, dataset: str, model: str) -> Callable[[str], tuple[dict, Cells]]:
    """§7, CacheBlend Fig. 12 at full n: each method against full on the same questions (F1, paired Δ
    with its interval, p, agreement with full's answers), and CacheBlend against full reuse."""

    def read(text: str) -> tuple[dict, Cells]:
        header, rows = table_after(text, marker)
        assert header[:3] == ["method", "n", "F1"] and len(header) == 8, header
        printed = {
            (row[0], col, i): n for row in rows for col in range(1, 8) for i, n in enumerate(numbers_in(row[col]))
        }
        where = (("config.task.dataset", dataset), ("model", model))
        full = paired_cells("cacheblend-fig12-fulln", where, "full")
        versus = paired_cells("cacheblend-fig12-fulln", where, "full_reuse")
        columns = ["n", "mean", "delta", "p", "exact", "rouge", "jaccard"]
        computed: Cells = {}
        for method in ("full_reuse", "cacheblend"):
            for col, name in enumerate(columns, 1):
                computed.update({(method, col, i): v for i, v in enumerate(full[method][name])})
        computed[("full", 1, 0)] = full["cacheblend"]["n"][0]
        computed[("full", 2, 0)] = full["cacheblend"]["baseline"][0]
        row = "cacheblend vs full_reuse"
        for col, name in enumerate(columns, 1):
            if name != "mean":  # its F1 is the cacheblend row's; ROUGE-L and Jaccard without their intervals
                values = versus["cacheblend"][name]
                computed.update({(row, col, i): v for i, v in enumerate(values[:1] if col > 5 else values)})
        return printed, computed

    return read


TABLES: dict[str, Callable[[str], tuple[dict, Cells]]] = {
    "clusterkv/fig11a (§4i)": fig11a,
    "pqcache/fig10d (§4k)": fig10d,
    "pqcache/table2 (§4m)": table2,
    "pqcache/fig10a (§4n)": fig10a,
    "cacheblend/fig15c (§7)": fig15c,
    "cacheblend/fig12 musique full n (§7)": fulln("**On every Musique question**", "musique", "qwen25_05b"),
    "cacheblend/fig12 wikimqa full n (§7)": fulln(
        "**On every question of the 2WikiMQA subset**", "wikimqa", "qwen25_05b"
    ),
    "cacheblend/fig12 qwen25_15b (§7)": fulln("**On `qwen25_15b`**", "musique", "qwen25_15b"),
}


@pytest.fixture(scope="module")
def text() -> str:
    return RESULTS.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", list(TABLES))
def test_results_table_equals_its_records(name, text):
    printed, computed = TABLES[name](text)
    assert len(printed) >= 6, f"{name}: the table was not found whole in RESULTS.md"
    assert compare(printed, computed) == []
    assert set(printed) == set(computed), "RESULTS prints every cell the records give, and no other"


@pytest.mark.parametrize("name", list(TABLES))
def test_an_altered_number_in_the_table_fails(name, text, tmp_path):
    """Alter one number of the table in a copy of RESULTS.md — the first data row's first number, moved
    by three units of its last place — and the check must report that cell, and only it."""
    printed, computed = TABLES[name](text)
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADINGS[name]))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    row = first + 2  # past the header and the separator
    cells = lines[row].rstrip("\n").split("|")
    index = next(i for i, cell in enumerate(cells[2:], 2) if number(cell.replace("**", "")) is not None)
    old = cells[index].replace("**", "").strip()
    value, half = number(old)
    places = len(old.split(".")[1]) if "." in old else 0
    new = f"{value + 6 * half:.{places}f}"
    cells[index] = cells[index].replace(old, new, 1)
    lines[row] = "|".join(cells) + "\n"
    copy = tmp_path / "RESULTS.md"
    copy.write_text("".join(lines), encoding="utf-8")
    altered, _ = TABLES[name](copy.read_text(encoding="utf-8"))
    changed = [key for key in printed if printed[key] != altered[key]]
    assert len(changed) == 1, changed
    (wrong,) = compare(altered, computed)
    assert wrong.startswith(str(changed[0])) and f"prints {new}," in wrong


HEADINGS = {
    "clusterkv/fig11a (§4i)": "## 4i.",
    "pqcache/fig10d (§4k)": "## 4k.",
    "pqcache/table2 (§4m)": "## 4m.",
    "pqcache/fig10a (§4n)": "## 4n.",
    "cacheblend/fig15c (§7)": "### Prefill vs decode against the batch size",
    "cacheblend/fig12 musique full n (§7)": "**On every Musique question**",
    "cacheblend/fig12 wikimqa full n (§7)": "**On every question of the 2WikiMQA subset**",
    "cacheblend/fig12 qwen25_15b (§7)": "**On `qwen25_15b`**",
}
