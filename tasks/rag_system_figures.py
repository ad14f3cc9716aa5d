"""The rag task's system figures under their old import path, bound to the rag task's legend.

The figures live in :mod:`kvbench.figures.rag_system`; see :mod:`kvbench.tasks.rag_figures` for why
these bindings remain (callers that still import from here: tests/test_stream.py).
"""

from __future__ import annotations

from kvbench.figures import rag_system
from kvbench.figures.rag_system import SYSTEM_FIGURE_KINDS
from kvbench.tasks.rag_figures import bind

__all__ = ["SYSTEM_FIGURE_KINDS", "equal_quality_points", "pipelines", "retrieval", "scaling", "storage"]

equal_quality_points = bind(rag_system.equal_quality_points)
retrieval = bind(rag_system.retrieval)
scaling = bind(rag_system.scaling)
pipelines = bind(rag_system.pipelines)
storage = bind(rag_system.storage)
