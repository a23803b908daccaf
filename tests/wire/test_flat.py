"""``wire.flat``: sub-configs and tuple fields keep Flower's keys flat."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from wire.flat import flat_keys, from_flat, to_flat
from wire.shape import RunShape


def _even(entry: Any) -> int:
    value = int(entry)
    if value % 2:
        raise ValueError("even integers, comma-separated")
    return value


@dataclass(frozen=True)
class _Inner:
    speeds: tuple[float, ...] = field(default=(), metadata={"key": "node-speeds"})
    ids: tuple[int, ...] = ()
    evens: tuple[int, ...] = field(default=(), metadata={"item": _even})
    label: str = "x"


@dataclass(frozen=True)
class _Outer:
    shape: RunShape = field(default_factory=RunShape)
    rounds: int = 3
    inner: _Inner = field(default_factory=lambda: _Inner(label="outer's"))
    names: tuple[str, ...] = ("a", "b")


def test_sub_configs_are_flattened_with_their_keys_unchanged():
    assert flat_keys(_Outer) == (
        *flat_keys(RunShape),
        "rounds",
        "node-speeds",
        "ids",
        "evens",
        "label",
        "names",
    )
    flat = to_flat(_Outer())
    assert flat["workload"] == "digits-cnn" and flat["local-steps"] == 20
    assert flat["label"] == "outer's"  # the outer field's default, not _Inner's
    assert from_flat(_Outer, {}, what="cfg") == _Outer()
    got = from_flat(_Outer, {"local-steps": 4, "label": "y"}, what="cfg")
    assert got.shape == RunShape(local_steps=4) and got.inner == _Inner(label="y")


def test_tuples_parse_once_from_a_comma_string_or_a_list():
    got = from_flat(
        _Outer,
        {"node-speeds": " 1, 0.25 ,", "ids": [3, "4"], "evens": "2,0", "names": ""},
        what="cfg",
    )
    assert got.inner.speeds == (1.0, 0.25) and type(got.inner.speeds[0]) is float
    assert got.inner.ids == (3, 4) and got.inner.evens == (2, 0) and got.names == ()
    flat = to_flat(got)
    assert flat["node-speeds"] == "1.0,0.25" and flat["ids"] == "3,4"
    assert flat["names"] == ""


@pytest.mark.parametrize(
    "cfg",
    [
        _Outer(),
        _Outer(
            shape=RunShape(workload="m:f", lr=1e-5, split="natural", seq_len=64),
            inner=_Inner(speeds=(0.1, 1 / 3, 2.0), ids=(0, 7), evens=(4,)),
            names=("x",),
        ),
    ],
)
def test_from_flat_inverts_to_flat(cfg):
    assert from_flat(_Outer, to_flat(cfg), what="cfg", strict=True) == cfg


def test_an_unknown_key_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown cfg key\(s\) speeds; known: .*"):
        from_flat(_Outer, {"speeds": "1"}, what="cfg", strict=True)
    with pytest.raises(ValueError, match="node-speeds, ids, evens"):
        from_flat(_Outer, {"speeds": "1"}, what="cfg", strict=True)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("node-speeds", "1,fast", "cfg node-speeds='1,fast' is invalid: entry 'fast'"),
        ("ids", "1,2.5", "cfg ids='1,2.5' is invalid: entry '2.5' is not an integer"),
        ("ids", [1, True], "entry True is not an integer"),
        ("evens", "2,3", "cfg evens='2,3' is invalid: even integers"),
        ("names", "a,7", None),  # a string list takes any text
        ("node-speeds", 1.0, "cfg node-speeds=1.0 must be a comma-separated str"),
    ],
)
def test_a_bad_entry_names_the_key(key, value, needle):
    if needle is None:
        assert from_flat(_Outer, {key: value}, what="cfg").names == ("a", "7")
        return
    with pytest.raises(ValueError) as e:
        from_flat(_Outer, {key: value}, what="cfg")
    assert needle in str(e.value) and "\n" not in str(e.value)
