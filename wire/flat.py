"""Flower's flat kebab-case keys <-> a frozen dataclass: the one parser.

A field ``local_steps`` is the key ``local-steps``; a field may name another key in its
metadata (``field(default=600.0, metadata={"key": "round-timeout"})``). A value must
have its default's type: an integer is taken for a float, a bool only for a bool
field. Example::

    cfg = from_flat(ServerConfig, {"num-server-rounds": 3}, what="run-config")
    assert to_flat(cfg)["num-server-rounds"] == 3
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
        ValueError: naming the key, its value and the type it must have, or the
            unknown keys and the known ones.
    """
    assert dataclasses.is_dataclass(cls)
    by_key = {flat_key(f): f for f in dataclasses.fields(cls)}
    if strict:
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise ValueError(
                f"unknown {what} key(s) {', '.join(unknown)}; known: "
                f"{', '.join(by_key)}"
            )
    kwargs: dict[str, Any] = {}
    for key, f in by_key.items():
        if key not in values:
            continue
        value = values[key]
        want = type(_default(f))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (
            want is not bool and isinstance(value, bool)
        ):
            raise ValueError(f"{what} {key}={value!r} must be a {want.__name__}")
        kwargs[f.name] = value
    return cls(**kwargs)


def to_flat(obj: Any) -> dict[str, Any]:
    """The flat keys of a dataclass instance (``from_flat``'s inverse)."""
    return {flat_key(f): getattr(obj, f.name) for f in dataclasses.fields(obj)}


def split_list(spec: str) -> tuple[str, ...]:
    """The entries of a comma-separated list, stripped, empty ones dropped."""
    return tuple(s for s in (x.strip() for x in spec.split(",")) if s)
