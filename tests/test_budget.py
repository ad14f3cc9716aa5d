import math

import pytest

from kvbench.budget import BudgetConfig, MethodBudgetDefaults, full_budget, resolve_budget
from kvbench.errors import BudgetError

PQ = MethodBudgetDefaults(sink=32, local_fraction=0.5)
DROP = MethodBudgetDefaults(sink=32, local_fraction=0.5, compensable=True)


def test_ratio_follows_pqcache_code_accounting():
    # s = 10,000 at ratio 1/5: B = 0.2 * (10000 - 32) = 1993 (floor), local = 996, select = 997.
    b = resolve_budget(BudgetConfig(token_ratio=0.2), 10_000, PQ, "pqcache")
    assert (b.sink, b.local, b.select) == (32, 996, 997)
    assert b.total == 32 + 1993 and b.compresses


def test_absolute_tokens_win_over_ratio():
    b = resolve_budget(BudgetConfig(token_ratio=0.5, tokens=256), 4096, PQ, "oracle")
    assert b.budget == 256 and b.local == 128 and b.select == 128


def test_compensation_is_byte_matching_and_only_for_dropping_methods():
    cfg = BudgetConfig(token_ratio=0.1, comm_ratio=1 / 128, compensate=True)
    s = 4096
    dropped = resolve_budget(cfg, s, DROP, "h2o")
    room = s - 32
    assert dropped.compensation == math.floor(room / 256)
    assert dropped.budget == math.floor(0.1 * room) + math.floor(room / 256)
    offloaded = resolve_budget(cfg, s, PQ, "pqcache")
    assert offloaded.compensation == 0 and offloaded.budget == math.floor(0.1 * room)


def test_local_override_and_its_limit():
    b = resolve_budget(BudgetConfig(tokens=100, local=10), 1000, PQ, "oracle")
    assert (b.local, b.select) == (10, 90)
    with pytest.raises(BudgetError, match="budget.local"):
        resolve_budget(BudgetConfig(tokens=100, local=101), 1000, PQ, "oracle")


def test_a_budget_beyond_a_prompt_covers_it_and_says_so():
    """A LongBench sample of 1595 tokens under ClusterKV's 2048-token budget attends everything (the
    papers' code does; the run used to stop there), and the sample's budget record says why."""
    b = resolve_budget(BudgetConfig(tokens=1100), 1000, PQ, "oracle", capacity=1100)
    assert b.budget == 1100 - 32 and not b.compresses and "covers" not in b.source
    beyond = resolve_budget(BudgetConfig(tokens=2048), 1595, PQ, "quest", capacity=1595 + 64)
    assert beyond.total == 1595 + 64 and not beyond.compresses
    assert "covers the context (1595 prompt tokens + 64 generated)" in beyond.source


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(token_ratio=0.0),
        dict(token_ratio=1.5),
        dict(tokens=0),
        dict(tokens=-5),
        dict(comm_ratio=-0.1),
        dict(sink=-1),
    ],
)
def test_invalid_budgets_are_rejected(kwargs):
    with pytest.raises(BudgetError):
        BudgetConfig(**kwargs)


def test_missing_budget_names_the_fix():
    with pytest.raises(BudgetError, match="budget.token_ratio"):
        resolve_budget(BudgetConfig(), 1000, PQ, "oracle")


def test_unknown_budget_key():
    unknown = r"budget has no parameter budget\.ratio \(did you mean budget\.comm_ratio\?\)"
    with pytest.raises(BudgetError, match=unknown):
        BudgetConfig.from_mapping({"ratio": 0.1})


def test_full_budget_does_not_compress():
    assert not full_budget(10).compresses


def test_budget_labels_name_every_setting_that_changes_results():
    from kvbench.methods import create_method

    h2o, oracle, full = (create_method({"name": n}) for n in ("h2o", "oracle", "full"))
    assert oracle.budget_label(BudgetConfig(token_ratio=0.1)) == "ratio 0.1"
    assert oracle.budget_label(BudgetConfig(tokens=256, comm_ratio=1 / 128)) == "256 tokens, comm 1/128"
    compensated = BudgetConfig(token_ratio=0.1, comm_ratio=1 / 64, compensate=True)
    assert h2o.budget_label(compensated) == "ratio 0.1, comm 1/64 (C)"
    assert oracle.budget_label(compensated) == "ratio 0.1, comm 1/64"
    assert oracle.budget_label(BudgetConfig(token_ratio=0.2, comm_ratio=0.003)) == "ratio 0.2, comm 0.003"
    assert full.budget_label(compensated) == "full cache"
