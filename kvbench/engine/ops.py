"""What a decode step asks of the device: every aten op it issues, and the ones that wait for the device.

A decode step that a CUDA graph can capture and replay has three properties, all of which can be
checked on a CPU, because they are properties of the *op stream* the host issues, not of the device:

* **no host reads** — no op whose result the host must wait for: ``.item()`` / ``int(t)`` /
  ``float(t)`` (``aten.item``, ``aten._local_scalar_dense``), ``bool(t)`` (``aten.is_nonzero``),
  data-dependent output shapes (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
  ``repeat_interleave``; expand and reshape repeat rows without it), and no
  ``.tolist()`` / ``.cpu()`` / ``.numpy()`` of a tensor (on a GPU each one is a blocking copy);
* **no host data** — no tensor built from Python data inside the step (``torch.tensor([...])``,
  ``aten.lift_fresh``): on a GPU that is a host→device copy per step;
* **a static op stream** — the ops, their shapes and their non-tensor arguments are the same from one
  step to the next (inside a length bucket): a captured graph bakes all three in.

:class:`OpRecorder` records the stream of one step under a ``TorchDispatchMode`` (it sees the ops after
autograd and composite decompositions, what a device would run) and patches the host-read methods of
``torch.Tensor`` for the duration. ``kvbench bench decode_host`` reports its counts per method, and
``tests/test_decode_static.py`` fails when a sync or a changing op comes back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: aten ops whose result the host must wait for on a GPU (a scalar read or a data-dependent shape)
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "nonzero",
        "is_nonzero",
        "masked_select",
        "bincount",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "repeat_interleave",
    }
)
#: aten ops that turn host data into a tensor (a host→device copy on a GPU)
HOST_DATA_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})
#: ``torch.Tensor`` methods that copy a tensor to the host (each a blocking transfer from a GPU)
HOST_READ_METHODS = ("tolist", "cpu", "numpy")  # (item(), int(t), float(t): the aten op item)
#: ops that only describe a tensor (no kernel): left out of the op count, kept in the static check
VIEW_ONLY = frozenset(
    {
        "detach",
        "alias",
        "_unsafe_view",
        "view",
        "expand",
        "slice",
        "select",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "permute",
        "as_strided",
        "_reshape_alias",
    }
)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype), value.device.type)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)):
        return value
    if isinstance(value, torch.memory_format):
        return str(value)
    return type(value).__name__


@dataclass
class StepOps:
    """The op stream of one recorded span."""

    ops: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)  # (op, described arguments)
    host_reads: Counter = field(default_factory=Counter)  # Tensor method -> calls

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.ops]

    @property
    def aten_ops(self) -> int:
        """Ops that launch work (views and aliases left out)."""
        return sum(1 for name in self.names if name.split(".")[0] not in VIEW_ONLY)

    @property
    def syncs(self) -> Counter:
        """Sync-prone aten ops and host-read calls, by name."""
        found: Counter = Counter(name.split(".")[0] for name in self.names if name.split(".")[0] in SYNC_OPS)
        for method, calls in self.host_reads.items():
            found[f"Tensor.{method}"] += calls
        return found

    @property
    def host_data(self) -> int:
        return sum(1 for name in self.names if name.split(".")[0] in HOST_DATA_OPS)

    def signature(self) -> list[tuple[str, tuple[Any, ...]]]:
        """What a captured graph bakes in: every op with its shapes and non-tensor arguments."""
        return list(self.ops)

    def first_difference(self, other: StepOps) -> str | None:
        """Where two steps' op streams first differ (``None`` when they are the same)."""
        mine, theirs = self.signature(), other.signature()
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return f"op {i}: {a[0]}{a[1]} vs {b[0]}{b[1]}"
        if len(mine) != len(theirs):
            return f"{len(mine)} ops vs {len(theirs)}"
        return None


class OpRecorder(TorchDispatchMode):
    """Records every aten op issued while active into a :class:`StepOps`."""

    def __init__(self) -> None:
        super().__init__()
        self.step = StepOps()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        self.step.ops.append((name, tuple(_describe(value) for value in flat)))
        return func(*args, **kwargs)


@contextmanager
def record_ops() -> Iterator[StepOps]:
    """Record the aten ops and host reads of the enclosed code."""
    recorder = OpRecorder()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READ_METHODS}

    def counting(method: str):
        original = originals[method]

        def wrapper(self, *args, **kwargs):
            recorder.step.host_reads[method] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for method in HOST_READ_METHODS:
        setattr(torch.Tensor, method, counting(method))
    try:
        with recorder:
            yield recorder.step
    finally:
        for method, original in originals.items():
            setattr(torch.Tensor, method, original)
