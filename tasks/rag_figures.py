"""The rag task's figures under their old import path, bound to the rag task's legend (CacheBlend's).

The figures live in :mod:`kvbench.figures.rag` and take the legend that names the methods as an
argument; these bind the one :meth:`kvbench.tasks.rag.Rag.comparison_figure` uses, for callers that
still import from here (tests/test_stream.py). New code imports :mod:`kvbench.figures`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvbench.figures import rag
from kvbench.figures.legend import Legend, paper_legend
from kvbench.figures.rag import FIGURE_KINDS, RunInfo

__all__ = ["FIGURE_KINDS", "bind", "deviation", "legend", "quality_ttft", "ratio", "run_infos", "selection"]

T = TypeVar("T")


def legend() -> Legend:
    """The legend the rag task's figures use."""
    from kvbench.tasks.rag import FIGURES_PAPER

    return paper_legend(FIGURES_PAPER)


def bind(builder: Callable[[list[RunInfo], Legend], T]) -> Callable[[list[RunInfo]], T]:
    """``builder`` with the rag task's legend."""

    def bound(infos: list[RunInfo]) -> T:
        return builder(infos, legend())

    bound.__name__ = bound.__qualname__ = builder.__name__
    bound.__doc__ = builder.__doc__
    return bound


def run_infos(runs: Sequence[Any]) -> list[RunInfo]:
    return rag.run_infos(runs, legend())


quality_ttft = bind(rag.quality_ttft)
ratio = bind(rag.ratio)
deviation = bind(rag.deviation)
selection = bind(rag.selection)
