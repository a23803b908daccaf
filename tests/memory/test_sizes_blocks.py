import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from memory import MemoryPlanError, format_bytes, parse_bytes
from memory.blocks import as_blocks, check_blocks


@pytest.mark.parametrize(
    "text,value",
    [
        ("512MB", 512_000_000),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        (4096, 4096),
        ("2kB", 2000),
        ("3 KiB", 3072),
        ("1e3", 1000),
        ("7B", 7),
        ("1GB", 10**9),
        ("0.5MiB", 2**19),
    ],
)
def test_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "text,msg",
    [
        ("0", "greater than zero"),
        ("-5MB", "negative"),
        ("abc", "cannot parse"),
        ("12XB", "cannot parse"),
        ("", "cannot parse"),
        ("1.5", "whole number"),
        (True, "not a size"),
        (float("nan"), "not a finite"),
        (-1, "negative"),
    ],
)
def test_parse_rejects(text, msg):
    with pytest.raises(MemoryPlanError, match=msg):
        parse_bytes(text, what="budget")


def test_zero_allowed_for_disk_budget():
    assert parse_bytes("0", allow_zero=True) == 0


@given(st.integers(min_value=1, max_value=2**50))
def test_format_parse_roundtrip_within_rounding(n):
    text = format_bytes(n)
    back = parse_bytes(text.replace(" ", "")) if "." not in text else None
    assert text.endswith(("B", "KiB", "MiB", "GiB"))
    if back is not None:
        assert back == n


@given(st.text(max_size=12))
def test_parse_never_crashes_unexpectedly(text):
    try:
        assert parse_bytes(text) > 0
    except MemoryPlanError:
        pass


class Prefixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class Shuffled(Prefixed):
    def forward(self, x):
        return self.out(self.layers[0](self.inp(x)))


def test_adapter_expands_layer_lists():
    model = Prefixed()
    blocks = check_blocks(model, torch.randn(2, 4))
    assert [b.name for b in blocks] == [
        "inp",
        "layers.0",
        "layers.1",
        "layers.2",
        "out",
    ]


def test_adapter_sequential_children():
    seq = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    assert [b.name for b in as_blocks(seq)] == ["0", "1"]


def test_adapter_detects_a_forward_that_is_not_a_chain():
    with pytest.raises(MemoryPlanError, match="do not reproduce"):
        check_blocks(Shuffled(), torch.randn(2, 4))
    with pytest.raises(MemoryPlanError, match="no child modules"):
        as_blocks(nn.ReLU())
