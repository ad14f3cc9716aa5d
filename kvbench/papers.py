"""The published numbers of the papers kvbench reproduces, as data, with a loader and a validator.

Each paper is one YAML file, ``results/papers/<paper>.yaml`` in the repository (installed as the
package ``kvbench.papers_data``). ``kvbench reproduce <paper>/<artifact>`` prints our runs beside these
numbers, so the files are *data in long format*: every published number is one row whose named keys
(the artifact's ``dims``) say which cell it is. Any table can then be pivoted back to the paper's
layout or joined with kvbench's own results on the same keys.

Schema (one file)::

    paper: pqcache                  # = the file's stem
    title: ...
    arxiv: "2407.12820"
    source: seeds/000_....txt       # the text the numbers were read from (relative to ../shared)
    venue: ...                      # optional
    notes: ...                      # optional: provenance, cross-checks, what has no artifact
    extra_names:                    # optional: names outside kvbench's vocabulary, per checked key
      method: [infinigen]
    legend:                         # optional: how kvbench's figures of the paper name and draw methods
      methods:                      #   kvbench methods in legend order: the paper's name for each, and
        full: {label: Full KV recompute, color: "#222222", marker: s, line: "--"}   # its style
      roles: {baseline: full, subject: cacheblend, reuse: full_reuse}   # (kvbench.figures.legend)
    artifacts:
      table2:                       # id, used as `kvbench reproduce pqcache/table2`
        kind: table                 # table | figure | prose
        where: "§4.2.1, Table 2"
        caption: "..."
        source: seeds/001_....txt   # optional, when the artifact comes from another text
        model: llama31_8b_instruct  # optional: kvbench model name (or a list); model_label: the paper's
        task: longbench             # optional: the kvbench task that reproduces it
        protocol: {data: ..., truncation: ..., budget: ..., notes: ...}   # free-form description
        fixed: {question_position: end}  # keys constant over every row, Full's included (joined like dims)
        numbers: true               # false: the paper gives no values; `note` says why
        note: "..."
        metric: "..."               # what the values are; or {quantity: description} when the rows
        unit: "score (0-100)"       #   carry a `quantity` dim; same for unit
        column: score               # optional: the kvbench result column the values are (score,
                                    #   hit_rate, recall...); a `table` sets its cells beside the paper's
                                    #   only when its value is this column. Without it (a deviation, a
                                    #   reduction, a ratio) the numbers are compared through `claims`.
        dims: [dataset, method, token_ratio, comm_ratio]
        values:
          - {dataset: narrativeqa, dataset_label: NarrativeQA, method: full, token_ratio: null, comm_ratio: null,
             value: 29.91}

Rows. Every row carries every dim (``null`` = the key does not apply: Full has no token ratio, so a
table with a Full column keeps the budget keys as dims rather than in ``fixed``),
optionally ``<dim>_label`` with the paper's own spelling where kvbench's name differs, and then:

- ``value`` (a number as printed) **or** ``low`` and ``high`` (a stated range such as "2.2-3.3x");
- ``relation``: how the number bounds the truth — ``=`` (default), ``~`` (about, around), ``<`` /
  ``<=`` (less than; at most, within, up to), ``>`` / ``>=``; for a range it applies to the range;
- ``sided``: how a claim is graded against ours (``kvbench.render.holds``), when its wording says more
  than ``relation``: ``at_least`` (a floor on a quantity where more is better: "reduces TTFT by
  2.2-3.3x", "more than 2x"; above a stated range ours *exceeds* it), ``at_most`` (a ceiling on a
  quantity where less is better: "within 0.02", "less than 2 %"; below a stated range ours exceeds
  it), ``up_to`` (the paper's best case over its settings of a quantity where more is better: "by up
  to 2.5x"; at or below it ours is consistent with it, above it exceeds it), ``range`` (a two-sided
  band: inside or not). Without it ``>``/``>=`` read ``at_least``, ``<``/``<=`` ``at_most``, a range
  with ``=``/``~`` ``range``, and a single ``=``/``~`` number is not graded;
- ``quote``: the sentence the number was read from, verbatim; required for every number that does
  not come from a table, so each prose number can be checked against the paper text;
- ``note``: a caveat.

Names: ``method`` and ``baseline`` use kvbench's method names, ``model`` its model names, ``dataset``
the LongBench / InfiniteBench names of ``kvbench.tasks`` (plus ``average`` for a table's mean row);
anything else must be listed in the file's ``extra_names``, so a typo cannot pass as a new name.
Dims named like budget keys (``token_ratio``, ``comm_ratio``, ``budget_tokens``) hold the values of
``budget.token_ratio``, ``budget.comm_ratio``, ``budget.tokens`` as the paper defines them.

Validation errors name the file, the artifact and the row (``pqcache.yaml: table2: row 3: ...``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvbench.errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

KINDS = ("table", "figure", "prose")
RELATIONS = ("=", "~", "<", "<=", ">", ">=")
#: keys a row may carry besides its dims and their labels
ROW_FIELDS = ("value", "low", "high", "relation", "sided", "quote", "note")
#: how a stated number is graded (see ``sided`` in the module doc)
SIDES = ("at_least", "at_most", "up_to", "range")
#: the dataset name of a table's mean row (the papers' Average; kvbench.render.long_frame's run-level row)
AVERAGE = "average"
#: row keys whose values must be known names, and which vocabulary they use
CHECKED_KEYS = {"method": "method", "baseline": "method", "model": "model", "dataset": "dataset"}

_TOP_REQUIRED = ("paper", "title", "arxiv", "source", "artifacts")
_TOP_OPTIONAL = ("venue", "notes", "extra_names", "legend")
#: a legend's parts (kvbench.figures.legend): the roles it must name, the keys a method's style may have
LEGEND_ROLES = ("baseline", "subject", "reuse")
LEGEND_STYLE_KEYS = ("label", "color", "marker", "line")
_ARTIFACT_KEYS = (
    "kind",
    "where",
    "caption",
    "source",
    "model",
    "model_label",
    "task",
    "protocol",
    "fixed",
    "numbers",
    "note",
    "metric",
    "unit",
    "column",
    "dims",
    "values",
)
_ID = re.compile(r"^[a-z][a-z0-9_]*$")
_FIX = "edit the file (the schema is in kvbench/papers.py)"


class PaperDataError(ConfigError):
    """A published-numbers file that does not follow the schema."""


@dataclass(frozen=True)
class Artifact:
    """One table, figure or prose passage of a paper, with its published numbers as long-format rows."""

    paper: str
    id: str
    kind: str
    where: str
    caption: str
    source: str
    numbers: bool
    note: str | None = None
    model: str | tuple[str, ...] | None = None
    model_label: str | None = None
    task: str | None = None
    protocol: Mapping[str, Any] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    metric: str | Mapping[str, str] | None = None
    unit: str | Mapping[str, str] | None = None
    column: str | None = None  # the result column the values are directly comparable with
    dims: tuple[str, ...] = ()
    values: tuple[Mapping[str, Any], ...] = ()

    @property
    def ref(self) -> str:
        """``<paper>/<artifact>``, the name ``kvbench reproduce`` takes."""
        return f"{self.paper}/{self.id}"

    def metric_of(self, row: Mapping[str, Any]) -> str | None:
        """What ``row``'s number is (per ``quantity`` when the artifact mixes several)."""
        return self.metric.get(row.get("quantity", "")) if isinstance(self.metric, Mapping) else self.metric

    def unit_of(self, row: Mapping[str, Any]) -> str | None:
        return self.unit.get(row.get("quantity", "")) if isinstance(self.unit, Mapping) else self.unit


