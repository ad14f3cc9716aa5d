"""What the rest of kvbench needs to know about a loaded model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvbench.models import DTYPE_NAMES


@dataclass(frozen=True)
class ModelSpec:
    """Shape and protocol facts of a causal LM (attention layout, limits, stop tokens)."""

    name: str
    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_length: int
    stop_ids: tuple[int, ...]
    rope_theta: float | None
    dtype: str
    device: str

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of one token's K and V over all layers and KV heads."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * element_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stop_ids"] = list(self.stop_ids)
        return data


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a ``model.dtype`` name (:data:`kvbench.models.DTYPE_NAMES`) means; KeyError otherwise."""
    return getattr(torch, DTYPE_NAMES[name])
