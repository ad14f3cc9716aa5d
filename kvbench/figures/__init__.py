"""Figures built from finished runs, as panels of data that :mod:`kvbench.plots` draws.

* :mod:`kvbench.figures.rag` — the rag task's quality figures in the shape of CacheBlend's (Figs. 6,
  7-8, 12, 16), and :func:`~kvbench.figures.rag.draw`, which draws any of the rag task's kinds;
* :mod:`kvbench.figures.rag_system` — its system-experiment figures (Figs. 2, 13, 15, 17);
* :mod:`kvbench.figures.legend` — how a paper's figures name and draw the methods, read from the
  paper's data file: the figures themselves name no method.

A task reaches them through its ``comparison_figure`` (``kvbench report --figure``, and an experiment's
``figure`` render item); the other tasks' figures (NIAH heatmaps, PG19 curves, the request stream) are
drawn by :mod:`kvbench.plots` directly.
"""
