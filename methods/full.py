"""``full``: no compression. Every token is kept on the device and attended."""

from __future__ import annotations

from kvbench.methods import register
from kvbench.methods.base import KVMethod


@register
class Full(KVMethod):
    """The reference every other method is measured against (dense prefill, dense decode)."""

    name = "full"
    family = "dense"
