import torch

from kvbench.kv.store import LayerKV
from kvbench.methods.selection import aggregate, compose, exact_topk, layout, topk_sorted


def kv_with(n, heads=2, dim=4):
    kv = LayerKV(heads, dim, dtype=torch.float32, device=torch.device("cpu"))
    kv.append(torch.randn(heads, n, dim), torch.randn(heads, n, dim))
    return kv


def test_layout_splits_sink_middle_local_and_current():
    lay = layout(kv_with(20), sink=3, local=5)
    # current token = slot 19; local = 14..18; middle = 3..13
    assert (lay.sink_end, lay.middle_end, lay.middle) == (3, 14, 11)
    assert lay.fixed(torch.device("cpu")).tolist() == [0, 1, 2, 14, 15, 16, 17, 18, 19]
    sel = compose(lay, torch.tensor([[10, 4], [5, 6]]))
    assert sel.slots.tolist()[0] == [0, 1, 2, 4, 10, 14, 15, 16, 17, 18, 19]
    assert sel.attended == 11 and sel.candidates.tolist() == list(range(3, 14))


def test_layout_of_a_short_cache_has_no_middle():
    lay = layout(kv_with(6), sink=4, local=8)
    assert lay.middle == 0 and lay.fixed(torch.device("cpu")).tolist() == list(range(6))


def test_topk_sorted_breaks_ties_by_position():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0]])
    assert topk_sorted(scores, 2).tolist() == [[1, 2]]


def test_gqa_rules_can_disagree():
    # two query heads of one KV head; token 0 is liked a lot by head 0 only, token 1 a bit by both
    logits = torch.tensor([[[10.0, 4.0, 0.0], [-10.0, 4.0, 0.0]]])
    assert aggregate(logits, "logit_sum", 1.0).argmax().item() == 1
    assert aggregate(logits, "max", 1.0).argmax().item() == 0
    # softmax per head: head 0 -> [0.9975, 0.0025, 0.0], head 1 -> [0.0, 0.9820, 0.0180];
    # sums [0.9975, 0.9845, 0.0180]: token 0 wins, unlike the logit sum (14 vs 8 for token 1 vs 0)
    softmax = aggregate(logits, "softmax_sum", 1.0)
    assert softmax.argmax().item() == 0
    assert torch.allclose(softmax, torch.softmax(logits, -1).sum(1))


def test_exact_topk_per_kv_head_and_per_query_head():
    keys = torch.zeros(1, 6, 2)
    keys[0, 2] = torch.tensor([5.0, 0.0])
    keys[0, 4] = torch.tensor([0.0, 5.0])
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)  # two query heads, one KV head
    cand = torch.arange(1, 6)
    shared = exact_topk(query, keys, cand, 2, group=2, per_query_head=False, scale=1.0)
    assert shared.tolist() == [[2, 4]]
    own = exact_topk(query, keys, cand, 1, group=2, per_query_head=True, scale=1.0)
    assert own.tolist() == [[2], [4]]
