"""What every task's parameters (``task.<key>``) share, and :data:`TASK_PARAMS`, the map from
``task=<name>`` to the task's parameters.

Each task declares its parameters once, as a frozen dataclass in its own module, next to the code that
reads them (``tasks/niah.py``: ``NiahParams``, with type, default, help and range per key), and points
its class at it (``NeedleInAHaystack.Params = NiahParams``): adding a task option touches that one
file. The declarations give Hydra its ``task`` config group (:func:`kvbench.compose.register_task_configs`:
there are no ``conf/task/*.yaml`` to drift from the code), the task's defaults (:attr:`Task.defaults`),
the checks of ``kvbench run`` (unknown keys, wrong types, choices and ranges rejected before anything
loads, one line naming the key) and ``kvbench list tasks``. Task modules import no torch, no model and
no data at import time (``tests/test_task_params.py`` checks it), so ``kvbench run`` validates every
sweep point before anything heavy is imported.

Each dataclass holds exactly the keys of its task's config node, so a composed config — and every run
id — is what it was when the nodes were YAML files (``tests/test_task_params.py`` checks the nodes
against the recorded runs). Keys every task accepts without a default in its node (``task.shard``,
``task.name``) are not parameters: :data:`COMMON_KEYS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvbench.params import Params, param

QuestionPosition = Literal["end", "start"]
Compression = Literal["question_aware", "question_agnostic"]  # kvbench.requests.COMPRESSIONS

#: keys a task takes beyond its parameters: its name, and the shard a worker runs (``task.shard=i/n``)
COMMON_KEYS = ("name", "shard")


def limit_param(what: str) -> int | None:
    """The ``limit`` key: the first n samples (null: all)."""
    return param(None, f"first n {what} (null: all)", min=1)


def data_dir_param(what: str) -> str | None:
    """The ``data_dir`` key: where the task's files are (``what``: which files)."""
    return param(None, what)


# ---------------------------------------------------------------------- several questions per context
@dataclass(frozen=True)
class MultiQueryParams(Params):
    """The options of a task whose contexts can carry several questions (:mod:`kvbench.tasks.base`)."""

    queries_per_context: int = param(
        1, ">1: ask that many of a context's questions about one compressed context, in turn", min=1, legacy=1
    )
    compression: Compression = param(
        "question_aware",
        "question_aware | question_agnostic (compress before any question)",
        legacy="question_aware",
    )
    keep_answers: bool = param(False, "true: keep each answer in the cache (a conversation)", legacy=False)


def task_params() -> dict[str, type[Params]]:
    """``task=<name>`` -> its parameters, for every registered task (the task modules, imported here)."""
    from kvbench.tasks import REGISTRY

    return {name: REGISTRY.get(name).Params for name in REGISTRY.names()}


def __getattr__(name: str) -> object:
    """:data:`TASK_PARAMS` (:func:`task_params`), read when asked for: the task modules import this one."""
    if name == "TASK_PARAMS":
        return task_params()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    TASK_PARAMS: dict[str, type[Params]]
