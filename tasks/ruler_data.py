"""RULER's synthetic data: seeded generators of a context and the questions it answers.

Each generator is a pure function of a :class:`random.Random` and a size (``units``: haystack words,
noise paragraphs, distractor needles, distinct words, documents) and returns a :class:`Draw` — the
context text, every question that context can answer on its own, and which of them RULER asks
together as its one question. Keeping the questions apart lets a later caller ask them one by one
about the same context (shared-context multi-query); :func:`ruler_question` rebuilds RULER's single
question (``"k1, k2, and k3"`` with all their values).

The semantics follow NVIDIA/RULER's ``scripts/data/synthetic/*.py`` (read, not copied):

* **niah** — needles "One of the special magic {type} for {key} is: {value}." in one of three
  haystacks: ``essay`` (the essays' words, sentence-split, needles at depths drawn from 40 evenly
  spaced percentages), ``noise`` (the repeated "The grass is green. ..." paragraph, one per line) or
  ``needle`` (lines that are needles of other random keys). Keys and values are ``words``
  (adjective-noun pairs), 7-digit ``numbers`` or ``uuids``. RULER's question asks ``num_queries`` of
  the ``max(num_keys, num_queries)`` keys.
* **variable_tracking** — chains ``VAR A = 12345``, ``VAR B = VAR A``, ... (5 uppercase letters per
  name, ``num_hops`` links) on noise lines, in order; the question gives the value, the answer is every
  name of the chain.
* **common_words** — a numbered list where ``num_cw`` words appear ``freq_cw`` times and the others
  ``freq_ucw`` times; the answer is the common words.
* **freq_words** — random 6-letter "coded" words with Zipf counts ``int(n · k^-alpha / zeta(alpha))``
  for rank ``k``; rank 1 is the noise word ``...``; the answer is ranks 2–4.
* **qa** — SQuAD / HotpotQA documents ("Document i:\\n...") around a question's gold documents.

Two deliberate differences in *how* the randomness is drawn (the distributions are RULER's): every
choice that does not depend on the size is drawn first, and size-dependent choices are drawn so that a
larger size extends a smaller one (a random order of all words, cut), so fitting a sample to its
length changes its haystack and nothing else — its needles, values and question stay the same; and
keys are drawn distinct, with distractor keys never equal to a needle key (RULER does not check; a
collision would make the answer ambiguous).
"""

from __future__ import annotations

import json
import math
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from random import Random

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
#: RULER's needle depths: ``np.round(np.linspace(0, 100, 40))`` percent of the essay's sentences
DEPTHS = tuple(round(100 * k / 39) for k in range(40))
VALUE_TYPES = ("words", "numbers", "uuids")
HAYSTACKS = ("essay", "noise", "needle")
#: wonderwords' word lists as RULER reads them; their digest pins the samples (see :func:`word_lists`)
WONDERWORDS_VERSION = "3.0.1"
WORDS_SHA256 = "659fde97e05ffb6469caea57bc269cad6c9480976cfb39259c4a7e5244571aa1"


@dataclass(frozen=True)
class Question:
    """One question about a context: the template's ``{query}`` and every string the answer must hold."""

    query: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Draw:
    """A generated context, the questions it answers, and RULER's question (``asked``).

    ``examples`` are few-shot draws (variable tracking, common words) shown, answered, before the
    task's instruction.
    """

    context: str
    questions: tuple[Question, ...]
    asked: tuple[int, ...] = (0,)
    examples: tuple[Draw, ...] = field(default=())


