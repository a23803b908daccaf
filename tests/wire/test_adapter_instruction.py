"""An ``adapter`` train instruction round-trips through the flat config record and
is refused with the key named when its settings are invalid."""

from __future__ import annotations

import pytest

from wire.instruction import TrainInstruction


def test_adapter_instruction_round_trips():
    ins = TrainInstruction(
        kind="adapter",
        window_start=2,
        lora_rank=8,
        lora_alpha=16.0,
        lora_targets=("qkv", "fc"),
        base_dtype="bfloat16",
    )
    config = ins.to_config()
    assert config["lora-targets"] == "qkv,fc" and config["kind"] == "adapter"
    back = TrainInstruction.from_config(config)
    assert back == ins and back.window is None  # not a part window


@pytest.mark.parametrize(
    "bad",
    [
        {"lora-rank": 0},
        {"lora-alpha": -1.0},
        {"lora-alpha": float("nan")},
        {"window-start": -1},
        {"base-dtype": "int4"},
    ],
)
def test_bad_adapter_settings_are_refused(bad):
    config = {"kind": "adapter", "lora-rank": 4, "lora-alpha": 8.0, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainInstruction.from_config(config)
