"""Flower's flat kebab-case keys <-> a frozen dataclass: the one parser.

A field ``local_steps`` is the key ``local-steps``; a field may name another key in its
metadata (``field(default=600.0, metadata={"key": "round-timeout"})``). A value must
have its default's type: an integer is taken for a float, a bool only for a bool
field.

Two kinds of field hold more than one value, and keep the keys flat:

- a dataclass field (a sub-config) is flattened: its own fields' keys sit beside the
  outer ones, unchanged (``ServerConfig.fleet.speeds`` is the key ``fleet-speeds``);
  a key is defined once across all the levels;
- a ``tuple[X, ...]`` field (X: ``int``, ``float`` or ``str``) is read once from a
  comma-separated string or a list into a typed tuple, and written back as the comma
  string Flower's records hold. ``metadata={"item": parse}`` parses each entry with
  ``parse`` instead (a size into bytes, a probability checked against its range): it
  takes the entry (a string, or a list's element) and raises ``ValueError`` saying
  what the entries must be.

Example::

    cfg = from_flat(ServerConfig, {"num-server-rounds": 3}, what="run-config")
    assert to_flat(cfg)["num-server-rounds"] == 3
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def flat_key(f: dataclasses.Field) -> str:
    """The kebab-case key of dataclass field ``f``."""
    return str(f.metadata.get("key", f.name.replace("_", "-")))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: a flat config needs one")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_sub(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _items(hint: Any) -> type | None:
    """X of a ``tuple[X, ...]`` hint (None: not a tuple field)."""
    if typing.get_origin(hint) is not tuple:
        return None
    args = typing.get_args(hint)
    assert len(args) == 2 and args[1] is Ellipsis, f"{hint}: only tuple[X, ...]"
    assert args[0] in _PARSE, f"{hint}: entries of int, float or str"
    return typing.cast(type, args[0])


def _walk(cls: type) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(key, field, type hint) of every leaf field, sub-configs flattened."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if _is_sub(hints[f.name]):
            yield from _walk(hints[f.name])
        else:
            yield flat_key(f), f, hints[f.name]


def flat_keys(cls: type) -> tuple[str, ...]:
    """Every key of ``cls``, sub-configs flattened, in field order."""
    keys = tuple(key for key, _, _ in _walk(cls))
    assert len(set(keys)) == len(keys), f"{cls.__name__}: a key is defined twice"
    return keys


def from_flat(
    cls: type[T], values: Mapping[str, Any], *, what: str, strict: bool = False
) -> T:
    """Build ``cls`` from flat keys; a missing key takes its field's default.

    Args:
        cls: a dataclass whose every field has a default.
        values: the flat keys (a run config, a ConfigRecord).
        what: how an error names the source (``"run-config"``).
        strict: an unknown key is an error (else it is ignored: a stock strategy's
            config carries keys of its own).

    Raises:
        ValueError: naming the key, its value and the type it must have (a tuple
            field: what its entries must be), or the unknown keys and the known ones.
    """
    assert dataclasses.is_dataclass(cls)
    known = flat_keys(cls)
    if strict:
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(
                f"unknown {what} key(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
    return typing.cast(T, _build(cls, values, what, None))


def _build(cls: type, values: Mapping[str, Any], what: str, base: Any) -> Any:
    """``cls`` from ``values``; the keys not given keep ``base``'s (or the
    defaults, without a base)."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        if _is_sub(hint):
            kwargs[f.name] = _build(hint, values, what, _default(f))
            continue
        key = flat_key(f)
        if key in values:
            kwargs[f.name] = _value(f, hint, key, values[key], what)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    return cls(**kwargs)


def _value(f: dataclasses.Field, hint: Any, key: str, value: Any, what: str) -> Any:
    item = _items(hint)
    if item is not None:
        return read_tuple(
            value, key, what=what, item=f.metadata.get("item") or _PARSE[item]
        )
    want = type(_default(f))
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
        raise ValueError(f"{what} {key}={value!r} must be a {want.__name__}")
    return value


def read_tuple(
    value: Any, key: str, *, what: str, item: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """A ``tuple[X, ...]`` field's value: a comma-separated string or a list, each
    entry parsed with ``item`` (which raises ``ValueError`` saying what the entries
    must be); the one reader of such lists, also for a node's fleet keys.

    Raises:
        ValueError: ``"{what} {key}={value!r} ..."``, naming the fault.
    """
    if isinstance(value, str):
        entries: tuple[Any, ...] = split_list(value)
    elif isinstance(value, list | tuple):
        entries = tuple(value)
    else:
        raise ValueError(
            f"{what} {key}={value!r} must be a comma-separated str or a list"
        )
    try:
        return tuple(item(x) for x in entries)
    except ValueError as e:
        raise ValueError(f"{what} {key}={value!r} is invalid: {e}") from None


def _parse_int(x: Any) -> int:
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, str):
        try:
            return int(x.strip())
        except ValueError:
            pass
    raise ValueError(f"entry {x!r} is not an integer")


def _parse_float(x: Any) -> float:
    if isinstance(x, int | float) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x.strip())
        except ValueError:
            pass
    raise ValueError(f"entry {x!r} is not a number")


def _parse_str(x: Any) -> str:
    if not isinstance(x, str) or "," in x:
        raise ValueError(f"entry {x!r} is not a string without commas")
    return x.strip()


_PARSE: dict[type, Callable[[Any], Any]] = {
    int: _parse_int,
    float: _parse_float,
    str: _parse_str,
}


def to_flat(obj: Any) -> dict[str, Any]:
    """The flat keys of a dataclass instance (``from_flat``'s inverse): sub-configs
    flattened, tuples as comma-separated strings."""
    out: dict[str, Any] = {}
    hints = _hints(typing.cast(type, type(obj)))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_sub(hints[f.name]):
            sub = to_flat(value)
            assert not set(sub) & set(out), f"{type(obj).__name__}: a key is twice"
            out.update(sub)
        elif _items(hints[f.name]) is not None:
            out[flat_key(f)] = ",".join(str(x) for x in value)
        else:
            out[flat_key(f)] = value
    return out


def split_list(spec: str) -> tuple[str, ...]:
    """The entries of a comma-separated list, stripped, empty ones dropped."""
    return tuple(s for s in (x.strip() for x in spec.split(",")) if s)
