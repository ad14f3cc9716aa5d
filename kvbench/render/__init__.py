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
  the reduction of a from b), ``rel_diff`` (100 · (a − b) / b, a's deviation above b),
  ``gap_ratio`` ((a − max over the ``among`` rows) / (a − b): how many times
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

``chunk_scores`` — Cache-Craft's reused chunks: Spearman rank correlation of each chunk's measured
deviation from a full prefill (``profile.deviation``) with its CCI, 1 − β′, CCI·(1 − β′) and CFO, with
bootstrap intervals, permutation p-values and a scatter (:mod:`kvbench.render.chunk_scores`)::

    - chunk_scores: {by: [method, cfo], deviation: [reused_v, blended_v]}

Every item may give ``title`` (for tables: the section title) and ``where`` (filters on our rows).
Column names: ``model``, ``method``, ``task``, ``budget`` (label), ``token_ratio``, ``comm_ratio``,
``budget_tokens``, ``question``, ``dataset``, metrics (``score``, ``recall``, ``hit_rate``, ``ttft_s``,
``tt2t_s``, ``tpot_s``, ...), any flattened key (``config.method.m``), or a bare method / task / budget
parameter (``m``, ``cache_steps``, ``recompute_ratio``).
"""

from kvbench.render.chunk_scores import render_chunk_scores
from kvbench.render.claims import claim_value, render_claims
from kvbench.render.figures import render_curve, render_figure
from kvbench.render.frames import (
    ALIASES,
    AVERAGE,
    RUN_LEVEL,
    Section,
    check_metric,
    column,
    groups,
    is_missing,
    long_frame,
    norm,
    rows_for,
    select,
    values,
)
from kvbench.render.paired import render_agreement, render_paired
from kvbench.render.paper import holds, join_keys, paper_rows, paper_text, sided
from kvbench.render.protocol import ASPECTS, protocol_section
from kvbench.render.spec import KINDS, OPS, check_render
from kvbench.render.table import render_bench, render_table
from kvbench.render.text import fmt, to_latex, to_markdown
from kvbench.render.tune import render_tune

__all__ = [
    "ALIASES",
    "ASPECTS",
    "AVERAGE",
    "KINDS",
    "OPS",
    "RUN_LEVEL",
    "Section",
    "check_metric",
    "check_render",
    "claim_value",
    "column",
    "fmt",
    "groups",
    "holds",
    "is_missing",
    "join_keys",
    "long_frame",
    "norm",
    "paper_rows",
    "paper_text",
    "protocol_section",
    "render_agreement",
    "render_bench",
    "render_chunk_scores",
    "render_claims",
    "render_curve",
    "render_figure",
    "render_paired",
    "render_table",
    "render_tune",
    "rows_for",
    "select",
    "sided",
    "to_latex",
    "to_markdown",
    "values",
]
