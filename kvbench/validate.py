"""Validate a resolved run config before anything is loaded.

A mistake in a config should cost a second, not a model load and a computed sample: ``kvbench run``
calls :func:`validate_points` on *every* point of a sweep before Hydra starts the first job, and
:func:`kvbench.runner.run` calls :func:`validate` again for callers of the Python API. Each check
raises :class:`~kvbench.errors.ConfigError` (one line, with the fix).

Three lists of checks, run in order:

* :data:`CONFIG_CHECKS` each read one group of the resolved dict (and the file system): value types of
  the shared groups (``budget.token_ratio=abc``, negative counts), the task's keys against its
  declaration and its own checks, a missing local ``model.path``, an output folder that cannot be
  written, a ``task.data_dir`` that is not a folder and data files with a malformed line (file and line
  named), a ``prefill_cache`` that is not a boolean. Then the config is parsed once into its typed groups
  (:class:`~kvbench.config.RunConfig`; a shipped method from its declaration, without torch).
* :data:`CROSS_CHECKS` are the rules between groups, each a ``callable(RunConfig) -> None``: a reuse
  method on a task whose prompts have no chunks, method parameters that name layers or dimensions the
  model lacks, prompt lengths the model cannot hold, CUDA graphs asked for on the CPU, a compressing
  method without a budget or with a budget the prompts cannot hold. They import neither torch nor a
  model, so a bad value is reported within about a second of pressing enter.
* :data:`METHOD_CHECKS` need torch or the method instance (``callable(RunConfig, method) -> None``): a
  ``model.device`` this machine lacks, the method's own budget split (``budget.local`` against its
  default window share).

Plug-in point: append a check to the list whose input it needs; each raises ``ConfigError`` (one line,
with the fix) and runs for every sweep point.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbench.config import RunConfig, TaskConfig
from kvbench.errors import BudgetError, ConfigError, KvbenchError
from kvbench.models import check_device, check_dtype

if TYPE_CHECKING:
    from kvbench.engine.protocol import KVMethod

Check = Callable[[dict[str, Any]], None]
CrossCheck = Callable[[RunConfig], None]
MethodCheck = Callable[[RunConfig, "KVMethod"], None]


def exact_length_extra(task: TaskConfig) -> int | None:
    """For a task whose prompts are exactly ``task.lengths`` tokens (its parameters say so:
    ``exact_lengths``), the tokens a sample needs beyond its length: its generation, ``max_new_tokens``
    where the task has the key (NIAH), else none (PG19's teacher-forced pass over L tokens). ``None`` for
    any other task: a length the model cannot hold is then found when the prompt is built."""
    if not task.exact_lengths:
        return None
    return int(task.get("max_new_tokens") or 0)


# ---------------------------------------------------------------------- config-only checks
def check_groups(resolved: dict[str, Any]) -> None:
    for group in ("model", "method", "task"):
        if not isinstance(resolved.get(group), dict) or not resolved[group].get("name"):
            raise ConfigError(f"the config has no {group} group", f"pass {group}=<name> (see `kvbench list`)")
    if not isinstance(resolved.get("progress", True), bool):
        raise ConfigError(
            f"progress={resolved['progress']!r} is not true or false", "use progress=true or progress=false"
        )


def check_known_keys(resolved: dict[str, Any]) -> None:
    """Every top-level key and every ``model.*`` key is one kvbench reads: an added key (``+foo=bar``,
    ``+model.revison=main``) would change the run id and nothing else. (``method.*``, ``task.*``,
    ``budget.*``, ``profile.*``, ``store.*`` and ``engine.*`` keys are checked against their own
    declarations.)"""
    import difflib

    top = known_top_keys()
    for key in resolved:
        if key not in top:
            close = difflib.get_close_matches(key, sorted(top), n=1)
            raise ConfigError(
                f"unknown setting {key}"
                + (f" (did you mean {close[0]}?)" if close else "")
                + ": kvbench reads no such key",
                f"drop +{key}=...; the settings are {', '.join(sorted(top))} (`kvbench run --help`)",
            )
    model = resolved.get("model") or {}
    known = known_model_keys()
    for key in model:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            raise ConfigError(
                f"model {model.get('name')} has no setting model.{key}"
                + (f" (did you mean model.{close[0]}?)" if close else ""),
                f"drop +model.{key}=...; model keys are {', '.join(sorted(known))}",
            )


def _conf_keys(path: Path) -> set[str]:
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {str(key) for key in data} if isinstance(data, dict) else set()


@functools.cache
def known_top_keys() -> frozenset[str]:
    """Top-level keys of a run config: ``conf/config.yaml``'s and the three groups (read once a process:
    the shipped config tree does not change while kvbench runs)."""
    from kvbench.compose import NOT_RUN_KEYS

    return frozenset((_conf_keys(_conf() / "config.yaml") - {"defaults", *NOT_RUN_KEYS}) | {"model", "method", "task"})


@functools.cache
def known_model_keys() -> frozenset[str]:
    """Every key a ``conf/model/*.yaml`` declares (what :func:`kvbench.models.loading.load_model` reads;
    read once a process)."""
    return frozenset(set().union(*(_conf_keys(path) for path in sorted((_conf() / "model").glob("*.yaml")))))


def _conf() -> Path:
    import kvbench.conf

    return Path(kvbench.conf.__file__).parent


def check_prefill_cache(resolved: dict[str, Any]) -> None:
    """``prefill_cache``: true, false or null (on in sweeps, off in a single run;
    :mod:`kvbench.engine.prefill_cache`)."""
    value = resolved.get("prefill_cache")
    if value is not None and not isinstance(value, bool):
        raise ConfigError(
            f"prefill_cache={value!r} is not true, false or null",
            "use prefill_cache=false to give every method its own prefill (null: shared in sweeps)",
        )


def _typed(key: str, value: Any, types: tuple[type, ...], nullable: bool, low: float | None, example: str) -> None:
    if value is None:
        if not nullable:
            raise ConfigError(f"{key} must be set", f"e.g. {example}")
        return
    if bool not in types and isinstance(value, bool) or not isinstance(value, types):
        kind = "true or false" if bool in types else "a whole number" if types == (int,) else "a number"
        raise ConfigError(f"{key}={value!r} is not {kind}", f"e.g. {example}")
    if low is not None and isinstance(value, (int, float)) and value < low:  # (low: numeric keys only)
        raise ConfigError(f"{key}={value!r} is below {low:g}", f"e.g. {example}")


def check_budget(resolved: dict[str, Any]) -> None:
    from kvbench.budget import BudgetConfig

    budget = resolved.get("budget") or {}
    if not isinstance(budget, dict):
        raise BudgetError(
            f"budget={budget!r} is not a group of keys", "set budget.token_ratio=... or budget.tokens=..."
        )
    config = BudgetConfig.from_mapping(budget)  # unknown keys, types and ranges (the declaration)
    if config.tokens is not None and config.token_ratio is not None:
        raise BudgetError(
            f"budget.tokens={config.tokens} and budget.token_ratio={config.token_ratio} both set the budget "
            "(budget.tokens wins, and the ratio would only rename the run)",
            f"drop one: budget.tokens={config.tokens} or budget.token_ratio={config.token_ratio}",
        )
    if config.tokens is not None and config.local is not None and config.local > config.tokens:
        raise BudgetError(
            f"budget.local={config.local} is larger than budget.tokens={config.tokens} "
            "(the window is part of the budget)",
            f"use budget.local <= {config.tokens}, or raise budget.tokens",
        )


def check_engine(resolved: dict[str, Any]) -> None:
    """``engine.*`` (:class:`~kvbench.engine.settings.EngineSettings`): known keys, types and ranges."""
    from kvbench.engine.settings import engine_settings

    engine_settings(resolved.get("engine"))


def check_engine_device(config: RunConfig) -> None:
    """CUDA graphs asked for on a model placed on the CPU."""
    if config.engine.cuda_graph is True and config.model.device == "cpu":
        raise ConfigError(
            "engine.cuda_graph=true needs a CUDA device, but model.device=cpu",
            "use engine.cuda_graph=auto (graphs on CUDA only) or model.device=cuda",
        )


def check_profile(resolved: dict[str, Any]) -> None:
    """``profile.*`` (:class:`~kvbench.profile.Profile`): known keys, types and choices."""
    from kvbench.profile import profile_settings

    profile_settings(resolved.get("profile"))


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_task_types(resolved: dict[str, Any]) -> None:
    """Each ``task.*`` value against the type of the task's default for it (a default of ``[1024]``
    wants a list of whole numbers); a negative number where the default is not negative."""
    from kvbench.tasks import REGISTRY

    cfg = resolved["task"]
    cls = REGISTRY.get(cfg["name"])
    for key, default in cls.defaults.items():
        if key in cfg and cfg[key] is not None and default is not None:
            _like(f"task.{key}", cfg[key], default)
    limit = cfg.get("limit")
    if limit is not None:
        _typed("task.limit", limit, (int,), True, 1, "task.limit=10")
    for key, low in TASK_MINIMUMS.items():
        value = cfg.get(key)
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, (int, float)) and not isinstance(item, bool) and item < low:
                default = cls.defaults.get(key)
                raise ConfigError(
                    f"task.{key}={_show_value(value)} {'holds' if isinstance(value, list) else 'is'} {item:g}, "
                    f"below {low:g}: {TASK_MINIMUM_WHY.get(key, 'nothing to run')}",
                    f"e.g. task.{key}={_example(default) if default not in (None, []) else low}",
                )


#: ``task.*`` counts that must be at least this (any task that has the key): below it a run computes
#: nothing (or only the prompt) and still reports a score
TASK_MINIMUMS: dict[str, float] = {
    "max_new_tokens": 1,
    "lengths": 1,
    "needles": 1,
    "num_samples": 1,
    "repeats": 1,
    "eval_every": 1,
    "max_length": 1,
    "chunk_tokens": 1,
    "top_k": 1,
    "map_tokens": 1,
    "queries_per_context": 1,
}
TASK_MINIMUM_WHY = {
    "max_new_tokens": "no answer would be generated, and every sample would score against an empty prediction",
    "lengths": "a prompt needs tokens",
}


def _show_value(value: Any) -> str:
    return _example(value) if isinstance(value, list) and len(value) <= 3 else _show(value)


def _like(key: str, value: Any, default: Any, example: str | None = None) -> None:
    example = example or f"e.g. {key}={_example(default)}"
    if isinstance(default, list):
        if isinstance(value, str) and default and all(isinstance(d, str) for d in default):
            return  # one name where a list of names is expected
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} is not a list", example)
        if default:
            for item in value:
                _like(key, item, default[0], example)
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        return
    if not ok:
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}[type(default)]
        raise ConfigError(f"{key} has {value!r}, which is not {kind}", example)
    if isinstance(default, (int, float)) and not isinstance(default, bool) and default >= 0 and value < 0:
        raise ConfigError(f"{key}={value!r} is negative", example)


def _example(default: Any) -> str:
    if isinstance(default, list):
        return "[" + ",".join(_show(d) for d in default[:3]) + "]"
    return _show(default)


def check_task(resolved: dict[str, Any]) -> None:
    """The task's own checks (its constructor), with wrong types turned into one line."""
    from kvbench.tasks import create_task

    try:
        create_task(resolved["task"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"task {resolved['task']['name']}: a value has the wrong type ({exc})",
            f"compare your task.* overrides with `kvbench list tasks` ({resolved['task']['name']})",
        ) from None


def model_max_length(model: Mapping[str, Any]) -> int | None:
    """The model's context limit when known before its weights load (``model.max_length``, else the
    ``max_position_embeddings`` of :func:`model_shape`); None when only the weights know."""
    if model.get("max_length"):
        return int(model["max_length"])
    value = (model_shape(model) or {}).get("max_position_embeddings")
    return int(value) if value else None


def model_shape(model: Mapping[str, Any]) -> dict[str, int] | None:
    """The model's architecture numbers (``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``) when they are known without
    loading weights: a random model's ``model.config``, a local folder's ``config.json``, or the
    ``config.json`` of an asset already converted (``kvbench fetch``). None otherwise (a hub id, an
    asset not converted yet): the checks that need it are then left to the loader."""
    import json

    source = model.get("source")
    config: Any = None
    try:
        if source == "random":
            config = dict(model.get("config") or {})
        elif source == "pretrained" and model.get("path") and Path(str(model["path"])).expanduser().is_dir():
            config = json.loads((Path(str(model["path"])).expanduser() / "config.json").read_text(encoding="utf-8"))
        elif source == "asset" and model.get("asset"):
            from kvbench.assets import kvbench_home

            found = kvbench_home() / "models" / str(model["asset"]) / "config.json"
            config = json.loads(found.read_text(encoding="utf-8")) if found.exists() else None
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    config = {**config, **(config.get("text_config") or {})}  # (multimodal configs nest the decoder's)
    shape: dict[str, int] = {}
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size"):
        if isinstance(config.get(key), int):
            shape[key] = config[key]
    if isinstance(config.get("max_position_embeddings"), int):
        shape["max_position_embeddings"] = config["max_position_embeddings"]
    if "num_key_value_heads" not in shape and "num_attention_heads" in shape:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    if "head_dim" not in shape and shape.get("num_attention_heads") and "hidden_size" in shape:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    return shape or None


def check_method_in_model(config: RunConfig) -> None:
    """``method.*`` values that name parts of the model (layers, head dimensions) exist in it, once its
    config is known (:func:`model_shape`), before weights load: ``method.dense_layers=[99]`` on a 4-layer
    model, dense layers that leave no layer to compress, a CacheBlend check layer past the last layer,
    a PQ sub-space count that does not divide the head dimension, SparQ components beyond it."""
    shape = model_shape(config.model.node) or {}
    layers, head_dim = shape.get("num_hidden_layers"), shape.get("head_dim")
    params = config.method.params
    name, model = config.method.name, config.model.name
    dense = tuple(getattr(params, "dense_layers", ()) or ())
    if len(set(dense)) < len(dense):
        raise ConfigError(f"method.dense_layers={list(dense)} names a layer twice", "list each layer once")
    if layers is not None:
        outside = [layer for layer in dense if layer >= layers]
        if outside:
            raise ConfigError(
                f"method.dense_layers={list(dense)}: model {model} has {layers} layers (0-{layers - 1}), "
                f"so there is no layer {outside[0]}",
                f"use layers from 0 to {layers - 1}, e.g. method.dense_layers=[0,1]",
            )
        if dense and len(set(dense)) >= layers:
            raise ConfigError(
                f"method.dense_layers={list(dense)} makes every layer of model {model} dense: method {name} "
                "would compress nothing",
                f"leave some of layers 0-{layers - 1} out, or use method=full",
            )
        _check_layer_params(params, layers, model)
    _check_head_dim(params, head_dim, model)


def _check_layer_params(params: Any, layers: int, model: str) -> None:
    """Single-layer parameters (a reuse method's ``stop_layer``, CacheBlend's check layers) inside the model."""
    stop = getattr(params, "stop_layer", None)
    if isinstance(stop, int) and stop >= layers:
        raise ConfigError(
            f"method.stop_layer={stop}: model {model} has {layers} layers (0-{layers - 1})",
            f"use method.stop_layer <= {layers - 1}, or null",
        )
    check = getattr(params, "check_layer", None)
    if check is None:
        return
    ratios = len(getattr(params, "filter_ratios", ()) or ()) or 1
    if check + ratios > layers:
        what = f"method.check_layer={check}" + (f" with {ratios} method.filter_ratios" if ratios > 1 else "")
        raise ConfigError(
            f"{what} needs layers up to {check + ratios - 1}, but model {model} has {layers} (0-{layers - 1})",
            f"use method.check_layer <= {layers - ratios}",
        )


def _check_head_dim(params: Any, head_dim: int | None, model: str) -> None:
    if head_dim is None:
        return
    m = getattr(params, "m", None)
    if isinstance(m, int) and head_dim % m:
        options = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ConfigError(
            f"method.m={m} does not divide model {model}'s head dimension {head_dim} (PQ splits each key into m parts)",
            f"use one of method.m={', '.join(map(str, options))}",
        )
    r = getattr(params, "r", None)
    if isinstance(r, int) and r > head_dim:
        raise ConfigError(
            f"method.r={r} is more query components than model {model}'s head dimension {head_dim}",
            f"use method.r <= {head_dim}",
        )


def check_model(resolved: dict[str, Any]) -> None:
    model = resolved["model"]
    _typed("model.max_length", model.get("max_length"), (int,), True, 1, "model.max_length=32768")
    check_dtype(model.get("dtype"))
    check_device(model.get("device"))
    source = model.get("source")
    if source not in ("asset", "pretrained", "random"):
        raise ConfigError(f"unknown model.source {source!r}", "use asset, pretrained or random")
    if source == "asset":
        from kvbench.assets import get_asset

        get_asset(str(model.get("asset")))
    if source == "pretrained":
        path = model.get("path")
        if not path or path == "???":
            raise ConfigError(f"model={model['name']} needs a path", "pass model.path=<local dir or hub id>")
        local = Path(str(path)).expanduser()
        if local.is_dir():
            if not (local / "config.json").exists():
                raise ConfigError(
                    f"model.path={path} holds no config.json", "point model.path at a Hugging Face model folder"
                )
        elif looks_like_path(str(path)):
            raise ConfigError(
                f"model.path={path} is not a folder",
                "point model.path at a local model folder, or give a hub id such as org/name",
            )


def looks_like_path(text: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything absolute, relative (``./``, ``../``, ``~``) or
    with more than one ``/`` is a local path."""
    return text.startswith(("/", ".", "~")) or text.count("/") > 1 or "\\" in text


def check_lengths(config: RunConfig) -> None:
    """A generation that leaves no room for a prompt; exact prompt lengths (plus their generation) beyond
    the model's context."""
    task, model = config.task, config.model
    extra = exact_length_extra(task)
    limit = model_max_length(model.node)
    generate = task.get("max_new_tokens")
    if limit is not None and isinstance(generate, int) and generate >= limit:
        raise ConfigError(
            f"task.max_new_tokens={generate} leaves no room for a prompt in model {model.name}'s {limit} tokens",
            f"use task.max_new_tokens well below {limit}, e.g. task.max_new_tokens=64",
        )
    if extra is None or limit is None or not task.get("lengths"):
        return
    longest = max(int(x) for x in task.get("lengths"))
    need = longest + extra
    if need > limit:
        raise ConfigError(
            f"task.lengths contains {longest}: prompt plus generation ({need} tokens) exceeds model "
            f"{model.name}'s maximum of {limit} tokens",
            f"use task.lengths up to {limit - extra}, or a longer-context model",
        )


def check_output_dir(resolved: dict[str, Any]) -> None:
    """Results can be written under ``output_dir``. An existing output folder is checked without writing
    into it (its permission bits and whether its file system is mounted read-only: planning and
    ``--no-run`` never write where results are); a folder still to be made is probed with a temporary
    file in its nearest existing parent (permission bits are not enough there: root may "write" to
    /proc)."""
    path = Path(str(resolved.get("output_dir") or "results/runs")).expanduser()
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    fix = "set output_dir=<a writable folder>"
    if not probe.is_dir():
        raise ConfigError(f"cannot write results under {path}: {probe} is not a folder", fix)
    if probe == path:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
        if read_only or not os.access(path, os.W_OK | os.X_OK):
            why = "read-only file system" if read_only else "permission denied"
            raise ConfigError(f"cannot write results under {path}: it is not writable ({why})", fix)
        return
    try:
        handle, name = tempfile.mkstemp(prefix=".kvbench-probe-", dir=probe)
        os.close(handle)
        os.unlink(name)
    except OSError as exc:
        raise ConfigError(f"cannot write results under {path}: {probe} is not writable ({exc.strerror})", fix) from None


def check_data(resolved: dict[str, Any]) -> None:
    """The task can find its data before any model loads: ``task.data_dir`` is a folder, the files the
    task will read exist and have the shape the task reads (:meth:`Task.check_data`: a JSONL file's rows
    parse and carry the fields the task reads, up to ``task.limit`` rows, a JSON file holds the list it
    should, a text file is text), so a bad file is reported now, with its file and line number, in
    ``--dry-run`` too. Whether the hub answers is not a property of the config:
    :func:`kvbench.runner.run` checks it before the model loads (a dry run plans offline)."""
    from kvbench.tasks import create_task
    from kvbench.tasks.sources import data_dir

    task_cfg = resolved["task"]
    data_dir(task_cfg)
    task = create_task(task_cfg)
    for path in task.data_files():
        stat = path.stat()
        key = (task.name, str(path.resolve()), stat.st_size, stat.st_mtime_ns, repr(task.params))
        if key not in _CHECKED_FILES:  # sweep points share their data files
            task.check_data(path)
            _CHECKED_FILES.add(key)


_CHECKED_FILES: set[tuple[str, str, int, int, str]] = set()


def check_store(resolved: dict[str, Any]) -> None:
    """``store.*`` (the chunk store of reuse methods): known keys, a tier that exists, sizes >= 0."""
    from kvbench.kv.chunks import StoreConfig

    if resolved.get("store") is not None:
        StoreConfig.from_mapping(resolved["store"])


def check_reuse_task(config: RunConfig) -> None:
    """A reuse method (its parameters derive from ``ReuseParams`` in :mod:`kvbench.methods.params`, the
    family's shared base) builds its prefill from chunk caches, so the task's samples must carry
    chunk segments (:attr:`Task.chunked`). Without this check the mistake surfaces only after the model
    has loaded, when the first sample is prepared."""
    from kvbench.tasks import REGISTRY

    if not config.method.uses_chunk_store or config.task.chunked:
        return
    chunked = [name for name in REGISTRY.names() if REGISTRY.get(name).chunked]
    raise ConfigError(
        f"method {config.method.name} reuses chunk caches, but task {config.task.name}'s prompts are not split "
        "into chunks",
        f"use a chunked task (task={' or task='.join(chunked)}) or a method that is not in the reuse family",
    )


CONFIG_CHECKS: list[Check] = [
    check_store,
    check_groups,
    check_known_keys,
    check_prefill_cache,
    check_engine,
    check_budget,
    check_profile,
    check_task_types,
    check_task,
    check_model,
    check_output_dir,
    check_data,
]


def check_method_budget(config: RunConfig) -> None:
    """A compressing method needs a budget; its sinks must leave tokens to compress; a ``budget.tokens``
    must fit the smallest exact prompt, and with the sinks must not cover it."""
    from kvbench.budget import MethodBudgetDefaults

    method, budget = config.method, config.budget
    if not method.needs_budget:
        return
    if not budget.is_set:
        raise BudgetError(
            f"method {method.name} compresses the KV cache and needs a budget",
            "set budget.token_ratio=0.1 (fraction of the context) or budget.tokens=1024",
        )
    sink = budget.sink if budget.sink is not None else getattr(method.params, "sink", MethodBudgetDefaults().sink)
    limit = model_max_length(config.model.node)
    if limit is not None and sink >= limit:
        raise BudgetError(
            f"{_sink_key(config)}={sink} is not smaller than model {config.model.name}'s "
            f"{limit}-token context: every token would be a sink, and nothing compressed",
            "use a few sink tokens, e.g. budget.sink=32",
        )
    window = _exact_window(config)
    if window is None:
        return
    shortest, capacity = window
    if budget.tokens is not None and budget.tokens > capacity:
        raise BudgetError(
            f"budget.tokens={budget.tokens} is larger than the context of task.lengths={shortest} "
            f"({shortest} prompt tokens + {capacity - shortest} generated)",
            f"use budget.tokens <= {capacity}, or a relative budget such as budget.token_ratio=0.1",
        )
    if sink >= shortest:
        raise BudgetError(
            f"{_sink_key(config)}={sink} is not smaller than the shortest prompt (task.lengths has "
            f"{shortest}): every prompt token would be a sink, and nothing compressed",
            f"use budget.sink below {shortest}, e.g. budget.sink=32",
        )
    if budget.tokens is not None and budget.tokens < shortest <= sink + budget.tokens:
        raise BudgetError(
            f"budget.tokens={budget.tokens} plus {sink} sink tokens ({_sink_key(config)}) covers the "
            f"whole {shortest}-token prompt of task.lengths: every token is attended, nothing compressed",
            f"lower {_sink_key(config).split(' ')[0]} or budget.tokens so their sum is below {shortest}",
        )


def _exact_window(config: RunConfig) -> tuple[int, int] | None:
    """``(shortest prompt, its capacity with the generation)`` for a task with exact prompt lengths."""
    extra = exact_length_extra(config.task)
    if extra is None or not config.task.get("lengths"):
        return None
    shortest = min(int(x) for x in config.task.get("lengths"))
    return shortest, shortest + extra


def _sink_key(config: RunConfig) -> str:
    if config.budget.sink is not None:
        return "budget.sink"
    return f"method.sink (method {config.method.name}'s default)"


CROSS_CHECKS: list[CrossCheck] = [
    check_engine_device,
    check_reuse_task,
    check_method_in_model,
    check_lengths,
    check_method_budget,
]


# ---------------------------------------------------------------------- checks that need torch or the method
def check_budget_split(config: RunConfig, method: KVMethod) -> None:
    """The method's own split of the budget (its default window share, PyramidKV's layers) applied to the
    shortest exact prompt: a ``budget.local`` beyond the budget."""
    from kvbench.budget import resolve_budget

    window = _exact_window(config)
    if method.needs_budget and config.budget.is_set and window is not None:
        resolve_budget(config.budget, window[0], method.defaults(), method.name, window[1])


def check_device_present(config: RunConfig, method: KVMethod) -> None:
    """A ``model.device`` of ``cuda``/``cuda:N`` exists on this machine (asking needs torch, so it is a
    method check): without it a run would fail only when the model loads."""
    device = config.model.device
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        where = (
            f"this machine has {count} CUDA device{'s' if count != 1 else ''}"
            if count
            else "this machine has no CUDA device"
        )
        raise ConfigError(
            f"model.device={device}, but {where}",
            "use model.device=auto (CUDA when present, else the CPU)"
            + (f" or cuda:0..{count - 1}" if count else " or model.device=cpu"),
        )


METHOD_CHECKS: list[MethodCheck] = [check_device_present, check_budget_split]


# ---------------------------------------------------------------------- entry points
def check_config(resolved: dict[str, Any]) -> RunConfig:
    """:data:`CONFIG_CHECKS` on ``resolved``, its typed groups, then :data:`CROSS_CHECKS` on them (no torch
    for a shipped method)."""
    for check in CONFIG_CHECKS:
        check(resolved)
    config = RunConfig.parse(resolved)
    for cross in CROSS_CHECKS:
        cross(config)
    return config


def check_method(resolved: dict[str, Any], method: KVMethod | None = None) -> RunConfig:
    """:data:`METHOD_CHECKS` with the method built (``method``: already built from ``resolved``); returns
    the typed groups read from the instance."""
    from kvbench.methods import create_method

    method = method if method is not None else create_method(resolved["method"])
    config = RunConfig.parse(resolved, method=method)
    for check in METHOD_CHECKS:
        check(config, method)
    return config


def validate(resolved: dict[str, Any], *, methods: bool = True) -> RunConfig:
    """Every check on one config (``methods=False``: not :data:`METHOD_CHECKS`); returns its typed groups."""
    config = check_config(resolved)
    return check_method(resolved) if methods else config


def validate_points(points: Sequence[dict[str, Any]], labels: Sequence[str] | None = None) -> None:
    """Validate every sweep point: the checks without torch on all points first (fast), then the method
    checks. An error names the point (``labels[i]``) when there are several."""
    for checks in (check_config, check_method):
        for index, resolved in enumerate(points):
            with _naming_the_point(index, points, labels):
                checks(resolved)


@contextlib.contextmanager
def _naming_the_point(index: int, points: Sequence[Any], labels: Sequence[str] | None) -> Iterator[None]:
    try:
        yield
    except KvbenchError as error:
        if len(points) > 1:
            where = f" (sweep point {index + 1}/{len(points)}: {labels[index]})" if labels else ""
            raise type(error)(f"{error.message}{where}", error.fix) from None
        raise
