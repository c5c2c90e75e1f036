"""Typed run configuration: everything a run needs is a value here (no environment-variable knobs).

:func:`load_config` reads a YAML file, applies ``section.key=value`` command-line overrides and
validates every value *before* any model loads; every error is a :class:`ConfigError` naming the
offending dotted key. The package's modules, in the order a config passes through them:

- ``dflash/config/schema.py``: one dataclass per YAML section (:class:`RunConfig` and its
  sections), :class:`ConfigError`, values derived from a section (:func:`default_gamma`).
- this module: reading the YAML file and the overrides into one nested mapping.
- ``dflash/config/coerce.py``: that mapping into the dataclasses, each value type-checked.
- ``dflash/config/checks.py``: ranges and cross-field rules (:func:`validate_config`) and the run's
  device (:func:`resolve_device`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import yaml

from dflash.config.checks import resolve_device, validate_config
from dflash.config.coerce import build_dataclass
from dflash.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    DataConfig,
    DrafterConfig,
    LogConfig,
    RegenerateConfig,
    RunConfig,
    SampledRegenerateConfig,
    TargetConfig,
    TrainConfig,
    TransportConfig,
    default_gamma,
)

__all__ = [
    "ConfigError",
    "TargetConfig",
    "DrafterConfig",
    "DataConfig",
    "TrainConfig",
    "ClusterConfig",
    "TransportConfig",
    "LogConfig",
    "CheckpointConfig",
    "RegenerateConfig",
    "SampledRegenerateConfig",
    "RunConfig",
    "load_config",
    "parse_overrides",
    "config_from_dict",
    "validate_config",
    "resolve_device",
    "default_gamma",
]


def load_config(path: Optional[str | os.PathLike], overrides: Optional[list[str]] = None,
                gpu_count: Optional[int] = None) -> RunConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, validate.

    Raises:
        ConfigError: missing file, bad YAML, unknown key, wrong type, out-of-range value.
    """
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: no such file: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {p} must hold a mapping of sections")
    data = _merge(data, parse_overrides(list(overrides or [])))
    return validate_config(config_from_dict(data), gpu_count=gpu_count)


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["drafter.block_size=8", "train.lr=1e-4"]`` into a nested dict.

    Values are parsed as YAML (``8`` → int, ``[0, 1]`` → list, ``null`` → None).

    Raises:
        ConfigError: an override without ``=`` or with an empty key.
    """
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: an override must look like section.key=value")
        key, raw = item.split("=", 1)
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"{item}: an override must look like section.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML: {problem}") from None
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, extra: dict) -> dict:
    """``base`` updated by ``extra``, section by section (nested mappings merge, other values replace)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: dict) -> RunConfig:
    """Build a :class:`RunConfig` from a nested dict (types checked, ranges not yet)."""
    if not isinstance(data, dict):
        raise ConfigError(f"top level: expected a mapping, got {type(data).__name__}")
    return build_dataclass(RunConfig, data, "")
