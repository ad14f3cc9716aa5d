"""Published numbers (results/papers/*.yaml, kvbench.papers): the files validate, and the transcription
is checked against the papers' texts in ../shared/seeds (every table cell, every quote) and against
itself (a table's Average row is the mean of its rows; the prose gains follow from the tables)."""

import re
from pathlib import Path

import pytest
import yaml

from kvbench import papers
from kvbench.errors import ConfigError
from kvbench.tasks.infinitebench_protocol import PQCACHE as IB_PQCACHE
from kvbench.tasks.longbench_protocol import GROUPS

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
needs_seeds = pytest.mark.skipif(not (SHARED / "seeds").exists(), reason="needs ../shared/seeds (the papers' texts)")
PAPERS = ("pqcache", "clusterkv", "cacheblend", "cachecraft")


def text_of(source: str) -> str:
    return (SHARED / source).read_text(encoding="utf-8")


def value(paper: str, artifact: str, **keys):
    """The one row of ``paper/artifact`` whose keys match (a missing key in the row counts as None)."""
    rows = [r for r in papers.get_artifact(paper, artifact).values if all(r.get(k) == v for k, v in keys.items())]
    assert len(rows) == 1, (artifact, keys, rows)
    return rows[0]["value"] if "value" in rows[0] else (rows[0]["low"], rows[0]["high"])


# --- the files --------------------------------------------------------------------------------------------


def test_every_paper_file_loads_and_validates():
    assert set(papers.paper_names()) == set(PAPERS)
    for name in PAPERS:
        paper = papers.load_paper(name)
        assert paper.name == name and paper.artifacts
        raw = yaml.safe_load((papers.papers_dir() / f"{name}.yaml").read_text())["artifacts"]
        for aid, spec in raw.items():
            if spec["numbers"]:
                assert spec["values"], (name, aid)
                for row in spec["values"]:  # read from the raw YAML, independently of the validator
                    assert set(spec["dims"]) <= set(row), (name, aid, row)
                    assert ("value" in row) != ("low" in row and "high" in row), (name, aid, row)
            else:
                assert not spec.get("values") and spec["note"].strip(), (name, aid)


def test_artifacts_lists_every_artifact_and_values_frame_pivots_back_to_the_table():
    listed = papers.artifacts()
    assert ("pqcache", "table2", papers.get_artifact("pqcache/table2").caption) in listed
    assert {p for p, _, _ in listed} == set(PAPERS)
    assert len(listed) == sum(len(papers.load_paper(p).artifacts) for p in PAPERS)
    frame = papers.values_frame("pqcache", "table2")
    assert len(frame) == 15 * 15 and set(frame["comm_ratio"].dropna()) == {1 / 128}
    grid = frame.pivot_table(index="dataset", columns=["method", "token_ratio"], values="value", dropna=False)
    assert grid.loc["qasper", ("pqcache", 0.1)] == 44.36
    assert frame.loc[frame.method == "full", ["token_ratio", "comm_ratio"]].isna().all().all()
    empty = papers.values_frame("pqcache", "fig9")
    assert empty.empty and {"value", "quote", "metric"} <= set(empty.columns)
    mixed = papers.values_frame("cacheblend", "headline")
    assert set(mixed.loc[mixed.quantity == "quality_drop", "unit"]) == {"score (0-1)"}
    with pytest.raises(TypeError):  # load_paper is cached: its rows are read-only
        papers.get_artifact("pqcache/table2").values[0]["value"] = 0.0


def test_dataset_names_are_kvbench_task_names():
    def datasets(artifact):
        return {r["dataset"] for r in papers.get_artifact(artifact).values} - {"average"}

    assert datasets("pqcache/table2") == set(GROUPS["pqcache"]) == datasets("pqcache/table6")
    assert datasets("pqcache/table3") == set(GROUPS["pqcache_qa"])
    assert datasets("pqcache/table4") == set(IB_PQCACHE) == datasets("pqcache/table5")


