"""LongBench v1 metrics with the official names, signatures and semantics (quirks included).

Every function is ``(prediction, ground_truth, **kwargs) -> float`` in [0, 1], as in LongBench's
``metrics.py``; ``score_sample`` / ``score_dataset`` / ``score_dataset_e`` follow ``eval.py``. The
quirks are kept on purpose, because published numbers were computed with them:

* ``classification_score`` removes items from the list it iterates over, so a match after a removed
  one is skipped; the score is ``1 / len(matches)`` when the label survives, else 0 (the
  similarity fallback of the official file is dead code: it tests ``list != 0``).
* ``rouge_score`` uses the ``rouge`` package (not Google's ``rouge-score``) and returns 0.0 when it
  raises (an empty prediction does).
* ``retrieval_score`` / ``count_score`` are the share of the numbers in the prediction that equal the
  answer ("Paragraph 3 or 30" scores 0.5).
* ``code_sim_score`` scores the first line without a backtick, ``#`` or ``//`` with fuzzywuzzy's
  ``fuzz.ratio`` as it runs without python-Levenshtein (LongBench's requirements do not install it):
  ``round(100 · difflib ratio) / 100``, 1.0 for identical strings, 0.0 when one is empty. It is
  computed with difflib directly, so installing python-Levenshtein cannot change the numbers.
* trec, triviaqa, samsum and lsht score only the first line of the prediction; every sample takes
  the max over its reference answers; a dataset scores ``round(100 · mean, 2)``.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")
ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～"
    "｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _jieba() -> Any:
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return jieba


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, drop articles, collapse whitespace (in that order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, remove all whitespace."""
    punctuation = set(string.punctuation + ZH_PUNCTUATION)
    s = "".join(ch for ch in s.lower() if ch not in punctuation)
    return "".join(s.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    jieba = _jieba()
    pred = [normalize_zh_answer(t) for t in jieba.cut(prediction, cut_all=False)]
    gold = [normalize_zh_answer(t) for t in jieba.cut(ground_truth, cut_all=False)]
    return f1_score([t for t in pred if t], [t for t in gold if t])


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official code returns 0 on any failure (e.g. an empty prediction)
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    jieba = _jieba()
    prediction = " ".join(jieba.cut(prediction, cut_all=False))
    ground_truth = " ".join(jieba.cut(ground_truth, cut_all=False))
    return rouge_score(prediction, ground_truth)


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    for term in matches:  # mutates the list while iterating, exactly as the official code does
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return float(sum(1 for n in numbers if str(n) == str(target)) / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _share_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _share_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    return _share_equal(prediction, ground_truth)


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 ``fuzz.ratio`` on its pure-Python (difflib) path."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


DATASET2METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def score_sample(dataset: str, prediction: str, answers: Sequence[str], all_classes: Any = None) -> float:
    """One sample in [0, 1]: first-line trimming where the protocol says, max over the answers."""
    dataset = dataset.removesuffix("_e")
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def score_dataset(
    dataset: str, predictions: Sequence[str], answers: Sequence[Sequence[str]], all_classes: Any = None
) -> float:
    """``eval.py``'s ``scorer``: ``round(100 · mean, 2)`` over the samples."""
    total = sum(score_sample(dataset, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)


def score_dataset_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Any = None,
) -> dict[str, float]:
    """``eval.py``'s ``scorer_e``: the same per length bucket (words, or characters for Chinese)."""
    import numpy as np

    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for prediction, answer, length in zip(predictions, answers, lengths):
        key = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[key].append(score_sample(dataset, prediction, answer, all_classes))
    return {key: round(100 * float(np.mean(values)), 2) for key, values in buckets.items()}
