"""``full``: no compression. Every token is kept on the device and attended."""

from __future__ import annotations

from kvbench.engine.protocol import KVMethod
from kvbench.methods import register
from kvbench.params import Params as NoParams


@register
class Full(KVMethod):
    """The reference every other method is measured against (dense prefill, dense decode)."""

    name = "full"
    family = "dense"
    Params = NoParams  # it attends everything: no sink or window to set
