"""Golden cases for the rag scorers: CacheBlend's token-id F1 and Rouge-L (expected values by hand)."""

import pytest

from kvbench.tasks.rag_metrics import (
    best_f1,
    best_rouge_l,
    cacheblend_f1,
    parse_generation,
    rouge_l,
    token_f1,
)

words = str.split  # a whitespace "tokenizer": one token per word, so the expected values are countable by hand


@pytest.mark.parametrize(
    "raw, parsed",
    [
        ("\n\nExeter College\nsecond line", "Exeter College"),  # leading newlines dropped, first line kept
        ("yes, it is", "Yes"),
        ("Yesterday", "Yes"),  # prefix test on the text, as the released code does
        ("no.", "No"),
        ("Norway", "No"),  # prefix test on the first word: CacheBlend's quirk
        ("The answer is no", "The answer is no"),
        ("", ""),  # the code raises IndexError here; kvbench keeps it empty
        ("   \nParis", "   "),  # first line is blank: stays blank (scores as empty)
    ],
)
def test_parse_generation(raw, parsed):
    assert parse_generation(raw) == parsed


@pytest.mark.parametrize(
    "prediction, gold, expected",
    [
        # "eiffel tower paris" vs "eiffel tower in paris": 3 common, P = 3/3, R = 3/4 -> 2·1·0.75/1.75 = 6/7
        ("The Eiffel Tower, Paris!\nignored", "Eiffel tower in Paris", 6 / 7),
        # repeated tokens count once per match: "paris paris london" vs "paris": 1 common, P = 1/3, R = 1 -> 0.5
        ("Paris paris London", "Paris", 0.5),
        ("yes, definitely", "Yes", 1.0),
        ("Norway", "Norway", 0.0),  # collapsed to "No" before scoring
        ("No, never", "no", 1.0),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),  # empty prediction, non-empty gold: 0
        ("   \nParis", "the", 1.0),  # both normalise to nothing ("the" is an article): 1, as in the code
    ],
)
def test_f1_golden_with_a_whitespace_tokenizer(prediction, gold, expected):
    assert cacheblend_f1(prediction, gold, words) == pytest.approx(expected)


def test_f1_is_the_max_over_gold_answers():
    # "exeter" vs "exeter college": P = 1, R = 1/2 -> 2/3; vs "oxford university": 0
    assert best_f1("Exeter", ["Oxford University", "Exeter College"], words) == pytest.approx(2 / 3)
    assert best_f1("Exeter", [], words) == 0.0


def test_token_f1_counts_ids():
    assert token_f1([1, 2, 2, 3], [2, 2, 4]) == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert token_f1([], []) == 1.0 and token_f1([], [1]) == 0.0 and token_f1([5], [6]) == 0.0


@pytest.mark.integration
def test_f1_uses_the_model_tokenizer_ids():
    """Word F1 of "Oxford University" vs "University of Oxford" is 0.8; over SmolLM2's ids it is 2/7."""
    from transformers import AutoTokenizer

    from kvbench.models.loading import converted_model_dir
    from kvbench.tasks.rag_metrics import tokenizer_encode

    tokenizer = AutoTokenizer.from_pretrained(str(converted_model_dir("smollm2_135m")))

    def pieces(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)

    # only "ford" is shared: "ox"/"Ġox" and "Ġuniversity"/"university" are different ids
    assert pieces("oxford university") == ["ox", "ford", "Ġuniversity"]
    assert pieces("university of oxford") == ["university", "Ġof", "Ġox", "ford"]
    assert cacheblend_f1("Oxford University", "University of Oxford", words) == pytest.approx(0.8)
    # 1 common id: P = 1/3, R = 1/4 -> 2·(1/12)/(7/12) = 2/7
    encode = tokenizer_encode(tokenizer)
    assert cacheblend_f1("Oxford University", "University of Oxford", encode) == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [
        # LCS(the cat lay on the mat, the cat sat on the mat) = 5 of 6 both ways -> 5/6
        ("the cat lay on the mat", "The cat sat on the mat.", 5 / 6),
        # stemming: dogs->dog, running->run, runs->run ("dog" has 3 letters and is left as is); LCS = [dog, run]:
        # P = 2/2, R = 2/4 -> 2/3 (without stemming nothing matches)
        ("dog runs", "the dogs were running", 2 / 3),
        ("", "anything here", 0.0),
    ],
)
def test_rouge_l_golden(prediction, reference, expected):
    assert rouge_l(prediction, reference) == pytest.approx(expected)


def test_rouge_l_takes_the_best_reference():
    assert best_rouge_l("dog runs", ["unrelated words", "the dogs were running"]) == pytest.approx(2 / 3)