def ruler_question(draw: Draw) -> Question:
    """RULER's one question: the asked keys joined as ``"a, b, and c"``, their answers in that order."""
    picked = [draw.questions[i] for i in draw.asked]
    queries = [q.query for q in picked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    return Question(query, tuple(a for q in picked for a in q.answers))


# ---------------------------------------------------------------------------------------------- words
@lru_cache(maxsize=1)
def word_lists() -> dict[str, tuple[str, ...]]:
    """wonderwords' nouns, adjectives and verbs (sorted, unique), checked against :data:`WORDS_SHA256`.

    The samples depend on these lists, so another wonderwords release that changed them would change
    every sample under the same run id; that is refused instead.
    """
    import hashlib
    from importlib.resources import files

    from kvbench.errors import ConfigError

    try:
        from wonderwords.random_word import Defaults
    except ImportError:
        raise ConfigError(
            "RULER's word lists need the wonderwords package", f"pip install wonderwords=={WONDERWORDS_VERSION}"
        ) from None
    lists = {}
    for name, member in (("nouns", Defaults.NOUNS), ("adjectives", Defaults.ADJECTIVES), ("verbs", Defaults.VERBS)):
        text = files("wonderwords.assets").joinpath(member.value).read_text(encoding="utf-8")
        lists[name] = tuple(sorted({line.rstrip() for line in text.splitlines() if line.strip()}))
    digest = hashlib.sha256("\n".join("\n".join(v) for v in lists.values()).encode()).hexdigest()
    if digest != WORDS_SHA256:
        raise ConfigError(
            f"the installed wonderwords has other word lists than the {WONDERWORDS_VERSION} RULER samples are built on",
            f"pip install wonderwords=={WONDERWORDS_VERSION}",
        )
    return lists


@lru_cache(maxsize=1)
def common_words_vocabulary() -> tuple[str, ...]:
    """The common-words task's vocabulary: nouns, adjectives and verbs together (RULER's ``words``)."""
    lists = word_lists()
    return tuple(sorted(set(lists["nouns"]) | set(lists["adjectives"]) | set(lists["verbs"])))


def random_value(rng: Random, kind: str) -> str:
    """A needle key or value: an adjective-noun pair, a 7-digit number or a UUID4 string."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        lists = word_lists()
        return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"
    raise ValueError(f"unknown needle type {kind!r} (use {', '.join(VALUE_TYPES)})")


def distinct(make: Callable[[], str], count: int, avoid: Sequence[str] = ()) -> list[str]:
    """``count`` results of ``make()`` that differ from each other and from ``avoid``, in draw order."""
    out: list[str] = []
    taken = set(avoid)
    while len(out) < count:
        value = make()
        if value not in taken:
            taken.add(value)
            out.append(value)
    return out


# ------------------------------------------------------------------------------------------ haystacks
_SENTENCE_END = re.compile(r"(?<=[.!?][\"')\]]) |(?<=[.!?]) ")


def split_sentences(text: str) -> list[str]:
    """Sentences of whitespace-normalised text: a break after ``.``/``!``/``?`` (and a closing quote or
    bracket) followed by a space. RULER uses nltk's punkt model, whose data cannot be fetched offline;
    this rule only decides where needles may go, never what the text says."""
    return [s for s in _SENTENCE_END.split(text) if s]


def essay_words(text: str) -> tuple[str, ...]:
    """The essays as RULER's word haystack: whitespace collapsed to single spaces, split on spaces."""
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def _essay_with(words: Sequence[str], units: int, inserts: Sequence[str], depths: Sequence[int]) -> str:
    """The first ``units`` words (repeated when short), with ``inserts`` between sentences at ``depths``."""
    repeats = -(-units // len(words))
    sentences = split_sentences(" ".join((list(words) * repeats)[:units]))
    points = sorted(int(len(sentences) * depth / 100) for depth in depths)
    pieces, last = [], 0
    for point, insert in zip(points, inserts):
        pieces += [" ".join(sentences[last:point]), insert]
        last = point
    pieces.append(" ".join(sentences[last:]))
    return " ".join(p for p in pieces if p)


def _lines_with(rng: Random, lines: list[str], inserts: Sequence[str]) -> list[str]:
    """``lines`` with each insert placed before a distinct random line (RULER's descending inserts)."""
    lines = list(lines)
    for index, insert in zip(sorted(rng.sample(range(len(lines)), len(inserts)), reverse=True), inserts):
        lines.insert(index, insert)
    return lines


# ----------------------------------------------------------------------------------------- generators
def niah(
    rng: Random,
    units: int,
    *,
    haystack: str,
    key_type: str,
    value_type: str,
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    essay: Sequence[str] = (),
) -> Draw:
    """Needles in a haystack of ``units`` essay words, noise lines or distractor needles; one question
    per key (its values), RULER asking ``num_queries`` of them."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r} (use {', '.join(HAYSTACKS)})")
    num_keys = max(num_keys, num_queries)
    keys = distinct(lambda: random_value(rng, key_type), num_keys)
    values = [[random_value(rng, value_type) for _ in range(num_values)] for _ in keys]
    needles = [NEEDLE.format(type_needle_v=value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = tuple(rng.sample(range(num_keys), num_queries))
    questions = tuple(Question(k, tuple(vs)) for k, vs in zip(keys, values))
    if haystack == "essay":
        return Draw(_essay_with(essay, units, needles, rng.sample(DEPTHS, len(needles))), questions, asked)
    if haystack == "noise":
        lines = [NOISE] * units
    else:  # distractor needles, one draw each, so a longer haystack extends a shorter one
        lines, taken = [], set(keys)
        while len(lines) < units:
            key = random_value(rng, key_type)
            if key not in taken:
                taken.add(key)
                lines.append(NEEDLE.format(type_needle_v=value_type, key=key, value=random_value(rng, value_type)))
    return Draw("\n".join(_lines_with(rng, lines, needles)), questions, asked)


def variable_tracking(
    rng: Random,
    units: int,
    *,
    num_chains: int = 1,
    num_hops: int = 4,
    name_length: int = 5,
    examples: tuple[Draw, ...] = (),
) -> Draw:
    """``num_chains`` assignment chains of ``num_hops`` links, each link on its own line, in order, among
    ``units`` noise lines; one question per chain (its value → all its names), RULER asking the first."""
    names = distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)), num_chains * (num_hops + 1))
    chain_values = distinct(lambda: str(rng.randint(10000, 99998)), num_chains)  # np.random.randint(10000, 99999)
    chains, questions = [], []
    for c, value in enumerate(chain_values):
        chain_names = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chains.append(
            [f"VAR {chain_names[0]} = {value}"]
            + [f"VAR {chain_names[j + 1]} = VAR {chain_names[j]} " for j in range(num_hops)]
        )
        questions.append(Question(value, tuple(chain_names)))
    lines = [NOISE] * units
    for chain in chains:
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for offset, (position, link) in enumerate(zip(positions, chain)):
            lines.insert(position + offset, link)
    return Draw("\n".join(lines), tuple(questions), (0,), examples)


def common_words(
    rng: Random, units: int, *, num_cw: int = 10, freq_cw: int = 30, freq_ucw: int = 3, examples: tuple[Draw, ...] = ()
) -> Draw:
    """A numbered list of ``units`` distinct words: the first ``num_cw`` ``freq_cw`` times each, the rest
    ``freq_ucw`` times, shuffled; the answer is the ``num_cw`` common words."""
    vocabulary = common_words_vocabulary()
    if units > len(vocabulary):
        raise ValueError(f"common_words needs {units} distinct words; the vocabulary has {len(vocabulary)}")
    chosen = rng.sample(vocabulary, len(vocabulary))[:units]  # a random order, cut: sizes share a prefix
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    sequence = common * freq_cw + uncommon * freq_ucw
    rng.shuffle(sequence)
    return Draw(numbered(sequence), (Question("", tuple(common)),), (0,), examples)


def numbered(words: Sequence[str]) -> str:
    """``"1. a 2. b 3. c"`` (RULER's list format, also its few-shot answers)."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def zeta(alpha: float) -> float:
    """Riemann zeta for ``alpha > 1`` (Euler–Maclaurin after 1000 terms; |error| < 1e-12 for alpha ≥ 1.1)."""
    if alpha <= 1:
        raise ValueError("zeta(alpha) diverges for alpha <= 1")
    n = 1000
    head = math.fsum(k**-alpha for k in range(1, n))
    return head + n ** (1 - alpha) / (alpha - 1) + n**-alpha / 2 + alpha * n ** (-alpha - 1) / 12


def freq_words(rng: Random, units: int, *, vocab_size: int, alpha: float = 2.0, word_length: int = 6) -> Draw:
    """``units`` words of a random coded vocabulary with Zipf counts; rank 1 is the noise ``...``."""
    vocabulary = sorted(distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=word_length)), vocab_size))
    rng.shuffle(vocabulary)
    vocabulary[0] = "..."
    z = zeta(alpha)
    sequence = [word for k, word in enumerate(vocabulary, start=1) for _ in range(int(units * k**-alpha / z))]
    rng.shuffle(sequence)
    return Draw(" ".join(sequence), (Question("", tuple(vocabulary[1:4])),))


