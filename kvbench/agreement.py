"""Agreement with a baseline run's answers: how often, and how closely, a method says what full
recompute says on the same sample.

At small model scale the task scores of reuse methods are too noisy to separate them (full recompute
itself scores 14–31 F1 on 20–150 RAG questions), while the question a KV method raises — does it
change the model's answer? — can be asked of every sample whatever the gold answer. Cache-Craft
reports ROUGE-L F1 and Jaccard similarity of a method's answer against full recompute's; CacheBlend's
fidelity question is how often the answer is the same. Three per-sample scorers, all symmetric:

* **exact** — 1 when the two answers are equal after the task's answer normalisation
  (:func:`answer_form`), else 0;
* **ROUGE-L F1** — F-measure of the longest common token subsequence of the two normalised answers,
  computed by the task scorers' own ROUGE-L (``rouge-score`` with the Porter stemmer,
  :func:`kvbench.tasks.rag_metrics.rouge_l`; Chinese: LongBench's jieba + ``rouge``,
  :func:`kvbench.tasks.metrics.rouge_zh_score`);
* **Jaccard** — |A ∩ B| / |A ∪ B| of the two answers' token sets, with the tokens ROUGE-L uses
  (``rouge-score``'s: lower-cased runs of ASCII letters and digits, words over 3 characters stemmed;
  Chinese: jieba words).

Edge cases: two answers equal after normalisation score 1 on all three (two empty answers agree); an
empty answer against a non-empty one scores 0 on all three.

The task's answer normalisation is what its scorer compares: ``rag`` QA sets (Musique, 2WikiMQA) —
CacheBlend's first line with the Yes/No collapse, then SQuAD normalisation
(:func:`kvbench.tasks.rag_metrics.parse_generation`, :func:`kvbench.tasks.metrics.normalize_answer`);
``longbench`` — the first line for trec/triviaqa/samsum/lsht, SQuAD normalisation for the English QA
sets, LongBench's Chinese normalisation for the Chinese QA/summary sets; anything else (summaries,
other tasks) — whitespace collapsed.

The ``agreement`` render item (:func:`render_agreement`; ``reproduce.render`` of an experiment)
pairs each run with its group's ``baseline`` run on the sample ids both finished and prints, per run,
the pairs' count, exact agreement in %, mean ROUGE-L F1 and mean Jaccard, each with a 95 % percentile
bootstrap interval over the samples (:func:`kvbench.stats.bootstrap_mean`). It reads the runs'
``samples.jsonl`` predictions only and writes nothing into a run folder. With ``versus`` (a selector,
``{method: full_reuse}``) it adds a second table: per run, how much closer to the baseline's answers
than the ``versus`` run of its group it comes — the paired difference of the two runs' per-sample
agreement on the ids all three answered (ROUGE-L F1 and exact %), with a 95 % bootstrap interval over
those samples (:func:`kvbench.stats.bootstrap_diff`): "Random-Recomp agrees with full less than full
reuse does" is read from one interval, not from two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvbench.errors import ConfigError

Normalise = Callable[[str], str]


def collapse(text: str) -> str:
    """Whitespace collapsed (the normalisation of tasks without their own)."""
    return " ".join(str(text).split())


@dataclass(frozen=True)
class AnswerForm:
    """How a task's answers are compared: its normalisation and whether they are Chinese."""

    normalise: Normalise = collapse
    zh: bool = False
    name: str = "whitespace collapsed"

    def tokens(self, normalised: str) -> list[str]:
        """The tokens ROUGE-L and Jaccard see in an already normalised answer."""
        if self.zh:
            from kvbench.tasks.metrics import _jieba

            return [t for t in _jieba().cut(normalised, cut_all=False) if t.strip()]
        return list(_rouge_tokenizer().tokenize(normalised))


PLAIN = AnswerForm()


@lru_cache(maxsize=1)
def _rouge_tokenizer() -> Any:
    from rouge_score import tokenizers

    return tokenizers.DefaultTokenizer(use_stemmer=True)  # rag_metrics.rouge_l's (stemmed) tokens