def test_average_rows_are_the_means_of_the_printed_rows():
    """Transcription check: a wrong or swapped cell moves a column mean by more than the rounding."""
    for ref in ("pqcache/table2", "pqcache/table3", "pqcache/table4", "pqcache/table5", "pqcache/table6"):
        art = papers.get_artifact(ref)
        columns = {}
        for row in art.values:
            column = tuple(row[d] for d in art.dims if d != "dataset")
            columns.setdefault(column, {})[row["dataset"]] = row["value"]
        for column, cells in columns.items():
            average = cells.pop("average")
            assert abs(sum(cells.values()) / len(cells) - average) <= 0.005 + 1e-9, (ref, column)


def test_prose_gains_follow_from_the_transcribed_tables():
    def avg(table, method, ratio=None):
        return value("pqcache", table, dataset="average", method=method, token_ratio=ratio)

    def gain(table, ratio):
        best = max(avg(table, m, ratio) for m in ("h2o", "snapkv", "pyramidkv", "infllm", "sparq"))
        return 100 * (avg(table, "pqcache", ratio) / best - 1)

    for table in ("table2", "table4"):
        for ratio in (0.2, 0.1):
            stated = value("pqcache", f"{table}_claims", quantity="gain_over_best_baseline", token_ratio=ratio)
            assert round(gain(table, ratio), 2) == stated, (table, ratio)
        oracle, pqc = avg(table, "oracle", 0.1), avg(table, "pqcache", 0.1)
        best = max(avg(table, m, 0.1) for m in ("h2o", "snapkv", "pyramidkv", "infllm", "sparq"))
        stated = value("pqcache", f"{table}_claims", quantity="oracle_gap_ratio", token_ratio=None)
        assert abs((oracle - best) / (oracle - pqc) - stated) < 0.01, table
    q = {m: value("pqcache", "table3", dataset="average", method=m) for m in ("snapkv", "pyramidkv", "pqcache")}
    stated = value("pqcache", "table3_claims", quantity="gain_over_best_baseline")
    assert round(100 * (q["pqcache"] / max(q["snapkv"], q["pyramidkv"]) - 1), 2) == stated


def test_spot_checks_against_numbers_read_in_the_papers():
    assert value("pqcache", "table2", dataset="passage_retrieval_en", method="pqcache", token_ratio=0.1) == 100
    assert value("pqcache", "table2", dataset="gov_report", method="snapkv", token_ratio=0.2) == 30.06
    assert value("pqcache", "table3", dataset="qasper", method="pqcache") == 25.76
    assert value("pqcache", "table4", dataset="kv_retrieval", method="h2o", token_ratio=0.1) == 4.60
    assert value("pqcache", "table5", dataset="kv_retrieval", method="minference", token_ratio=None) == 13.60
    assert value("pqcache", "table6", dataset="musique", method="pqcache", cpu="same") == 47.74
    assert value("clusterkv", "table1", method="clusterkv", budget_tokens=2048) == 48.7
    assert value("clusterkv", "table1", method="full", budget_tokens=None) == 49.01
    assert value("clusterkv", "cache_hit_rate", quantity="hit_rate", cache_steps=2) == 74
    assert value("cacheblend", "fig16", quantity="ttft_speedup", baseline="prefix_cache") == (3.4, 6.1)
    assert value("cacheblend", "fig7", quantity="high_deviation_token_share") == (10, 15)


# --- against the papers' texts ----------------------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?"


def printed_table(source: str, caption: str, ncols: int) -> dict[str, list[float]]:
    """``label -> numbers`` for the rows under ``caption`` in the paper text: a label token followed by
    exactly ``ncols`` numbers (two such records share a line in two-column tables)."""
    lines = text_of(source).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(caption))
    rows: dict[str, list[float]] = {}
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        tokens = line.split()
        i = 0
        while i < len(tokens):
            cells = tokens[i + 1 : i + 1 + ncols]
            numeric = len(cells) == ncols and all(re.fullmatch(_NUMBER, c) for c in cells)
            if numeric and not re.fullmatch(_NUMBER, tokens[i]):
                rows[tokens[i]] = [float(c) for c in cells]
                i += 1 + ncols
            else:
                i += 1
    return rows


