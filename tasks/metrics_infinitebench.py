"""InfiniteBench scorers with the official semantics (``src/compute_scores.py``), both revisions.

``scorer_version`` picks the revision of the tasks whose scorer changed:

* ``"2024-06"`` — the repository head of June 2024: En.Dia is correct when ``labels[0]`` is one of the
  prediction's words (punctuation replaced by spaces, words upper-cased; the label is compared as
  given); En.MC looks at the prediction's first character, then at "answer is:"-style prefixes, then
  at the first standalone A–D word; Code.Debug checks ``"X."``/``"X:"`` at the start, then prefixes.
* ``"2024-08"`` — after the fix of issue #18: En.Dia is correct when any label, upper-cased, is a
  substring of the upper-cased prediction; En.MC first takes the last standalone letter A–D
  (``\\b[A-D]\\b(?!.*\\b[A-D]\\b)``), then the older rules; Code.Debug also accepts the last standalone
  A–J letter, a prediction starting with the letter or the function name, and "correct option is:".

The other tasks: passkey / number_string — the first run of digits equals the label; kv_retrieval —
the label is one of the words after replacing ``\\n : " ' . , ? ! { }`` by spaces; math_find — the
first ``\\d+\\.\\d+|\\d+`` equals the label as int or float; code_run — the last word is the integer
label; math_calc — the share of leading values that match; En.QA — token F1 (LongBench
normalisation), Zh.QA — character F1, both max over labels; En.Sum — ROUGE-Lsum F-measure as Hugging
Face ``evaluate``'s ``rouge`` computes it (Google ``rouge-score``, no stemming, newline-split
sentences), max over references. Scores are in [0, 1]; a task's score is ``100 · mean``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from kvbench.tasks.metrics import f1_score, normalize_answer, normalize_zh_answer

VERSIONS = ("2024-06", "2024-08")
_RETRIEVAL_CHARS = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def first_int_match(prediction: str) -> str:
    for item in re.split("[^0-9]", prediction):
        if item != "":
            return item
    return ""


def _words(prediction: str, chars: Sequence[str]) -> list[str]:
    for c in chars:
        prediction = prediction.replace(c, " ")
    return prediction.split()


def _squash(prediction: str, chars: Sequence[str]) -> str:
    for c in chars:
        prediction = prediction.replace(c, " ")
    while "  " in prediction:
        prediction = prediction.replace("  ", " ")
    return prediction


def _first(labels: Any) -> str:
    return str(labels[0] if isinstance(labels, (list, tuple)) else labels)


def passkey(prediction: str, labels: Any) -> bool:
    return _first(labels) == first_int_match(prediction)


def kv_retrieval(prediction: str, labels: Any) -> bool:
    return _first(labels) in _words(prediction, _RETRIEVAL_CHARS)


def math_find(prediction: str, labels: Any) -> bool:
    label: Any = labels[0] if isinstance(labels, (list, tuple)) else labels
    if isinstance(label, str):
        try:
            label = int(label)
        except ValueError:
            label = float(label)
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return False
    text = found.group(0).strip()
    if isinstance(label, int):
        return "." not in text and int(text) == label
    return float(text) == label


def code_run(prediction: str, labels: Any) -> bool:
    words = _words(prediction.strip(), ["\n", ".", "`", "'", '"', ":"])
    if not words:
        return False
    try:
        return int(words[-1]) == int(_first(labels))
    except ValueError:
        return False


def math_calc(prediction: str, labels: Any) -> float:
    label = labels[0] if labels and isinstance(labels[0], list) else labels
    numbers = [int(item) for item in re.split("[^0-9]", prediction) if item != ""]
    count = 0
    for expected, got in zip(label, numbers):
        if int(expected) != got:
            break
        count += 1
    return count / len(label)


def longdialogue_qa_eng(prediction: str, labels: Any, version: str) -> bool:
    labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
    if version == "2024-06":
        words = [w.upper() for w in _words(prediction, _RETRIEVAL_CHARS)]
        return labels[0] in words
    upper = prediction.strip().upper()
    return any(str(label).upper() in upper for label in labels)


def longbook_choice_eng(prediction: str, labels: Any, version: str) -> bool:
    labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
    if version == "2024-08":
        prediction = prediction.strip()
        last = re.search(r"\b[A-D]\b(?!.*\b[A-D]\b)", prediction)
        if last and last.group(0) in labels:
            return True
    if prediction == "":
        return False
    if prediction[0] in "ABCD":
        return prediction[0] in labels
    if version == "2024-08" and prediction in labels:
        return True
    prediction = _squash(prediction, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"])
    found, after = _after_prefix(prediction, ("answer is:", "answer:", "answer is", "option is"))
    if found:
        return after is not None and any(after.startswith(label) for label in labels)
    for word in prediction.split():
        if word in "ABCD":
            return word in labels
    return False


def code_debug(prediction: str, labels: Any, version: str) -> bool:
    function, letter = str(labels[0]), str(labels[1])
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return True
    prefixes = ["answer is:", "is:", "answer:"]
    if version == "2024-08":
        last = re.search(r"\b[A-J]\b(?!.*\b[A-J]\b)", prediction)
        if last and last.group(0) == letter:
            return True
        prefixes.append("correct option is:")
    prediction = _squash(prediction.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"])
    if version == "2024-08" and (prediction.startswith(letter) or prediction.startswith(function)):
        return True
    found, after = _after_prefix(prediction, prefixes)
    return found and after is not None and (after.startswith(letter) or after.startswith(function))


def _after_prefix(prediction: str, prefixes: Any) -> tuple[bool, str | None]:
    """The official scorers' prefix rule: whether one of ``prefixes`` occurs in ``prediction`` (the first
    of them, in order, that does) and what follows it after one separator character (None: nothing)."""
    for prefix in prefixes:
        at = prediction.find(prefix)
        if at == -1:
            continue
        if len(prediction) < at + len(prefix) + 1:
            return True, None
        return True, prediction[at + len(prefix) + 1 :]
    return False, None


def longbook_qa_eng(prediction: str, labels: Any) -> float:
    labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
    return max(f1_score(normalize_answer(prediction).split(), normalize_answer(label).split()) for label in labels)


def longbook_qa_chn(prediction: str, labels: Any) -> float:
    labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
    return max(f1_score(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(label))) for label in labels)


@lru_cache(maxsize=1)
def _rouge_lsum() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def longbook_sum_eng(prediction: str, labels: Any) -> float:
    labels = list(labels) if isinstance(labels, (list, tuple)) else [labels]
    return max(_rouge_lsum().score(label, prediction)["rougeLsum"].fmeasure for label in labels)


_SIMPLE = {
    "passkey": passkey,
    "number_string": passkey,
    "kv_retrieval": kv_retrieval,
    "math_find": math_find,
    "math_calc": math_calc,
    "code_run": code_run,
    "longbook_qa_eng": longbook_qa_eng,
    "longbook_qa_chn": longbook_qa_chn,
    "longbook_sum_eng": longbook_sum_eng,
}
_VERSIONED = {
    "longdialogue_qa_eng": longdialogue_qa_eng,
    "longbook_choice_eng": longbook_choice_eng,
    "code_debug": code_debug,
}


def score_sample(task: str, prediction: str, labels: Any, scorer_version: str = "2024-08") -> float:
    """One sample's score in [0, 1]."""
    if scorer_version not in VERSIONS:
        raise ValueError(f"unknown InfiniteBench scorer version {scorer_version!r}; use one of {VERSIONS}")
    if task in _VERSIONED:
        return float(_VERSIONED[task](prediction, labels, scorer_version))
    if task in _SIMPLE:
        return float(_SIMPLE[task](prediction, labels))
    raise ValueError(f"unknown InfiniteBench task {task!r}")


def score_task(task: str, predictions: Sequence[str], labels: Sequence[Any], scorer_version: str = "2024-08") -> float:
    """``100 · mean`` over the samples."""
    scores = [score_sample(task, p, label, scorer_version) for p, label in zip(predictions, labels)]
    return 100 * sum(scores) / len(scores)
