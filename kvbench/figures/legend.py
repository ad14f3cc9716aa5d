"""How a paper's figures name and draw kvbench's methods, and the part each method plays in them.

The figure builders (:mod:`kvbench.figures.rag`, :mod:`kvbench.figures.rag_system`) know no method by
name: a :class:`Legend` gives each method its label, colour, marker and line style (in the legend's
order) and names the methods that play a part — the ``baseline`` every other method is compared with,
the ``subject`` swept over its recompute ratio, and the ``reuse`` method at that sweep's r = 0 end.
A paper's legend is data in its published-numbers file (``legend:`` in ``results/papers/<paper>.yaml``,
schema in :mod:`kvbench.papers`); :func:`paper_legend` reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from kvbench.errors import ConfigError


@dataclass(frozen=True)
class Style:
    """A method's label and how its series are drawn (``color`` empty: the next spare colour)."""

    label: str
    color: str = ""
    marker: str = "o"
    line: str = "--"


@dataclass(frozen=True)
class Legend:
    """The methods' styles in legend order, and the methods that play the figures' parts (see the module doc)."""

    methods: Mapping[str, Style]
    baseline: str
    subject: str
    reuse: str

    def style(self, method: str) -> Style:
        """``method``'s style; a method the legend does not list is labelled by its name."""
        return self.methods.get(method) or Style(method)

    def label(self, method: str) -> str:
        return self.style(method).label

    def rank(self, method: str) -> int:
        """``method``'s place in the legend's order (after every listed method when it is not listed)."""
        order = list(self.methods)
        return order.index(method) if method in order else len(order)


@functools.cache
def paper_legend(paper: str) -> Legend:
    """The legend of ``paper``'s figures, from its published-numbers file."""
    from kvbench.papers import LEGEND_ROLES, load_paper

    data = load_paper(paper).legend
    if not data:
        raise ConfigError(f"paper {paper!r} has no legend for its figures", f"add one to results/papers/{paper}.yaml")
    methods = {name: Style(**spec) for name, spec in data["methods"].items()}
    return Legend(methods, **{role: data["roles"][role] for role in LEGEND_ROLES})
