"""RULER's protocol: the 13 synthetic tasks, their templates and answer prefixes, and the scorers.

Tasks and their arguments mirror RULER's ``scripts/synthetic.yaml``; templates, answer prefixes and
generation lengths its ``scripts/data/synthetic/constants.py``; the metrics its
``scripts/eval/synthetic/constants.py`` (``string_match_all`` for the synthetic tasks,
``string_match_part`` for QA). RULER puts the answer prefix after the model's chat template, as the
start of the assistant's reply; :func:`render` returns it apart for that reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.tasks.ruler_data import Draw, Question, numbered


@dataclass(frozen=True)
class Family:
    """One of RULER's task families: its prompt template (``{context}`` once), answer prefix, generation
    length and metric."""

    template: str
    answer_prefix: str
    max_new_tokens: int
    metric: str  # "all" (string_match_all) | "part" (string_match_part)


FAMILIES: dict[str, Family] = {
    "niah": Family(
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128,
        "all",
    ),
    "variable_tracking": Family(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
        30,
        "all",
    ),
    "common_words_extraction": Family(
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120,
        "all",
    ),
    "freq_words_extraction": Family(
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50,
        "all",
    ),
    "qa": Family(
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        32,
        "part",
    ),
}

#: RULER's synthetic.yaml: task name → (family, arguments)
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah", dict(haystack="noise", key_type="words", value_type="numbers")),
    "niah_single_2": ("niah", dict(haystack="essay", key_type="words", value_type="numbers")),
    "niah_single_3": ("niah", dict(haystack="essay", key_type="words", value_type="uuids")),
    "niah_multikey_1": ("niah", dict(haystack="essay", key_type="words", value_type="numbers", num_keys=4)),
    "niah_multikey_2": ("niah", dict(haystack="needle", key_type="words", value_type="numbers")),
    "niah_multikey_3": ("niah", dict(haystack="needle", key_type="uuids", value_type="uuids")),
    "niah_multivalue": ("niah", dict(haystack="essay", key_type="words", value_type="numbers", num_values=4)),
    "niah_multiquery": ("niah", dict(haystack="essay", key_type="words", value_type="numbers", num_queries=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
QA_TASKS = ("qa_1", "qa_2")


@dataclass(frozen=True)
class PromptText:
    """A prompt as text: ``before`` + ``context`` + ``after`` is the user message (few-shot examples and
    the instruction before the context, the question after it); ``answer_prefix`` starts the reply."""

    before: str
    context: str
    after: str
    answer_prefix: str

    @property
    def user(self) -> str:
        return self.before + self.context + self.after


def render(task: str, draw: Draw, question: Question) -> PromptText:
    """The prompt RULER builds for ``question`` about ``draw`` (few-shot examples included)."""
    family_name, args = TASKS[task]
    head, tail, prefix = _filled(family_name, args, question)
    examples = ""
    for example in draw.examples:
        (example_question,) = example.questions
        e_head, e_tail, e_prefix = _filled(family_name, args, example_question)
        # RULER: the variable-tracking example answers with the names and ends in a blank line; the
        # common-words one answers with a numbered list and ends in a newline
        tracking = family_name == "variable_tracking"
        answer = " " + (" ".join(example_question.answers) if tracking else numbered(example_question.answers))
        examples += e_head + example.context + e_tail + e_prefix + answer + ("\n\n" if tracking else "\n")
    return PromptText(examples + head, draw.context, tail, prefix)


def _filled(family_name: str, args: dict[str, Any], question: Question) -> tuple[str, str, str]:
    """The template's text before and after ``{context}`` and the answer prefix, filled for ``question``."""
    family = FAMILIES[family_name]
    template, prefix = family.template, family.answer_prefix
    fields: dict[str, Any] = {"query": question.query}
    if family_name == "niah":
        kind = args["value_type"]
        if len(question.answers) == 1:  # RULER's singular wording when num_needle_q * num_needle_v == 1
            replace = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))
            for old, new in replace:
                template, prefix = template.replace(old, new), prefix.replace(old, new)
            kind = kind[:-1]
        fields["type_needle_v"] = kind
    if family_name == "variable_tracking":
        fields["num_v"] = len(question.answers)
    head, tail = template.split("{context}")
    return head.format(**fields), tail.format(**fields), prefix.format(**fields)


# ---------------------------------------------------------------------------------------------- scoring
def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of the references found in the prediction (case-insensitive substring), in [0, 1]."""
    text = prediction.lower()
    return sum(1.0 for r in references if r.lower() in text) / len(references) if references else 0.0


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any reference is found in the prediction (case-insensitive substring), else 0."""
    text = prediction.lower()
    return 1.0 if any(r.lower() in text for r in references) else 0.0


METRICS = {"all": string_match_all, "part": string_match_part}


def score(task: str, prediction: str, references: Sequence[str]) -> float:
    """A sample's score on 0–100 with its task's metric. (RULER first strips the prediction and turns
    control characters into newlines, which cannot change a substring match of its references.)"""
    return 100.0 * METRICS[FAMILIES[TASKS[task][0]].metric](prediction, references)
