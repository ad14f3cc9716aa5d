"""Models: loading (:mod:`.loading`), shape and dtype (:mod:`.spec`), chat formats (:mod:`.chat`).

The names here import no torch, so that :mod:`kvbench.validate` checks ``model.*`` without torch."""

#: ``model.dtype`` values besides ``auto``, each with the torch dtype it names
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
#: ``model.device`` values: auto (CUDA when present, else CPU), cpu, cuda, cuda:N, mps
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:\d+)?"


def check_dtype(dtype: object) -> None:
    """Refuse a ``model.dtype`` that names no dtype (None and ``auto`` pass)."""
    from kvbench.errors import ConfigError

    if dtype not in (None, "auto", *DTYPE_NAMES):
        raise ConfigError(f"unknown model.dtype {dtype!r}", "use auto, float32, bfloat16 or float16")


def check_device(device: object) -> None:
    """Refuse a ``model.device`` that names no device (None passes; CUDA's presence is the loader's check)."""
    import re

    from kvbench.errors import ConfigError

    if device is not None and not re.fullmatch(DEVICE_PATTERN, str(device)):
        raise ConfigError(f"unknown model.device {device!r}", "use auto, cpu, cuda or cuda:N")
