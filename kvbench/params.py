"""Typed parameters: declare a component's settings once, parse and check a config against them.

Why. A KV method used to read its settings with ``cfg.get(key, default)`` wherever it needed them:
the default lived in two places (the code and the YAML), a misspelt key was ignored, ``method.m=abc``
failed deep inside a run, and ``method.m=5`` with no ``method.b`` silently ran the default PQ shape.
kvpress and sparse-attention-hub declare each method's parameters as dataclass fields; this module
does the same with a frozen dataclass per component, so one declaration gives

* the defaults (Hydra's config node is built from them, see :mod:`kvbench.compose`),
* the validation (:func:`parse`: unknown keys, wrong types and out-of-range values are one
  :class:`~kvbench.errors.ConfigError` line naming the key, the value, what was expected and an
  example),
* the record (:func:`describe`, a plain dict for ``metrics.json``) and the help
  (:func:`help_rows`, for ``kvbench list methods``).

Declaring::

    @dataclass(frozen=True)
    class PQParams(Params):
        m: int | None = param(None, "PQ sub-spaces; null: from budget.comm_ratio", min=1)
        metric: Literal["l2", "ip"] = param("l2", "k-means metric")
        kmeans_iters: int | Literal["adaptive"] = param(10, "iteration cap, or the cost model", min=0)

        def validate(self) -> None:  # cross-field rules
            ...

Supported annotations: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` choices,
``tuple[T, ...]`` (given as a list), and unions of those (``int | None``, ``int | Literal["adaptive"]``;
members are tried left to right). Conversions are deliberately few: an integral float (``5.0``) is
accepted for an ``int``, an ``int`` for a ``float``, a list for a tuple. Booleans are strict: ``1`` or
``"yes"`` is not ``true`` (Hydra already turns ``true``/``false`` on the command line into booleans).
Every field must have a default, so ``Cls()`` is the default configuration.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from kvbench.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Params:
    """Base of every parameter set (no fields: a component without parameters uses it as is)."""

    def validate(self) -> None:
        """Rules that involve several fields; raise :class:`ConfigError` (its message without the
        owner's name: :func:`parse` prefixes it)."""

    @classmethod
    def identity(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (a config node of this component) as they identify a run: without the keys at their
        legacy value (:func:`identity_values`). A component whose legacy values depend on another key (a
        key that only means something in a new mode) overrides it."""
        return identity_values(cls, values)


_NO_LEGACY = object()


def param(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    legacy: Any = _NO_LEGACY,
    example: Any = None,
) -> Any:
    """A field with its help text and an optional inclusive range (checked by :func:`parse`).

    ``example``: the valid value an error shows for this key (else the default, or one from the type).

    ``legacy``: for a key added after runs were recorded, the value that reproduces what those runs did
    without it. A run whose value is the legacy one is the same run as before the key existed, so the
    run id leaves the key out (:func:`identity_values`): adding a key never renames an old run, and a
    run that sets a new behaviour (another value) gets its own id."""
    metadata: dict[str, Any] = {"help": help}
    if min is not None:
        metadata["min"] = min
    if max is not None:
        metadata["max"] = max
    if legacy is not _NO_LEGACY:
        metadata["legacy"] = legacy
    if example is not None:
        metadata["example"] = example
    return dataclasses.field(default=default, metadata=metadata)


def legacy_values(cls: type[Params]) -> dict[str, Any]:
    """The keys of ``cls`` declared with a legacy value (see :func:`param`), and those values."""
    return {f.name: f.metadata["legacy"] for f in dataclasses.fields(cls) if "legacy" in f.metadata}


def identity_values(cls: type[Params], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a config node of ``cls``'s keys) without the keys that hold their legacy value (see
    :func:`param`): what identifies a run."""
    legacy = legacy_values(cls)
    return {
        key: value
        for key, value in values.items()
        if not (key in legacy and json.dumps(value, default=str) == json.dumps(legacy[key], default=str))
    }


class _Mismatch(Exception):
    """A value does not fit an annotation (internal: :func:`parse` turns it into a ConfigError)."""


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_tuple(tp: Any) -> bool:
    args = get_args(tp)
    return get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as annotation ``tp`` wants it, or :class:`_Mismatch`."""
    if _is_union(tp):
        for member in get_args(tp):
            try:
                return _coerce(value, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if get_origin(tp) is Literal:
        if any(type(value) is type(choice) and value == choice for choice in get_args(tp)):
            return value
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if _is_tuple(tp):
        if isinstance(value, Sequence) and not isinstance(value, str):  # a list, or OmegaConf's ListConfig
            return tuple(_coerce(item, get_args(tp)[0]) for item in value)
        raise _Mismatch
    raise TypeError(f"unsupported parameter annotation {tp!r}")


def type_label(tp: Any) -> str:
    """Compact type for tables: ``int | None``, ``l2 | ip``, ``int | adaptive``, ``list[int]``."""
    if _is_union(tp):
        return " | ".join(type_label(member) for member in get_args(tp))
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " | ".join(str(choice) for choice in get_args(tp))
    if _is_tuple(tp):
        return f"list[{type_label(get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _expected(tp: Any) -> str:
    """What a value should be, in words: ``an integer or null``, ``one of 'l2', 'ip'``."""
    if _is_union(tp):
        return " or ".join(_expected(member) for member in get_args(tp))
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        return repr(choices[0]) if len(choices) == 1 else "one of " + ", ".join(repr(c) for c in choices)
    if _is_tuple(tp):
        return f"a list of {_expected(get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _override_text(value: Any) -> str:
    """``value`` as one writes it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(item) for item in value) + "]"
    return str(value)


def _example(tp: Any, default: Any, metadata: Mapping[str, Any]) -> Any:
    """A valid value to show in an error: the declared example, the default when it says something, else
    a typical one."""
    if metadata.get("example") is not None:
        return metadata["example"]
    if default is not None and default != ():
        return default
    if _is_union(tp):
        members = [m for m in get_args(tp) if m is not type(None)]
        return _example(members[0], None, metadata) if members else None
    if get_origin(tp) is Literal:
        return get_args(tp)[0]
    if _is_tuple(tp):
        item = _example(get_args(tp)[0], None, metadata)
        return [item, item + 1] if isinstance(item, int) and not isinstance(item, bool) else [item]
    low = metadata.get("min")
    return {
        int: int(low if low is not None else 1),
        float: float(low if low is not None else 0.5),
        bool: True,
        str: "text",
    }.get(tp)


def parse(cls: type[Params], mapping: Mapping[str, Any] | None, owner: str, prefix: str = "") -> Params:
    """An instance of ``cls`` from ``mapping`` (missing keys keep their defaults).

    ``owner`` names the component in errors (``method pqcache``); ``prefix`` is how its keys are
    spelt on the command line (``method.``). Raises :class:`ConfigError` for an unknown key, a value of
    the wrong type, a value out of range, or a failed :meth:`Params.validate`.
    """
    values = dict(mapping or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [str(key) for key in values if key not in fields]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        keys = ", ".join(f"{prefix}{k}" for k in unknown)
        raise ConfigError(
            f"{owner} has no parameter{'s' if len(unknown) > 1 else ''} {keys}{hint}",
            f"use one of: {', '.join(fields)}" if fields else f"drop {keys}: {owner} takes no parameters",
        )
    hints = typing.get_type_hints(cls)
    parsed: dict[str, Any] = {}
    for key, value in values.items():
        spec, tp = fields[key], hints[key]
        try:
            converted = _coerce(value, tp)
        except _Mismatch:
            example = _override_text(_example(tp, spec.default, spec.metadata))
            raise ConfigError(
                f"{prefix}{key}={_override_text(value)} is not {_expected(tp)} ({owner})",
                f"give {_expected(tp)}, e.g. {prefix}{key}={example}",
            ) from None
        _check_range(key, converted, spec.metadata, owner, prefix)
        parsed[key] = converted
    instance = cls(**parsed)
    try:
        instance.validate()
    except ConfigError as error:
        raise ConfigError(f"{owner}: {error.message}", error.fix) from None
    return instance


def _check_range(key: str, value: Any, metadata: Mapping[str, Any], owner: str, prefix: str) -> None:
    """``min``/``max`` of a number, or of every item of a tuple."""
    if isinstance(value, tuple):
        for item in value:
            _check_range(key, item, metadata, owner, prefix)
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high = metadata.get("min"), metadata.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ConfigError(f"{prefix}{key}={value} is out of range ({owner})", f"use a value {bounds}")


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, tuple) else value


def describe(instance: Params) -> dict[str, Any]:
    """The parameters as a plain dict (tuples as lists), e.g. for a run's record; ``parse`` inverts it."""
    return {f.name: _plain(getattr(instance, f.name)) for f in dataclasses.fields(instance)}


def defaults(cls: type[Params]) -> dict[str, Any]:
    """The default configuration as a plain dict (what Hydra's config node holds)."""
    return describe(cls())


def help_rows(cls: type[Params]) -> list[tuple[str, str, str, str]]:
    """``(name, type, default, help)`` per field, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [
        (f.name, type_label(hints[f.name]), _override_text(_plain(f.default)), str(f.metadata.get("help", "")))
        for f in dataclasses.fields(cls)
    ]
