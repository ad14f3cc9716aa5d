"""Re-chunking, top-k order, mean pooling and the two retrievers of the rag task."""

import math

import numpy as np
import pytest
import torch

from kvbench.tasks.rag import fit_chunks
from kvbench.tasks.rag_retrieval import BM25Retriever, mean_pool_normalize, rechunk, top_k

PASSAGES = [
    "The harvest festival in the valley lasts three days and features apple pies.",
    "Ada Lovelace was born in London in 1815, the daughter of the poet Lord Byron.",
    "Volcanic rock cools into basalt columns along the northern coast.",
    "Charles Babbage designed the Analytical Engine, for which Lovelace wrote notes.",
    "The river delta floods every spring, renewing the soil of the rice fields.",
    "A chess opening that sacrifices a pawn for quick development is called a gambit.",
]
QUESTION = "where was Ada Lovelace born?"


def test_rechunk_cuts_the_concatenation():
    assert rechunk([[1, 2, 3], [4, 5]], 2) == [[1, 2], [3, 4], [5]]
    assert rechunk([[1, 2, 3], [4, 5]], 10) == [[1, 2, 3, 4, 5]]


def test_top_k_keeps_original_order_and_breaks_ties_early():
    assert top_k([0.5, 0.1, 0.1, 0.9], 2) == [1, 2]
    assert top_k([0.5, 0.1, 0.1, 0.9], 3) == [0, 1, 2]
    assert top_k([0.3, 0.2, 0.1], 1) == [2]


def test_fit_chunks_drops_from_the_middle_then_cuts():
    chunks = [[i] * 5 for i in range(4)]
    kept, dropped, cut = fit_chunks(chunks, 12)  # 20 > 12: drop index 2 (15 > 12), then index 1 -> 10
    assert [c[0] for c in kept] == [0, 3] and dropped == 2 and not cut
    kept, dropped, cut = fit_chunks(chunks, 3)
    assert kept == [[0, 0, 0]] and dropped == 3 and cut
    assert fit_chunks(chunks, 20) == (chunks, 0, False)


def test_mean_pooling_by_hand():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the padded third token is ignored: mean (2, 3), norm sqrt(13)
    out = mean_pool_normalize(hidden, mask)
    assert torch.allclose(out, torch.tensor([[2.0, 3.0]]) / math.sqrt(13))


def test_bm25_prefers_the_passage_with_the_question_terms():
    distances = BM25Retriever().distances(QUESTION, PASSAGES)
    assert int(np.argmin(distances)) == 1
    assert top_k(distances, 2) == [1, 3]  # the two Lovelace passages, in their original order


@pytest.mark.integration
def test_minilm_matches_sentence_transformers_semantics():
    """all-MiniLM-L6-v2 through plain transformers: unit vectors, the answer passage nearest."""
    from kvbench.tasks.rag_retrieval import retriever

    minilm = retriever("minilm")
    vectors = minilm.embed([QUESTION, *PASSAGES, "word " * 400])  # the last one exceeds 256 word pieces
    assert vectors.shape == (8, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    distances = minilm.distances(QUESTION, PASSAGES)
    assert int(np.argmin(distances)) == 1
    # independent recomputation: mean of the unpadded token states of one text, by hand
    batch = minilm.tokenizer([PASSAGES[2]], return_tensors="pt")
    with torch.inference_mode():
        states = minilm.model(**batch).last_hidden_state[0]
    mean = states.mean(dim=0)
    assert np.allclose(vectors[3], (mean / mean.norm()).numpy(), atol=1e-5)


@pytest.mark.integration
def test_the_retriever_loads_without_a_weight_bar_in_a_log(capsys):
    """Built with stderr redirected (a run's log), the MiniLM retriever prints no "Loading weights" bar."""
    from kvbench.assets import fetch_asset
    from kvbench.tasks.rag_retrieval import MINILM_ASSET, MiniLMRetriever

    MiniLMRetriever(str(fetch_asset(MINILM_ASSET)))  # not the cached retriever(): a fresh load
    assert "Loading weights" not in capsys.readouterr().err
