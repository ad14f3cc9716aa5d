"""How the engine runs a decode step (the ``engine.*`` config keys): settings that change speed, not results.

``decode``
    ``static`` (default) — the capturable step of :mod:`kvbench.engine.decode`: K/V buffers allocated
    once per request and written in place at a device-side length, positions and lengths as device
    tensors, the next token chosen on the device, selections of fixed shape; the same op stream at
    every step of a length bucket. ``dynamic`` — the earlier step (host-side lengths and positions,
    the next token read at every step), kept as the reference the static step is tested against.
``cuda_graph``
    On a CUDA device, capture the static step once per (request, length bucket, method regime) and
    replay it: ``auto`` (default: on CUDA), ``true`` (fails on a CPU-only machine), ``false``.
``bucket_tokens``
    Attention over a layer's held tokens runs over a buffer prefix that grows in steps of this many
    slots (slots past the length are masked), so the op shapes stay fixed between bucket boundaries.
``decode_attention``
    The kernel of a decode step's attention over a layer's held slots (``full``'s layers and every
    method's dense layers): ``sdpa`` (default) — PyTorch's fused attention with the length mask (on CUDA
    its memory-efficient kernel, which runs one thread block per (KV head, query block): 8 blocks a layer
    for an 8-KV-head model); ``matmul`` — two batched GEMMs (scores, then probabilities times values)
    around a float32 softmax, as transformers' eager attention computes it, the keys and values read by
    as many blocks as cuBLAS tiles them into; ``split`` — flash-decoding: the slots in chunks of
    ``split_tokens``, one Triton program per (KV head, chunk) computing the chunk's partial softmax and
    weighted values, merged by their log-sum-exp (CUDA with Triton; on a CPU it computes ``matmul``'s
    softmax unsplit). The three differ only in floating-point rounding (``tests/test_decode_kernels.py``).
``split_tokens``
    Slots per chunk of ``decode_attention=split``.
``readback_every``
    Generated tokens are read back to the host (stop ids, stop texts) every this many steps;
    ``auto`` = every step on a CPU (reading costs nothing there), every 8 on a GPU. Greedy decoding is
    causal, so the steps run past a stop change nothing that is kept: their tokens and figures are
    dropped.

None of these keys is part of a run's id (:data:`kvbench.results.UNHASHED`): the static and dynamic
steps attend the same tokens and give the same outputs (``tests/test_decode_static.py``), and the
graph replays the eager step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvbench.errors import ConfigError
from kvbench.params import Params, param

if TYPE_CHECKING:  # (this module is read by `kvbench run`'s checks, which must not import torch)
    import torch


@dataclass(frozen=True)
class EngineSettings(Params):
    decode: Literal["static", "dynamic"] = param(
        "static", "static: the capturable decode step | dynamic: the earlier host-driven step (reference)"
    )
    cuda_graph: bool | Literal["auto"] = param("auto", "capture and replay the static step on CUDA (auto: on CUDA)")
    bucket_tokens: int = param(256, "attention shapes grow in steps of this many slots (static decode)", min=1)
    decode_attention: Literal["sdpa", "matmul", "split"] = param(
        "sdpa", "decode attention over held slots: sdpa | matmul (two GEMMs, fp32 softmax) | split (flash-decoding)"
    )
    split_tokens: int = param(256, "slots per chunk of decode_attention=split", min=16)
    readback_every: int | Literal["auto"] = param(
        "auto", "read the generated tokens back every this many steps (auto: 1 on a CPU, 8 on a GPU)", min=1
    )

    def validate(self) -> None:
        if self.cuda_graph is True and self.decode != "static":
            raise ConfigError(
                "engine.cuda_graph=true needs engine.decode=static (only the static step can be captured)",
                "drop engine.cuda_graph or use engine.decode=static",
            )

    def graphs_on(self, device: torch.device) -> bool:
        """Whether decode steps are captured and replayed on ``device``."""
        if self.decode != "static" or self.cuda_graph is False:
            return False
        if self.cuda_graph is True and device.type != "cuda":
            raise ConfigError(
                f"engine.cuda_graph=true needs a CUDA device, the model is on {device}",
                "use engine.cuda_graph=auto (graphs on CUDA only) or false",
            )
        return device.type == "cuda"

    def readback(self, device: torch.device) -> int:
        """Steps between reads of the generated tokens on ``device``."""
        if self.readback_every == "auto":
            return 8 if device.type == "cuda" else 1
        return int(self.readback_every)


def engine_settings(node: object | None) -> EngineSettings:
    """The ``engine`` config node as :class:`EngineSettings` (unknown keys and bad values: one error line)."""
    from kvbench.params import parse

    mapping = dict(node) if node else {}  # type: ignore[call-overload]
    return parse(EngineSettings, mapping, owner="engine", prefix="engine.")  # type: ignore[return-value]
