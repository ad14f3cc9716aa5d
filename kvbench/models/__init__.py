"""Models: loading (:mod:`.loading`), shape and dtype (:mod:`.spec`), chat formats (:mod:`.chat`).

The names here import nothing, so that :mod:`kvbench.validate` checks ``model.*`` without torch."""

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
