"""Golden cases for the LongBench and InfiniteBench scorers, worked out by hand from the official semantics."""

import pytest

from kvbench.tasks import metrics as lb
from kvbench.tasks import metrics_infinitebench as ib


def test_qa_f1_normalises_case_punctuation_and_articles():
    # "The Eiffel Tower!" -> "eiffel tower"; "an eiffel tower in Paris" -> "eiffel tower in paris"
    # overlap 2; P = 2/2, R = 2/4 -> F1 = 2 * 1 * 0.5 / 1.5 = 2/3
    assert lb.qa_f1_score("The Eiffel Tower!", "an eiffel tower in Paris") == pytest.approx(2 / 3)
    assert lb.qa_f1_score("nothing", "something") == 0
    assert lb.normalize_answer("A  Cat, the DOG.") == "cat dog"


def test_qa_f1_zh_uses_jieba_words():
    pytest.importorskip("jieba")  # (installed by make install; a GPU machine's carry may leave it behind)
    # jieba: "北京大学" is one word; prediction "北京大学。" -> ["北京大学"] (punctuation removed)
    assert lb.qa_f1_zh_score("北京大学。", "北京大学") == 1.0
    assert lb.normalize_zh_answer("你好， 世界！ABC") == "你好世界abc"


def test_rouge_uses_the_rouge_package_and_zero_on_errors():
    assert lb.rouge_score("", "the cat sat") == 0.0  # the rouge package raises on an empty hypothesis
    # identical single sentence -> rouge-l f = 1 (up to the package's 1e-8 smoothing)
    assert lb.rouge_score("the cat sat", "the cat sat") == pytest.approx(1.0, abs=1e-6)
    # The official dependency matters: the `rouge` package reports P = 0.8, R = 1.0 (F = 0.8889) for this
    # pair, where Google's rouge-score (LCS 4 of 5 tokens each way) gives 0.8; LongBench used `rouge`.
    assert lb.rouge_score("the cat sat on mat", "the cat on the mat") == pytest.approx(0.888889, abs=1e-5)
    from rouge_score import rouge_scorer

    google = rouge_scorer.RougeScorer(["rougeL"]).score("the cat on the mat", "the cat sat on mat")["rougeL"].fmeasure
    assert google == pytest.approx(0.8)


def test_classification_quirk_skips_an_item_after_a_removal():
    classes = ["Location", "Loc", "Abbreviation"]
    # matches = [Location, Loc, Abbreviation]; iterating: "Location" equals gt (kept), "Loc" is in gt and
    # differs -> removed; the removal shifts "Abbreviation" into the visited slot, so it is skipped
    # (a correct filter would have kept it too). Final list [Location, Abbreviation] -> 1/2.
    score = lb.classification_score("Location Loc Abbreviation", "Location", all_classes=classes)
    assert score == 0.5
    assert lb.classification_score("It is a Location", "Location", all_classes=classes) == 1.0
    assert lb.classification_score("Abbreviation", "Location", all_classes=classes) == 0.0


def test_retrieval_and_count_are_shares_of_numbers():
    assert lb.retrieval_score("Paragraph 3 or 30", "Paragraph 3") == 0.5
    assert lb.retrieval_score("no idea", "Paragraph 3") == 0.0
    assert lb.retrieval_zh_score("段落5", "段落5") == 1.0
    assert lb.count_score("There are 7 paragraphs, maybe 8 or 7.", "7") == pytest.approx(2 / 3)


def test_code_sim_takes_the_first_clean_line_and_fuzzywuzzy_ratio():
    prediction = "\n```python\n# comment\nreturn x + 1\n"
    # first line without ` # //: "return x + 1" == ground truth -> 100
    assert lb.code_sim_score(prediction, "return x + 1") == 1.0
    # difflib ratio("abcd", "abce") = 2*3/8 = 0.75 -> 75
    assert lb.code_sim_score("abcd", "abce") == 0.75
    assert lb.code_sim_score("// only comments", "x") == 0.0  # no clean line -> "" -> 0
    from fuzzywuzzy import fuzz

    for a, b in [("foo(bar)", "foo(baz)"), ("x = compute(a, b)", "y = compute(b, a)"), ("same", "same")]:
        assert lb.fuzz_ratio(a, b) == fuzz.ratio(a, b)


