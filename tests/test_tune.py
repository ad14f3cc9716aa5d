"""The ``tune`` render item (kvbench.render.tune): a parameter tuned for the lowest cost whose quality
against the baseline reaches a target, as Cache-Craft's alpha is tuned (cachecraft/alpha)."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.errors import ConfigError
from kvbench.render import check_render
from kvbench.render.tune import render_tune, tuned

FULL = ["london", "paris", "rome", "oslo"]


def _frames(answers: dict[str, tuple[float | None, list[str], list[float]]]):
    """runs / samples frames: per run id, (alpha or None for full, its four answers, its four scores)."""
    costs = {"full": 1.0, "a05": 0.2, "a1": 0.4, "a2": 0.7}
    runs = pd.DataFrame(
        [
            {"run_id": run, "method": "full" if alpha is None else "cachecraft", "config.method.alpha": alpha,
             "compute_ratio": costs[run]}
            for run, (alpha, _, _) in answers.items()
        ]
    )  # fmt: skip
    samples = pd.DataFrame(
        [
            {"run_id": run, "method": "full" if alpha is None else "cachecraft", "config.method.alpha": alpha,
             "id": f"q{i}", "prediction": text, "score": score, "config.task.name": "rag_stream"}
            for run, (alpha, texts, scores) in answers.items()
            for i, (text, score) in enumerate(zip(texts, scores))
        ]
    )  # fmt: skip
    return runs, samples


SPEC = {"baseline": {"method": "full"}, "over": "alpha", "cost": "compute_ratio", "quality": "rouge_l_f1"}


def test_the_cheapest_value_that_reaches_the_target_is_tuned():
    runs, samples = _frames(
        {
            "full": (None, FULL, [100, 100, 0, 100]),
            "a05": (0.5, ["london", "berlin", "madrid", "oslo"], [100, 0, 0, 100]),  # 2 of 4 agree: 0.5
            "a1": (1.0, ["london", "paris", "madrid", "oslo"], [100, 100, 0, 100]),  # 3 of 4: 0.75
            "a2": (2.0, FULL, [100, 100, 0, 100]),  # all four: 1.0
        }
    )
    (section,) = render_tune(None, {**SPEC, "target": 0.7}, runs, samples)
    shown = section.frame
    assert list(shown["alpha"]) == ["0.5", "1", "2"]  # by cost
    assert list(shown["rouge_l_f1"]) == ["0.500", "0.750", "1.000"]
    assert list(shown[">= 0.7"]) == ["no", "yes", "yes"]
    assert section.note.startswith("Tuned: alpha = 1, compute_ratio 0.400, rouge_l_f1 0.750")
    (strict,) = render_tune(None, {**SPEC, "target": 0.9}, runs, samples)
    assert strict.note.startswith("Tuned: alpha = 2,")
    (none,) = render_tune(None, {**SPEC, "target": 1.5}, runs, samples)
    assert none.note.startswith("No value of alpha reaches rouge_l_f1 >= 1.5")
    (by_score,) = render_tune(None, {**SPEC, "quality": "score_ratio", "target": 0.9}, runs, samples)
    assert list(by_score.frame["score_ratio"]) == ["0.667", "1.000", "1.000"]  # 200/300, 300/300
    assert by_score.note.startswith("Tuned: alpha = 1,")


def test_tuned_skips_missing_quality_and_cost():
    rows = [
        {"alpha": "1", "cost": float("nan"), "quality": 0.9},
        {"alpha": "2", "cost": 0.5, "quality": float("nan")},
        {"alpha": "3", "cost": 0.8, "quality": 0.9},
    ]
    assert tuned(rows, 0.8)["alpha"] == "3"
    assert tuned(rows[:2], 0.8) is None


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"over": "alpha", "cost": "compute_ratio", "quality": "rouge_l_f1", "target": 0.8}, "baseline"),
        ({**SPEC, "quality": "bleu", "target": 0.8}, "quality 'bleu'"),
        ({**SPEC, "target": "high"}, "target 'high'"),
        ({**SPEC, "over": "", "target": 0.8}, "over must name"),
        ({**SPEC, "target": 0.8, "minimise": "x"}, "unknown options"),
    ],
)
def test_a_bad_tune_item_is_one_clear_error(options, needle):
    with pytest.raises(ConfigError, match=needle):
        check_render({"tune": options})