@dataclass(frozen=True)
class Paper:
    """One paper's file: where its numbers were read (``source``, relative to ../shared) and its artifacts
    by id, in file order."""

    name: str
    title: str
    arxiv: str
    source: str
    path: Path
    artifacts: Mapping[str, Artifact]
    venue: str | None = None
    notes: str | None = None
    legend: Mapping[str, Any] | None = None  # {methods: {method: style}, roles: {role: method}}


def papers_dir() -> Path:
    """Where the published-numbers files are: the installed ``kvbench.papers_data`` package, or, in a
    source checkout whose editable install predates that package, ``results/papers`` beside ``kvbench/``."""
    try:
        import kvbench.papers_data as data
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "results" / "papers"
    return Path(data.__file__).parent


def paper_names() -> list[str]:
    return sorted(p.stem for p in papers_dir().glob("*.yaml"))


@functools.cache
def load_paper(name: str) -> Paper:
    """The validated contents of ``<papers_dir>/<name>.yaml``."""
    path = papers_dir() / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"no published numbers for paper {name!r}", f"choose one of: {', '.join(paper_names())}")
    return load_file(path)


def load_file(path: str | Path) -> Paper:
    """Load and validate one published-numbers file (any path; its stem must equal its ``paper``)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise PaperDataError(f"{path.name}: not valid YAML ({exc})", _FIX) from exc
    return _paper(data, path)


def artifacts(paper: str | None = None) -> list[tuple[str, str, str]]:
    """``(paper, artifact_id, caption)`` for every artifact (of one paper, or of all), in file order."""
    names = [paper] if paper else paper_names()
    return [(n, a.id, a.caption) for n in names for a in load_paper(n).artifacts.values()]


def get_artifact(ref: str, artifact: str | None = None) -> Artifact:
    """One artifact, by ``"pqcache/table2"`` or by ``("pqcache", "table2")``."""
    paper, _, art = ref.partition("/") if artifact is None else (ref, "/", artifact)
    found = load_paper(paper).artifacts.get(art)
    if found is None:
        known = ", ".join(load_paper(paper).artifacts)
        raise ConfigError(f"paper {paper!r} has no artifact {art!r}", f"choose one of: {known}")
    return found


def values_frame(paper: str, artifact: str) -> pd.DataFrame:
    """The artifact's rows as a DataFrame: ``paper``, ``artifact``, the dims, the paper's labels, the
    ``fixed`` keys, then ``value``, ``low``, ``high``, ``relation`` (default ``=``), ``sided`` (as given,
    else None), ``metric``,
    ``unit``, ``quote`` and ``note``. Empty (with the same columns) when the paper gives no numbers."""
    import pandas as pd

    art = get_artifact(paper, artifact)
    labels = sorted({k for row in art.values for k in row if k.endswith("_label")})
    columns = [
        "paper",
        "artifact",
        *art.dims,
        *labels,
        *art.fixed,
        "value",
        "low",
        "high",
        "relation",
        "sided",
        "metric",
        "unit",
        "quote",
        "note",
    ]
    records = []
    for row in art.values:
        record = {"paper": art.paper, "artifact": art.id, **art.fixed, **row}
        record["relation"] = row.get("relation", "=")
        record["metric"], record["unit"] = art.metric_of(row), art.unit_of(row)
        records.append(record)
    return pd.DataFrame(records, columns=columns)


# ----------------------------------------------------------------------------------------------------------
# validation


@functools.lru_cache(maxsize=1)
def _vocabulary() -> dict[str, frozenset[str]]:
    """kvbench's names, each read from where it is declared (no list kept here): the registered methods'
    parameters (:data:`kvbench.methods.PARAMS`), the models of ``conf/model``, the tasks' parameters
    (:mod:`kvbench.tasks.params`), the LongBench and InfiniteBench datasets of their protocols."""
    from kvbench.listing import group_options
    from kvbench.methods import PARAMS
    from kvbench.tasks.infinitebench_protocol import TASKS
    from kvbench.tasks.longbench_protocol import DATASETS

    return {
        "method": frozenset(PARAMS),
        "model": frozenset(group_options("model")),
        "task": frozenset(group_options("task")),
        "dataset": frozenset(DATASETS) | frozenset(TASKS) | {AVERAGE},
    }


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (str, int, float, bool))


def _text(x: Any) -> bool:
    return isinstance(x, str) and bool(x.strip())


def _paper(data: Any, path: Path) -> Paper:
    def fail(message: str) -> PaperDataError:
        return PaperDataError(f"{path.name}: {message}", _FIX)

    if not isinstance(data, dict):
        raise fail("the file must hold a mapping")
    missing = [k for k in _TOP_REQUIRED if k not in data]
    unknown = sorted(set(data) - set(_TOP_REQUIRED) - set(_TOP_OPTIONAL))
    if missing or unknown:
        raise fail(f"missing keys {missing}" if missing else f"unknown keys {unknown}")
    if data["paper"] != path.stem:
        raise fail(f"paper is {data['paper']!r} but the file is named {path.name}")
    for key in ("title", "arxiv", "source"):
        if not _text(data[key]):
            raise fail(f"{key} must be a non-empty string")
    extra = data.get("extra_names") or {}
    if (
        not isinstance(extra, dict)
        or any(k not in ("method", "model", "dataset") for k in extra)
        or any(not isinstance(v, list) or not all(_text(n) for n in v) for v in extra.values())
    ):
        raise fail("extra_names must map method/model/dataset to lists of names")
    vocab = {kind: names | set(extra.get(kind, ())) for kind, names in _vocabulary().items()}
    arts = data["artifacts"]
    if not isinstance(arts, dict) or not arts:
        raise fail("artifacts must be a non-empty mapping")
    built = {aid: _artifact(data["paper"], str(aid), spec, data["source"], vocab, fail) for aid, spec in arts.items()}
    return Paper(
        name=data["paper"],
        title=data["title"],
        arxiv=str(data["arxiv"]),
        source=data["source"],
        path=path,
        artifacts=MappingProxyType(built),
        venue=data.get("venue"),
        notes=data.get("notes"),
        legend=_legend(data.get("legend"), vocab["method"], fail),
    )


def _legend(legend: Any, methods: AbstractSet[str], fail) -> Mapping[str, Any] | None:
    """A paper's ``legend`` (see the module doc), checked: known methods, a label each, string styles, and
    every role naming one of its methods."""
    if legend is None:
        return None
    if not isinstance(legend, dict) or set(legend) != {"methods", "roles"}:
        raise fail("legend must map methods and roles")
    styles, roles = legend["methods"], legend["roles"]
    if not isinstance(styles, dict) or not styles:
        raise fail("legend.methods must map kvbench methods to their styles")
    for name, style in styles.items():
        if name not in methods:
            raise fail(f"legend: unknown method {name!r}")
        if not isinstance(style, dict) or not _text(style.get("label")):
            raise fail(f"legend: {name} needs a label")
        if set(style) - set(LEGEND_STYLE_KEYS) or not all(isinstance(v, str) for v in style.values()):
            raise fail(f"legend: {name} takes {', '.join(LEGEND_STYLE_KEYS)} (strings)")
    if not isinstance(roles, dict) or set(roles) != set(LEGEND_ROLES) or not all(r in styles for r in roles.values()):
        raise fail(f"legend.roles must name one of its methods for each of {', '.join(LEGEND_ROLES)}")
    return MappingProxyType({"methods": MappingProxyType(styles), "roles": MappingProxyType(roles)})


def _artifact(paper: str, aid: str, spec: Any, source: str, vocab: Mapping[str, AbstractSet[str]], fail) -> Artifact:
    def bad(message: str) -> PaperDataError:
        return fail(f"{aid}: {message}")

    if not _ID.match(aid):
        raise bad("artifact ids are lower-case words joined by '_'")
    if not isinstance(spec, dict):
        raise bad("must be a mapping")
    unknown = sorted(set(spec) - set(_ARTIFACT_KEYS))
    if unknown:
        raise bad(f"unknown keys {unknown}")
    if spec.get("kind") not in KINDS:
        raise bad(f"kind must be one of {', '.join(KINDS)}")
    for key in ("where", "caption"):
        if not _text(spec.get(key)):
            raise bad(f"{key} must be a non-empty string")
    if not isinstance(spec.get("numbers"), bool):
        raise bad("numbers must be true or false")
    if spec.get("column") is not None and not _text(spec["column"]):
        raise bad("column must name a result column (score, hit_rate, recall, ...)")
    model = spec.get("model")
    models = model if isinstance(model, list) else [] if model is None else [model]
    for name in models:
        if name not in vocab["model"]:
            raise bad(f"unknown model {name!r} (add it to extra_names.model if it is not a kvbench model)")
    if spec.get("task") is not None and spec["task"] not in vocab["task"]:
        raise bad(f"unknown task {spec['task']!r}; kvbench tasks: {', '.join(sorted(vocab['task']))}")
    protocol, fixed = spec.get("protocol") or {}, spec.get("fixed") or {}
    if not isinstance(protocol, dict):
        raise bad("protocol must be a mapping")
    if not isinstance(fixed, dict) or not all(_is_scalar(v) for v in fixed.values()):
        raise bad("fixed must map keys to single values")
    dims, values = spec.get("dims") or [], spec.get("values") or []
    if not spec["numbers"]:
        if values:
            raise bad("numbers is false but values are given")
        if not _text(spec.get("note")):
            raise bad("numbers is false: a note must say why the paper gives no values")
    else:
        if not isinstance(values, list) or not values:
            raise bad("numbers is true but there are no values")
        if not isinstance(dims, list) or not dims or not all(_text(d) for d in dims) or len(set(dims)) != len(dims):
            raise bad("dims must be a non-empty list of distinct names")
        clash = [d for d in dims if d in ROW_FIELDS or d in ("metric", "unit") or d.endswith("_label") or d in fixed]
        if clash:
            raise bad(f"dims {clash} clash with row fields, labels or fixed keys")
        for key in ("metric", "unit"):
            _check_described(spec.get(key), key, dims, values, bad)
        seen: dict[tuple, int] = {}
        for i, row in enumerate(values):
            row_key = _row(row, i, dims, spec["kind"], vocab, bad)
            if row_key in seen:
                raise bad(f"row {i}: same {', '.join(dims)} as row {seen[row_key]}")
            seen[row_key] = i
    # read-only views: load_paper caches its result, so callers must not be able to edit it
    return Artifact(
        paper=paper,
        id=aid,
        kind=spec["kind"],
        where=spec["where"],
        caption=spec["caption"],
        source=spec.get("source") or source,
        numbers=spec["numbers"],
        note=spec.get("note"),
        model=tuple(model) if isinstance(model, list) else model,
        model_label=spec.get("model_label"),
        task=spec.get("task"),
        protocol=MappingProxyType(protocol),
        fixed=MappingProxyType(fixed),
        metric=_frozen(spec.get("metric")),
        unit=_frozen(spec.get("unit")),
        column=spec.get("column"),
        dims=tuple(dims),
        values=tuple(MappingProxyType(row) for row in values),
    )


def _frozen(x: Any) -> Any:
    return MappingProxyType(x) if isinstance(x, dict) else x


def _check_described(desc: Any, key: str, dims: list[str], values: list[Any], bad) -> None:
    """``metric``/``unit``: one string, or one string per ``quantity`` the rows use."""
    if _text(desc):
        return
    if not isinstance(desc, dict) or "quantity" not in dims:
        raise bad(f"{key} must be a string, or a mapping per quantity when 'quantity' is a dim")
    used = {row.get("quantity") for row in values if isinstance(row, dict)}
    undescribed = sorted(str(q) for q in used - set(desc))
    if undescribed or not all(_text(v) for v in desc.values()):
        raise bad(f"{key} must describe every quantity (missing: {', '.join(undescribed) or 'empty text'})")


def _row(row: Any, i: int, dims: list[str], kind: str, vocab: Mapping[str, AbstractSet[str]], bad) -> tuple:
    def wrong(message: str) -> PaperDataError:
        return bad(f"row {i}: {message}")

    if not isinstance(row, dict):
        raise wrong("must be a mapping")
    missing = [d for d in dims if d not in row]
    if missing:
        raise wrong(f"missing dims {missing}")
    allowed = set(dims) | {f"{d}_label" for d in dims} | set(ROW_FIELDS)
    unknown = sorted(set(row) - allowed)
    if unknown:
        raise wrong(f"unknown keys {unknown}")
    for d in dims:
        if not _is_scalar(row[d]):
            raise wrong(f"{d} must be a single value")
        checked = CHECKED_KEYS.get(d)
        if checked and row[d] is not None and row[d] not in vocab[checked]:
            raise wrong(f"unknown {d} {row[d]!r} (a kvbench {checked} name, or list it in extra_names.{checked})")
        if f"{d}_label" in row and not _text(row[f"{d}_label"]):
            raise wrong(f"{d}_label must be a non-empty string")
    has_value, has_range = "value" in row, "low" in row or "high" in row
    if has_value == has_range:
        raise wrong("give either value or both low and high")
    numbers = [row["value"]] if has_value else [row.get("low"), row.get("high")]
    if not all(_is_number(x) for x in numbers):
        raise wrong("value, low and high must be numbers")
    if has_range and row["low"] > row["high"]:
        raise wrong("low is above high")
    if row.get("relation", "=") not in RELATIONS:
        raise wrong(f"relation must be one of {' '.join(RELATIONS)}")
    if "sided" in row and row["sided"] not in SIDES:
        raise wrong(f"sided must be one of {', '.join(SIDES)}")
    if kind != "table" and not _text(row.get("quote")):
        raise wrong("a number read from prose or a caption needs its quote")
    for key in ("quote", "note"):
        if key in row and not _text(row[key]):
            raise wrong(f"{key} must be a non-empty string")
    return tuple(row[d] for d in dims)