def test_score_sample_first_line_and_max_over_answers():
    # trec keeps only the first line: "Location\nHuman" -> "Location"
    assert lb.score_sample("trec", "\nLocation\nHuman", ["Location"], ["Location", "Human"]) == 1.0
    # hotpotqa keeps everything; max over answers picks the exact one
    assert lb.score_sample("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert lb.score_dataset("hotpotqa", ["Paris", "Rome"], [["Paris"], ["Paris"]]) == 50.0
    assert lb.score_dataset("passage_count", ["1", "2", "3"], [["1"], ["1"], ["1"]]) == 33.33  # round(100/3, 2)


def test_longbench_e_buckets():
    # ("a" would normalise to "" and score 0: articles are dropped)
    scores = lb.score_dataset_e("hotpotqa", ["cat", "dog", "cow"], [["cat"], ["x"], ["cow"]], [100, 5000, 9000])
    assert scores == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}


def test_infinitebench_retrieval_and_math():
    assert ib.score_sample("passkey", "The pass key is 71432.", ["71432"]) == 1.0
    assert ib.score_sample("passkey", "Maybe 2 or 71432", ["71432"]) == 0.0  # first run of digits only
    assert ib.score_sample("kv_retrieval", 'value: "a-b-c".', ["a-b-c"]) == 1.0
    assert ib.score_sample("math_find", "It is 42, I think", ["42"]) == 1.0
    assert ib.score_sample("math_find", "3.5", [3.5]) == 1.0
    assert ib.score_sample("code_run", "The value is `17`.", [17]) == 1.0
    assert ib.score_sample("math_calc", "[1, 3, 7, 2]", [[1, 3, 6, 2]]) == 0.5


def test_dialogue_scorer_revisions_differ():
    # 2024-06: label[0] must be a whole word; 2024-08: any label as a case-insensitive substring
    assert ib.score_sample("longdialogue_qa_eng", "I think it's ROCKY.", ["ROCKY"], "2024-06") == 1.0
    # "'" is replaced by a space, so "Rocky's" still yields the word ROCKY; "-" is not replaced
    assert ib.score_sample("longdialogue_qa_eng", "Rocky's friend", ["ROCKY"], "2024-06") == 1.0
    assert ib.score_sample("longdialogue_qa_eng", "a Rocky-like man", ["ROCKY"], "2024-06") == 0.0
    assert ib.score_sample("longdialogue_qa_eng", "a Rocky-like man", ["ROCKY"], "2024-08") == 1.0
    assert ib.score_sample("longdialogue_qa_eng", "Adrian", ["ROCKY", "ADRIAN"], "2024-06") == 0.0
    assert ib.score_sample("longdialogue_qa_eng", "Adrian", ["ROCKY", "ADRIAN"], "2024-08") == 1.0


def test_choice_scorer_revisions_differ():
    labels = ["Paris", "B"]
    # 2024-06 reads the first character ("A"); 2024-08 first takes the last standalone letter ("B")
    assert ib.score_sample("longbook_choice_eng", "A is wrong, the answer is B", labels, "2024-06") == 0.0
    assert ib.score_sample("longbook_choice_eng", "A is wrong, the answer is B", labels, "2024-08") == 1.0
    assert ib.score_sample("longbook_choice_eng", "The answer is: B", labels, "2024-06") == 1.0
    assert ib.score_sample("longbook_choice_eng", "I'd say Paris", labels, "2024-06") == 0.0


def test_code_debug_and_qa():
    labels = ["parse_header", "C"]
    assert ib.score_sample("code_debug", "C. parse_header", labels, "2024-06") == 1.0
    # "option is: C": the "is:" prefix matches in both revisions
    assert ib.score_sample("code_debug", "The correct option is: C", labels, "2024-06") == 1.0
    # no prefix, no "C." start: only 2024-08's last-standalone-letter rule (A-J; "I" then "C") finds it
    assert ib.score_sample("code_debug", "I believe it is C", labels, "2024-06") == 0.0
    assert ib.score_sample("code_debug", "I believe it is C", labels, "2024-08") == 1.0
    assert ib.score_sample("longbook_qa_eng", "The red house", ["a red house", "blue"]) == 1.0
    # Zh.QA is character F1: "北京" vs "北京市": overlap 2, P = 1, R = 2/3 -> F1 = 0.8
    assert ib.score_sample("longbook_qa_chn", "北京", ["北京市"]) == pytest.approx(0.8)


def test_summary_rouge_lsum():
    score = ib.score_sample("longbook_sum_eng", "the cat sat.\nthe dog ran.", ["the cat sat.\nthe dog ran."])
    assert score == pytest.approx(1.0)
    assert ib.score_sample("longbook_sum_eng", "zebra", ["the cat sat"]) == 0.0
