"""Scorers of CacheBlend's evaluation scripts (``example/utils.py`` @ 55ad026), pinned down exactly.

**F1 (QA: Musique, 2WikiMQA).** ``compute_f1(pred, gold, tokenizer)`` in CacheBlend's code:

1. ``parse_generation``: drop leading newlines and keep the first line only; an answer starting
   with "Yes"/"yes" becomes "Yes"; otherwise one whose first *word* starts with "No"/"no" becomes
   "No". The second test is a prefix test on the word, so "Norway", "November" and "nobody" collapse
   to "No" as well — a quirk of the released code, kept because published numbers include it.
2. SQuAD normalisation of both strings (lower-case, drop ASCII punctuation, drop the articles
   a/an/the, collapse whitespace) — the same function as LongBench's, reused from
   :mod:`kvbench.tasks.metrics`.
3. Tokenisation with the **evaluated model's tokenizer** (token ids, not words): the code takes
   ``tokenizer.encode(s)[1:]``, i.e. Mistral's ids without the BOS it prepends. Here the ids are
   ``tokenizer(s, add_special_tokens=False)`` — the same ids for Mistral, and the intended ones for
   tokenizers that prepend nothing (where ``[1:]`` would drop a real token).
4. Bag-of-ids F1; when either side is empty, 1 if both are, else 0; the sample's score is the max
   over its gold answers.

Deviation: the code raises ``IndexError`` on a prediction whose first line is blank (``s.split()[0]``);
here such a prediction stays empty and scores 0 (1 against an empty gold answer).

**Rouge-L (summaries).** ``compute_rl``: Google's ``rouge-score`` ``rougeL`` F-measure with the
Porter stemmer, ``scorer.score(gold, pred)``, max over references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from kvbench.tasks.metrics import normalize_answer

Encode = Callable[[str], Sequence[int]]


def parse_generation(text: str) -> str:
    """First line of the output, with CacheBlend's Yes/No collapse."""
    line = text.lstrip("\n").split("\n")[0]
    if line.startswith("Yes") or line.startswith("yes"):
        return "Yes"
    words = line.split()
    if words and (words[0].startswith("No") or words[0].startswith("no")):
        return "No"
    return line


def token_f1(prediction_ids: Sequence[int], gold_ids: Sequence[int]) -> float:
    """Bag-of-tokens F1 of two id sequences (SQuAD's ``compute_f1`` on ids)."""
    if not prediction_ids or not gold_ids:
        return float(list(prediction_ids) == list(gold_ids))
    same = sum((Counter(prediction_ids) & Counter(gold_ids)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_ids)
    recall = same / len(gold_ids)
    return 2 * precision * recall / (precision + recall)


def cacheblend_f1(prediction: str, gold: str, encode: Encode) -> float:
    """CacheBlend's ``compute_f1(prediction, gold, tokenizer)`` for one gold answer."""
    pred_ids = list(encode(normalize_answer(parse_generation(prediction))))
    gold_ids = list(encode(normalize_answer(gold)))
    return token_f1(pred_ids, gold_ids)


def best_f1(prediction: str, answers: Sequence[str], encode: Encode) -> float:
    """Max of :func:`cacheblend_f1` over the gold answers (0 when there are none)."""
    return max((cacheblend_f1(prediction, gold, encode) for gold in answers), default=0.0)


def tokenizer_encode(tokenizer: Any) -> Encode:
    """The F1 tokenisation of a model: its token ids without special tokens."""
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def rouge_l(prediction: str, reference: str) -> float:
    """Rouge-L F-measure with stemming (``rouge-score``), as CacheBlend's ``compute_rl``."""
    return _rouge_l_scorer().score(reference, prediction)["rougeL"].fmeasure


def best_rouge_l(prediction: str, references: Sequence[str]) -> float:
    return max((rouge_l(prediction, ref) for ref in references), default=0.0)


@lru_cache(maxsize=1)
def _rouge_l_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
