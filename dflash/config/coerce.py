"""Typed building of the config dataclasses from plain YAML data.

:func:`build_dataclass` turns a nested mapping into a dataclass, checking each value against its
field's annotation with :func:`coerce_value`; every error is a :class:`ConfigError` naming the
dotted key. Ranges and cross-field rules are ``dflash/config/checks.py``'s.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from dflash.config.schema import ConfigError

__all__ = ["coerce_value", "build_dataclass"]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce_value(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float).

    Handles ``Optional`` / unions, ``Literal``, ``list[...]``, ``dict``, ``bool``, ``int``, ``float``
    (also from a YAML 1.1 string such as ``1e-4``) and ``str``.

    Raises:
        ConfigError: ``key: expected ..., got ...`` when ``value`` does not fit ``tp``.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce_value(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = args or (Any,)
        return [coerce_value(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in this module


def build_dataclass(cls: type, data: dict, prefix: str) -> Any:
    """Build dataclass ``cls`` from the mapping ``data``, nested dataclass fields from sub-mappings.

    Args:
        cls: a dataclass whose field annotations say each value's type.
        data: ``{field name: value}``; missing fields take their defaults.
        prefix: the dotted key of ``data`` in the whole config with a trailing dot (``"drafter."``;
            ``""`` at the top level), so every error names the full key.

    Raises:
        ConfigError: an unknown key (naming the known ones), a section that is not a mapping, or a
            value of the wrong type (:func:`coerce_value`).
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key in {where} (known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
            kwargs[name] = build_dataclass(tp, value, key + ".")
        else:
            kwargs[name] = coerce_value(key, value, tp)
    return cls(**kwargs)