PQ_METHODS = ("oracle", "h2o", "snapkv", "pyramidkv", "infllm", "sparq", "pqcache")
TABLES = {  # artifact -> (caption prefix in the text, the printed columns as row keys)
    "table2": (
        "Table 2. LongBench evaluation",
        [{"method": "full", "token_ratio": None}]
        + [{"method": m, "token_ratio": r} for r in (0.2, 0.1) for m in PQ_METHODS],
    ),
    "table3": ("Table 3. LongBench question-answering", [{"method": m} for m in ("snapkv", "pyramidkv", "pqcache")]),
    "table4": (
        "Table 4. Infinitebench evaluation",
        [{"method": "full", "token_ratio": None}]
        + [{"method": m, "token_ratio": r} for r in (0.2, 0.1) for m in PQ_METHODS],
    ),
    "table5": (
        "Table 5. Performance of PQCache",
        [{"method": "full"}, {"method": "pqcache"}, {"method": "minference"}, {"method": "minference_pqcache"}],
    ),
    "table6": (
        "Table 6. LongBench evaluation of Llama-3.1-70B",
        [{"method": "full"}, {"cpu": "half"}, {"cpu": "same"}],
    ),
}


@needs_seeds
@pytest.mark.parametrize("artifact", sorted(TABLES))
def test_pqcache_tables_match_the_paper_text_cell_by_cell(artifact):
    caption, columns = TABLES[artifact]
    art = papers.get_artifact("pqcache", artifact)
    printed = printed_table(art.source, caption, len(columns))
    transcribed = {}
    for row in art.values:
        transcribed.setdefault(row.get("dataset_label", row["dataset"]), {})[
            next(i for i, c in enumerate(columns) if all(row.get(k) == v for k, v in c.items()))
        ] = row["value"]
    assert printed.keys() == transcribed.keys()
    for label, cells in printed.items():
        assert [transcribed[label][i] for i in range(len(columns))] == cells, label


@needs_seeds
def test_clusterkv_table_matches_the_paper_text():
    art = papers.get_artifact("clusterkv", "table1")
    text = text_of(art.source)
    table = text[text.index("TABLE I: Average scores") : text.index("Results on LongBench.")]
    for label, method in (("Quest", "quest"), ("InfiniGen", "infinigen"), ("ClusterKV (ours)", "clusterkv")):
        printed = re.search(re.escape(label) + r"((?: " + _NUMBER + "){4})", table).group(1).split()
        assert [value("clusterkv", "table1", method=method, budget_tokens=b) for b in (256, 512, 1024, 2048)] == [
            float(x) for x in printed
        ], method
    assert "Full KV 49.01" in table and "Budget 256 512 1024 2048" in table


_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "six": 6}


@needs_seeds
@pytest.mark.parametrize("name", PAPERS)
def test_every_quote_is_verbatim_in_the_paper_and_holds_its_numbers(name):
    quoted = 0
    for art in papers.load_paper(name).artifacts.values():
        text = " ".join(text_of(art.source).split())
        for row in art.values:
            if "quote" not in row:
                continue
            quote = " ".join(row["quote"].split())
            assert quote in text, (art.id, quote)
            stated = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", quote)}
            stated |= {float(n) for w, n in _WORDS.items() if re.search(rf"\b{w}\b", quote)}
            for key in ("value", "low", "high"):
                if key in row:
                    assert float(row[key]) in stated, (art.id, key, row[key], quote)
            quoted += 1
    assert quoted > 0


@needs_seeds
def test_the_papers_are_the_seed_files_named_in_the_yaml():
    assert text_of(papers.load_paper("pqcache").source).startswith("PQCache: Product Quantization-based KVCache")
    assert text_of(papers.load_paper("clusterkv").source).startswith("ClusterKV: Manipulating LLM KV Cache")
    cacheblend = text_of(papers.load_paper("cacheblend").source)
    assert "Fast Large Language Model Serving with Cached Knowledge Fusion" in cacheblend[:200]


# --- validation errors ------------------------------------------------------------------------------------


def minimal() -> dict:
    return {
        "paper": "demo",
        "title": "Demo",
        "arxiv": "0000.00000",
        "source": "seeds/demo.txt",
        "artifacts": {
            "table9": {
                "kind": "table",
                "where": "§1",
                "caption": "demo",
                "numbers": True,
                "metric": "score",
                "unit": "score (0-100)",
                "dims": ["dataset", "method"],
                "values": [
                    {"dataset": "qasper", "method": "pqcache", "value": 1.5},
                    {"dataset": "qasper", "method": "full", "value": 2.5},
                ],
            }
        },
    }


