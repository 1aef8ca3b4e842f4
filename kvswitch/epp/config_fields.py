"""Strict reading of configuration documents: typed fields with errors that name their path.

`fields(value, path, required, optional)` checks a mapping's keys, `typed(value, path, kind)`
a value's type (bools are not numbers), `duration(value, path)` reads seconds from a number or
a Go-style duration ("50ms", "2s", "1m"). Each raises `ConfigError` whose message starts with
the field path at fault. Used by the EPP config (`kvswitch.epp.config_spec`) and the pool file
(`kvswitch.epp.datalayer.pool`); plugin parameters (`kvswitch.epp.framework.param`) raise the
same `ConfigError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["ConfigError", "duration", "fields", "typed"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration is invalid; the message starts with the field path at fault."""


def fields(value: object, path: str, required: Sequence[str] = (),
           optional: Sequence[str] = ()) -> Mapping[str, Any]:
    """`value` as a mapping with only the allowed keys; ConfigError naming the path otherwise."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
    allowed = set(required) | set(optional)
    for key in value:
        if key not in allowed:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown field (allowed: {', '.join(sorted(allowed))})")
    for key in required:
        if key not in value:
            raise ConfigError(f"{path + '.' if path else ''}{key}: required")
    return value


def typed(value: object, path: str, kind: type[T] | tuple[type, ...]) -> T:
    """`value` if it has type `kind` (bools are not numbers); ConfigError otherwise."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{path}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise ConfigError(f"{path}: expected {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    return value  # type: ignore[return-value]


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|us|s|m|h)")
_UNITS = {"ms": 0.001, "us": 1e-6, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(value: object, path: str) -> float:
    """Seconds from a number or a Go-style duration string: "50ms", "2s", "1m", "1.5s"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(f"{path}: expected a duration, got {value!r}")
    if seconds < 0:
        raise ConfigError(f"{path}: must not be negative")
    return seconds
