"""Plain data as typed, immutable values: strict decoding of parsed JSON into frozen
dataclasses (one error naming the field), the inverse encoding, and read-only containers.
Used by the plan file (`schema.plan`), its options (`schema.options`) and hardware specs (`schema.hardware`).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping

from tensorstow.errors import TensorstowError


def decode(tp, value, where: str, path: str = "", nonneg: bool = False):
    """`value` (parsed JSON) as type `tp`: a frozen dataclass, int, float, str, an enum, bool, `X | None`,
    `tuple[T, ...]`, `tuple[A, B]` or `Mapping[str, T]`. Raises TensorstowError naming the field.
    `nonneg`: numbers must be >= 0 (hardware specs)."""
    at = f"{where}: field '{path}'" if path else where
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return decode(tp, value, where, path, nonneg)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, value, where, path, nonneg)
    if tp is bool:
        if not isinstance(value, bool):
            raise TensorstowError(f"{at}: expected true or false, got {value!r}")
        return value
    if tp in (int, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or (tp is int and isinstance(value, float) and not value.is_integer()):
            raise TensorstowError(f"{at}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
        if nonneg and value < 0:
            raise TensorstowError(f"{at}: must be >= 0, got {value}")
        return tp(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise TensorstowError(f"{at}: expected one of {', '.join(str(v.value) for v in tp)}, "
                                  f"got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise TensorstowError(f"{at}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise TensorstowError(f"{at}: expected a list, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, where, f"{path}[{i}]", nonneg) for i, v in enumerate(value))
        if len(value) != len(args):
            raise TensorstowError(f"{at}: expected a list of {len(args)}, got {len(value)} items")
        return tuple(decode(a, v, where, f"{path}[{i}]", nonneg) for i, (a, v) in enumerate(zip(args, value)))
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise TensorstowError(f"{at}: expected a JSON object, got {type(value).__name__}")
        return types.MappingProxyType({k: decode(args[1], v, where, f"{path}.{k}" if path else k, nonneg)
                                       for k, v in value.items()})
    raise TypeError(f"decode: unsupported type {tp!r}")  # a bug in a schema class, not user input


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _decode_dataclass(cls, d, where, path, nonneg):
    at = f"{where}: field '{path}'" if path else where
    if not isinstance(d, dict):
        raise TensorstowError(f"{at}: expected a JSON object, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise TensorstowError(f"{at}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    hints = _hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise TensorstowError(f"{at}: missing required key '{name}'")
            continue
        kwargs[name] = decode(hints[name], d[name], where, f"{path}.{name}" if path else name, nonneg)
    return cls(**kwargs)


def encode(value):
    """The JSON form of a schema value: `to_json()` where a class has one, else by fields."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if dataclasses.is_dataclass(value):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    return value


def freeze(obj) -> None:
    """Make a frozen dataclass's containers read-only too: dicts become mapping proxies of a
    private copy, lists tuples (plans are shared by planner, simulator and executor)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, dict):
            object.__setattr__(obj, f.name, types.MappingProxyType(dict(v)))
        elif isinstance(v, list):
            object.__setattr__(obj, f.name, tuple(v))