@lru_cache(maxsize=256)
def answer_form(task: str | None, subset: str | None) -> AnswerForm:
    """The answer normalisation of ``task``'s scorer on ``subset`` (its data set); see the module doc."""
    from kvbench.tasks import metrics

    if task == "rag":
        from kvbench.tasks.rag import DATASETS
        from kvbench.tasks.rag_metrics import parse_generation

        dataset = DATASETS.get(str(subset))
        if dataset is not None and dataset.metric == "f1":
            return AnswerForm(
                lambda text: metrics.normalize_answer(parse_generation(text)),
                name="first line, Yes/No collapse, SQuAD normalisation",
            )
        return PLAIN
    if task == "longbench" and subset:
        name = str(subset).removesuffix("_e")
        metric = metrics.DATASET2METRIC.get(name)
        first = name in metrics.FIRST_LINE_DATASETS

        def first_line(text: str) -> str:
            return text.lstrip("\n").split("\n")[0] if first else text

        if metric in (metrics.qa_f1_zh_score, metrics.rouge_zh_score):
            return AnswerForm(lambda text: metrics.normalize_zh_answer(first_line(text)), zh=True, name="LongBench zh")
        if metric is metrics.qa_f1_score:
            return AnswerForm(
                lambda text: metrics.normalize_answer(first_line(text)),
                name=("first line, " if first else "") + "SQuAD normalisation",
            )
        if first:
            return AnswerForm(lambda text: collapse(first_line(text)), name="first line, whitespace collapsed")
    return PLAIN


# ---------------------------------------------------------------------- per-sample scorers
def exact_match(prediction: str, baseline: str, form: AnswerForm = PLAIN) -> float:
    """1.0 when the two answers are equal after the form's normalisation, else 0.0."""
    return float(form.normalise(prediction or "") == form.normalise(baseline or ""))


def rouge_l_f1(prediction: str, baseline: str, form: AnswerForm = PLAIN) -> float:
    """ROUGE-L F1 of the normalised answers (1 when equal, 0 when exactly one is empty)."""
    a, b = form.normalise(prediction or ""), form.normalise(baseline or "")
    if a == b:
        return 1.0
    if not a.strip() or not b.strip():
        return 0.0
    if form.zh:
        from kvbench.tasks.metrics import rouge_zh_score

        return float(rouge_zh_score(a, b))
    from kvbench.tasks.rag_metrics import rouge_l

    return float(rouge_l(a, b))


def jaccard(prediction: str, baseline: str, form: AnswerForm = PLAIN) -> float:
    """|A ∩ B| / |A ∪ B| of the normalised answers' token sets (1 when equal, both empty included)."""
    a, b = form.normalise(prediction or ""), form.normalise(baseline or "")
    if a == b:
        return 1.0
    ta, tb = set(form.tokens(a)), set(form.tokens(b))
    if not ta and not tb:
        return 1.0  # nothing but characters the tokens drop on either side
    return len(ta & tb) / len(ta | tb)


@dataclass(frozen=True)
class Agreement:
    exact: float  # 0 or 1
    rouge_l: float
    jaccard: float


def agreement(prediction: str, baseline: str, form: AnswerForm = PLAIN) -> Agreement:
    """The three scorers of one pair of answers."""
    return Agreement(
        exact=exact_match(prediction, baseline, form),
        rouge_l=rouge_l_f1(prediction, baseline, form),
        jaccard=jaccard(prediction, baseline, form),
    )


@dataclass(frozen=True)
class Summary:
    """One run against its baseline over ``n`` paired samples: means and 95 % bootstrap intervals."""

    n: int
    exact_pct: float
    exact_ci: tuple[float, float] | None
    rouge_l: float
    rouge_l_ci: tuple[float, float] | None
    jaccard: float
    jaccard_ci: tuple[float, float] | None


def summarise(pairs: list[Agreement]) -> Summary:
    """Means over the pairs (exact agreement in %), each with :func:`kvbench.stats.bootstrap_mean`'s interval."""
    import numpy as np

    from kvbench.stats import bootstrap_mean

    if not pairs:
        nan = float("nan")
        return Summary(0, nan, None, nan, None, nan, None)
    exact = np.array([100.0 * p.exact for p in pairs])
    rouge = np.array([p.rouge_l for p in pairs])
    jac = np.array([p.jaccard for p in pairs])
    return Summary(
        len(pairs),
        float(exact.mean()),
        bootstrap_mean(exact),
        float(rouge.mean()),
        bootstrap_mean(rouge),
        float(jac.mean()),
        bootstrap_mean(jac),
    )


