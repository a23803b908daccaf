"""A reply's size and keys are checked before any array is decoded (issue 32, case 5):
``wire.reply.read_train_reply`` with the server's ``max-reply-bytes`` and the
assignment's keys, on messages built in process. The round loop's cases (an oversize
reply, an unexpected key, a 4 MB key name) are in ``test_reply_cases.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from server.config import REPLY_ALLOWANCE_BYTES, ServerConfig
from wire import keys
from wire.reply import (
    MAX_KEY_CHARS,
    MAX_TEXT,
    MalformedReply,
    cap_text,
    read_train_reply,
    reply_bytes,
)
from workloads import get_workload

STATE = {"w": np.ones((4, 8), np.float32), "b": np.zeros(8, np.float32)}


def content(arrays: dict[str, np.ndarray], **metrics: Any) -> RecordDict:
    return RecordDict(
        {
            keys.ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 10, **metrics}),
            keys.REPORT: ConfigRecord({keys.KIND: "full", keys.REASON: "r" * 10}),
        }
    )


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any array decoded fails the test."""

    def refuse(self: Array) -> Any:
        raise AssertionError(f"an array of {len(self.data)} bytes was decoded")

    monkeypatch.setattr(Array, "numpy", refuse)


def test_reply_bytes_counts_what_the_reply_holds_without_decoding(no_decoding):
    c = content(STATE)
    arrays = c.array_records[keys.ARRAYS]
    data = sum(len(arrays[k].data) for k in arrays)
    names = len(keys.ARRAYS) + len(keys.METRICS) + len(keys.REPORT) + len("wb")
    texts = len(keys.NUM_EXAMPLES) + 8 + len(keys.KIND) + 4 + len(keys.REASON) + 10
    assert reply_bytes(c) == data + names + texts
    assert data > sum(a.nbytes for a in STATE.values())  # .npy headers too


def test_a_reply_over_the_limit_is_refused_undecoded(no_decoding):
    big = content({**STATE, "extra": np.zeros(10_000, np.uint8)})
    size = reply_bytes(big)
    with pytest.raises(MalformedReply, match="max-reply-bytes") as e:
        read_train_reply(big, kind="full", max_bytes=size - 1)
    assert f"{size:,} bytes" in str(e.value) and "not decoded" in str(e.value)


def test_a_reply_at_the_limit_with_its_keys_is_read():
    c = content(STATE)
    got, arrays = read_train_reply(
        c, kind="full", expected={"w", "b"}, max_bytes=reply_bytes(c)
    )
    assert got.num_examples == 10 and arrays is not None
    assert np.array_equal(arrays["w"], STATE["w"])


@pytest.mark.parametrize(
    "arrays, words",
    [
        ({**STATE, "evil": np.ones(1, np.float32)}, "unexpected ['evil']"),
        ({"w": STATE["w"]}, "missing ['b']"),
        (
            {**STATE, "k" * 4_000_000: np.ones(1, np.float32)},
            "k" * (MAX_KEY_CHARS - 3) + "...'",
        ),
    ],
    ids=["extra", "missing", "4mb-name"],
)
def test_keys_are_checked_before_any_array_is_decoded(no_decoding, arrays, words):
    with pytest.raises(MalformedReply, match="nothing decoded") as e:
        read_train_reply(content(arrays), kind="full", expected={"w", "b"})
    assert words in str(e.value) and len(str(e.value)) < 400


def test_cap_text():
    assert cap_text("abc", 5) == "abc"
    assert cap_text("x" * 1000) == "x" * (MAX_TEXT - 3) + "..."
    assert len(cap_text("x" * 1000, 10)) == 10


@pytest.mark.parametrize(
    "workload", ["digits-mlp", "digits-cnn", "digits-cnn-bn", "gpt-tiny"]
)
def test_auto_admits_a_whole_model_reply(workload):
    """The "auto" limit admits an honest whole-model reply of the model: every
    built-in under 1 MB, where the 1 MiB allowance matters most (gpt-byte, gpt2-small
    and -medium follow the same rule: 25% beyond the model's bytes is far more than
    their 77, 149 and 293 arrays' .npy headers of about 128 bytes each)."""
    state = get_workload(workload).make_model(0).state_dict()
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    limit = ServerConfig().reply_limit(model_bytes)
    c = content({k: v.numpy() for k, v in state.items()})
    assert reply_bytes(c) <= limit
    assert limit == model_bytes * 5 // 4 + REPLY_ALLOWANCE_BYTES


def test_max_reply_bytes_and_update_clip_are_run_config_keys():
    cfg = ServerConfig.from_run_config({"max-reply-bytes": "2MiB"})
    assert cfg.reply_limit(10**9) == 2 * 2**20
    assert ServerConfig.from_run_config({"max-reply-bytes": "0"}).reply_limit(5) == 0
    assert ServerConfig().update_clip == "median"
    assert ServerConfig.from_run_config({"update-clip": "off"}).update_clip == "off"
    for key, value, words in (
        ("max-reply-bytes", "lots", '"auto"'),
        ("max-reply-bytes", "-1", "negative"),
        ("update-clip", "mean", "median or off"),
    ):
        with pytest.raises(ValueError, match="invalid") as e:
            ServerConfig.from_run_config({key: value})
        assert key in str(e.value) and words in str(e.value), e.value