def write(tmp_path, doc, name="demo.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return path


def test_minimal_file_is_valid(tmp_path):
    paper = papers.load_file(write(tmp_path, minimal()))
    assert paper.artifacts["table9"].values[1]["value"] == 2.5


def _row(doc, i=0):
    return doc["artifacts"]["table9"]["values"][i]


def _art(doc):
    return doc["artifacts"]["table9"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: _row(d).pop("method"), "demo.yaml: table9: row 0: missing dims ['method']"),
        (lambda d: _row(d, 1).update(method="pqcach"), "demo.yaml: table9: row 1: unknown method 'pqcach'"),
        (lambda d: _row(d).update(dataset="qasperr"), "row 0: unknown dataset 'qasperr'"),
        (lambda d: _row(d, 1).update(method="pqcache"), "table9: row 1: same dataset, method as row 0"),
        (lambda d: _row(d).update(low=1.0, high=2.0), "row 0: give either value or both low and high"),
        (lambda d: _row(d).update(value="1.5"), "row 0: value, low and high must be numbers"),
        (lambda d: _row(d).update(relation="about"), "row 0: relation must be one of"),
        (lambda d: _row(d).update(extra=1), "row 0: unknown keys ['extra']"),
        (lambda d: _art(d).update(kind="prose"), "row 0: a number read from prose or a caption needs its quote"),
        (lambda d: _art(d).update(numbers=False), "table9: numbers is false but values are given"),
        (lambda d: _art(d).update(numbers=False, values=[]), "numbers is false: a note must say why"),
        (lambda d: _art(d).update(values=[]), "numbers is true but there are no values"),
        (lambda d: _art(d).update(metric={"x": "y"}), "metric must be a string, or a mapping per quantity"),
        (lambda d: _art(d).update(model="gpt9"), "table9: unknown model 'gpt9'"),
        (lambda d: _art(d).update(task="squad"), "table9: unknown task 'squad'"),
        (lambda d: _art(d).update(fixed={"method": "full"}), "clash with row fields, labels or fixed keys"),
        (lambda d: d["artifacts"].update({"Table-9": {}}), "Table-9: artifact ids are lower-case"),
        (lambda d: d.update(paper="other"), "demo.yaml: paper is 'other' but the file is named demo.yaml"),
        (lambda d: d.pop("arxiv"), "demo.yaml: missing keys ['arxiv']"),
    ],
)
def test_validation_errors_name_file_artifact_and_row(tmp_path, mutate, message):
    doc = minimal()
    mutate(doc)
    with pytest.raises(papers.PaperDataError, match=re.escape(message)) as err:
        papers.load_file(write(tmp_path, doc))
    assert isinstance(err.value, ConfigError) and err.value.fix


def test_extra_names_admit_names_outside_kvbench(tmp_path):
    doc = minimal()
    _row(doc, 1)["method"] = "infinigen"
    with pytest.raises(papers.PaperDataError, match="unknown method 'infinigen'"):
        papers.load_file(write(tmp_path, doc))
    doc["extra_names"] = {"method": ["infinigen"]}
    assert papers.load_file(write(tmp_path, doc)).artifacts["table9"].values[1]["method"] == "infinigen"


def test_quantity_described_metrics_and_unknown_refs(tmp_path):
    doc = minimal()
    art = doc["artifacts"]["table9"]
    art.update(
        kind="prose",
        dims=["quantity"],
        metric={"gain": "a gain"},
        unit={"gain": "%"},
        values=[
            {"quantity": "gain", "value": 3.0, "quote": "a gain of 3"},
            {"quantity": "loss", "value": 1.0, "quote": "a loss of 1"},
        ],
    )
    with pytest.raises(papers.PaperDataError, match="metric must describe every quantity .missing: loss"):
        papers.load_file(write(tmp_path, doc))
    with pytest.raises(ConfigError, match="no artifact 'table99'"):
        papers.get_artifact("pqcache/table99")
    with pytest.raises(ConfigError, match="no published numbers for paper 'pqcash'"):
        papers.load_paper("pqcash")