# ----------------------------------------------------------------------------------------------- QA
@dataclass(frozen=True)
class QAItem:
    question: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]  # documents that hold the answer
    related: tuple[int, ...] = ()  # other documents of the same article (SQuAD)


@dataclass(frozen=True)
class QASet:
    items: tuple[QAItem, ...]
    documents: tuple[str, ...]


def read_squad(path: Path) -> QASet:
    """SQuAD (v2.0 dev as RULER downloads it): answerable questions, paragraphs as documents."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    documents = tuple(sorted({p["context"] for article in data for p in article["paragraphs"]}))
    index = {doc: i for i, doc in enumerate(documents)}
    items = []
    for article in data:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if not qa.get("is_impossible", False):
                    items.append(
                        QAItem(
                            qa["question"],
                            tuple(a["text"] for a in qa["answers"]),
                            (own,),
                            tuple(d for d in article_docs if d != own),
                        )
                    )
    return QASet(tuple(items), documents)


def read_hotpotqa(path: Path) -> QASet:
    """HotpotQA (dev, distractor setting): each question's ten paragraphs are its gold documents."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))

    def as_doc(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = tuple(sorted({as_doc(t, s) for row in data for t, s in row["context"]}))
    index = {doc: i for i, doc in enumerate(documents)}
    items = tuple(
        QAItem(row["question"], (row["answer"],), tuple(index[as_doc(t, s)] for t, s in row["context"])) for row in data
    )
    return QASet(items, documents)


def qa(rng: Random, units: int, *, dataset: QASet, item: int) -> Draw:
    """Question ``item`` with ``units`` documents: its gold ones, then its article's, then random others
    (all documents, repeated, when ``units`` exceeds them), shuffled and numbered."""
    entry = dataset.items[item % len(dataset.items)]
    gold, related = list(entry.gold), list(entry.related)
    total = len(dataset.documents)
    if units >= total:
        chosen = (list(range(total)) * -(-units // total))[:units]
    elif units - len(gold) <= len(related):
        chosen = gold + rng.sample(related, len(related))[: units - len(gold)]
    else:
        taken = set(gold) | set(related)
        others = [i for i in range(total) if i not in taken]
        extra = rng.sample(others, len(others))
        chosen = gold + related + extra[: units - len(gold) - len(related)]
    rng.shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{dataset.documents[d]}" for i, d in enumerate(chosen))
    return Draw(context, (Question(entry.question, entry.answers),))