def compare(run: Any, base: Any) -> list[Agreement]:
    """Per-sample agreement of ``run``'s predictions with ``base``'s (sample frames of one run each), on
    the ids both have a prediction for, in ``run``'s order."""
    ours, theirs = _predictions(run), _predictions(base)
    return [agreement(text, theirs[i][0], form) for i, (text, form) in ours.items() if i in theirs]


def _predictions(frame: Any) -> dict[str, tuple[str, AnswerForm]]:
    if "prediction" not in frame.columns:
        return {}
    task = frame["config.task.name"] if "config.task.name" in frame.columns else None
    subset = frame["subset"] if "subset" in frame.columns else None
    out: dict[str, tuple[str, AnswerForm]] = {}
    for index, (sample_id, text) in enumerate(zip(frame["id"], frame["prediction"])):
        if not isinstance(text, str):
            continue  # no prediction (a failed sample)
        t = task.iloc[index] if task is not None else None
        s = subset.iloc[index] if subset is not None else None
        out[str(sample_id)] = (text, answer_form(t if isinstance(t, str) else None, s if isinstance(s, str) else None))
    return out


# ---------------------------------------------------------------------- the render item
def check(options: Mapping[str, Any]) -> None:
    """An ``agreement`` item names its baseline run as a selector mapping."""
    if not isinstance(options.get("baseline"), Mapping) or not options["baseline"]:
        raise ConfigError("agreement: baseline must select the baseline run", "e.g. baseline: {method: full}")
    if "versus" in options and (not isinstance(options["versus"], Mapping) or not options["versus"]):
        raise ConfigError("agreement: versus must select the run to compare with", "e.g. versus: {method: full_reuse}")


def render_agreement(exp: Any, spec: Mapping[str, Any], runs: Any, samples: Any) -> list[Any]:
    """``agreement``: every run against the ``baseline`` run of its group (``split``), on their common
    sample ids; rows keyed by ``by``; ``match`` keys the baseline must share with the run."""
    import pandas as pd

    from kvbench.render.frames import Section, against_baseline, select, values
    from kvbench.render.text import table_section

    baseline = spec["baseline"]
    title = spec.get("title") or f"agreement with {', '.join(f'{k}={v}' for k, v in baseline.items())}'s answers"
    if runs.empty or samples is None or samples.empty:
        return [Section(title, markdown="(no finished runs yet)")]
    split, by = list(spec.get("split", ["model"])), list(spec.get("by", ["method", "budget"]))
    match = list(spec.get("match", []))
    frame = select(samples, spec.get("where"))
    by_run = {k: dict(zip(runs["run_id"], values(runs, k))) for k in by}  # the run's budget label, not the sample's
    shown, numbers = [], []
    forms: dict[str, dict[str, None]] = {}  # normalisation -> the data sets it applies to (ordered set)
    for label, run_id, run, base in against_baseline(frame, split, baseline, match):
        pairs = compare(run, base)
        if not pairs:
            continue
        for subset, name in _form_names(run).items():
            forms.setdefault(name, {})[subset] = None
        result = summarise(pairs)
        keys = {
            **({"split": label} if split else {}),
            **{k: by_run[k].get(run_id, values(run, k).iloc[0]) for k in by},
        }
        shown.append(
            {
                **keys,
                "n": result.n,
                "exact %": f"{result.exact_pct:.1f} {_ci(result.exact_ci, 1)}",
                "ROUGE-L F1": f"{result.rouge_l:.3f} {_ci(result.rouge_l_ci, 3)}",
                "Jaccard": f"{result.jaccard:.3f} {_ci(result.jaccard_ci, 3)}",
            }
        )
        numbers.append(
            {
                **keys,
                "n": result.n,
                **_columns("exact_pct", result.exact_pct, result.exact_ci),
                **_columns("rouge_l_f1", result.rouge_l, result.rouge_l_ci),
                **_columns("jaccard", result.jaccard, result.jaccard_ci),
            }
        )
    if not shown:
        return [Section(title, markdown="(no pairs: the runs share no answered samples with the baseline)")]
    table = pd.DataFrame(shown)
    named = "; ".join(f"{', '.join(s)}: {n}" if any(s) else n for n, s in forms.items())
    note = (
        "Per sample against the baseline's answer to the same id: exact = equal after the task's answer "
        f"normalisation ({named}); ROUGE-L F1 and Jaccard of token sets of the normalised answers; means "
        "with 95 % bootstrap intervals over the paired samples."
    )
    sections = [table_section(title, table, pd.DataFrame(numbers).to_csv(index=False), note=note)]
    if spec.get("versus"):
        sections.append(_versus_section(frame, spec, split, match, by, by_run))
    return sections


def _versus_section(
    frame: Any, spec: Mapping[str, Any], split: list[str], match: list[str], by: list[str], by_run: dict[str, Any]
) -> Any:
    """Per run, its agreement with the baseline minus the ``versus`` run's, paired by sample."""
    import numpy as np
    import pandas as pd

    from kvbench.render.frames import Section, against_baseline, select, values
    from kvbench.render.text import table_section
    from kvbench.stats import bootstrap_diff

    baseline, versus = spec["baseline"], spec["versus"]
    named = ", ".join(f"{k}={v}" for k, v in versus.items())
    title = f"agreement with {', '.join(f'{k}={v}' for k, v in baseline.items())}'s answers: each run minus {named}"
    shown, numbers = [], []
    for label, run_id, run, base in against_baseline(frame, split, baseline, match):
        other = select(frame, versus)
        for key in [*split, *match]:
            other = other[values(other, key) == values(run, key).iloc[0]]
        if other["run_id"].nunique() != 1 or run_id in set(other["run_id"]):
            continue
        ours, theirs, truth = _predictions(run), _predictions(other), _predictions(base)
        ids = [i for i in ours if i in theirs and i in truth]
        if not ids:
            continue
        a = [agreement(ours[i][0], truth[i][0], ours[i][1]) for i in ids]
        b = [agreement(theirs[i][0], truth[i][0], theirs[i][1]) for i in ids]
        rouge = (np.array([p.rouge_l for p in a]), np.array([p.rouge_l for p in b]))
        exact = (np.array([100.0 * p.exact for p in a]), np.array([100.0 * p.exact for p in b]))
        keys = {**({"split": label} if split else {}), **{k: by_run[k].get(run_id, values(run, k).iloc[0]) for k in by}}
        d_rouge, d_exact = float((rouge[0] - rouge[1]).mean()), float((exact[0] - exact[1]).mean())
        ci_rouge, ci_exact = bootstrap_diff(*rouge), bootstrap_diff(*exact)
        shown.append(
            {
                **keys,
                "n": len(ids),
                "Δ ROUGE-L F1": f"{d_rouge:+.3f} {_ci(ci_rouge, 3)}",
                "Δ exact %": f"{d_exact:+.1f} {_ci(ci_exact, 1)}",
            }
        )
        numbers.append(
            {
                **keys,
                "n": len(ids),
                **_columns("d_rouge_l_f1", d_rouge, ci_rouge),
                **_columns("d_exact_pct", d_exact, ci_exact),
            }
        )
    if not shown:
        return Section(title, markdown=f"(no pairs: no run shares answered samples with both the baseline and {named})")
    note = (
        f"Per sample: the run's agreement with the baseline's answer minus {named}'s, on the ids all three answered; "
        "mean with a 95 % bootstrap interval over those samples (an interval above 0: closer to the baseline "
        f"than {named})."
    )
    return table_section(title, pd.DataFrame(shown), pd.DataFrame(numbers).to_csv(index=False), note=note)


def _form_names(frame: Any) -> dict[str, str]:
    """Data set (subset) -> the name of its answer normalisation, for the runs in ``frame``."""
    task = frame["config.task.name"] if "config.task.name" in frame.columns else [None] * len(frame)
    subset = frame["subset"] if "subset" in frame.columns else [None] * len(frame)
    out: dict[str, str] = {}
    for t, s in zip(task, subset):
        t, s = (t if isinstance(t, str) else None), (s if isinstance(s, str) else None)
        out.setdefault(s or "", answer_form(t, s).name)
    return out


def _ci(ci: tuple[float, float] | None, digits: int) -> str:
    return "[–]" if ci is None else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _columns(name: str, mean: float, ci: tuple[float, float] | None) -> dict[str, float | None]:
    return {name: mean, f"{name}_ci_low": ci[0] if ci else None, f"{name}_ci_high": ci[1] if ci else None}
