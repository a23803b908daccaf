"""The one reader of replies (``wire.reply.read_train_reply``, ``NodeFacts.from_record``),
the weight caps (``max-examples``, ``weight-clip``) and the staged run folder: each
case here ended a run, or let one node decide the model, before issue 13."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from server import persist
from server.aggregate import Update, clip_weights, weighted_average
from server.config import ServerConfig
from wire import keys
from wire.facts import NodeFacts
from wire.reply import MalformedReply, read_train_reply

STATE = {"w": torch.ones(2, 3), "b": torch.zeros(3)}


def reply(metrics=None, arrays=None, report=None) -> RecordDict:
    records: dict = {
        keys.METRICS: MetricRecord(
            {keys.NUM_EXAMPLES: 10} if metrics is None else metrics
        )
    }
    records[keys.ARRAYS] = ArrayRecord(STATE) if arrays is None else arrays
    if report is not None:
        records[keys.REPORT] = ConfigRecord(report)
    return RecordDict(records)


def raw_array(data: bytes) -> Array:
    arr = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=b"x")
    arr.data = data  # as a peer's bytes arrive: Flower checks nothing more
    return arr


def test_an_honest_reply_reads_back_its_state():
    got, state = read_train_reply(reply(), kind="full")
    assert got.num_examples == 10
    assert state is not None and np.array_equal(state["w"], STATE["w"].numpy())


@pytest.mark.parametrize(
    "metrics",
    [
        {keys.NUM_EXAMPLES: math.inf},
        {keys.NUM_EXAMPLES: math.nan},
        {keys.NUM_EXAMPLES: -3},
        {keys.NUM_EXAMPLES: 0},
        {keys.NUM_EXAMPLES: 2.5},
        {keys.NUM_EXAMPLES: [1, 2]},
        {keys.NUM_EXAMPLES: 10, keys.PARTITION_ID: math.inf},
        {keys.NUM_EXAMPLES: 10, keys.PARTITION_ID: -1},
        {},
    ],
)
def test_bad_counts_and_partition_ids_are_rejected_with_a_reason(metrics):
    with pytest.raises(MalformedReply, match=r"\S"):
        read_train_reply(reply(metrics), kind="full")


@pytest.mark.parametrize(
    "data",
    [b"", b"PK\x03\x04" + b"\0" * 40, b"\x93NUMPY\x01\x00", b"garbage" * 10],
)
def test_malformed_array_bytes_are_rejected_not_raised(data):
    arrays = ArrayRecord({"w": raw_array(data), "b": Array(np.zeros(3, "float32"))})
    with pytest.raises(MalformedReply, match="array 'w' is unreadable"):
        read_train_reply(reply(arrays=arrays), kind="full")


def test_object_and_big_endian_arrays_are_rejected():
    big = ArrayRecord({"w": Array(np.ones((2, 3), ">f4")), "b": Array(np.zeros(3))})
    with pytest.raises(MalformedReply, match="dtype"):
        read_train_reply(reply(arrays=big), kind="full")


@pytest.mark.parametrize(
    "key, value",
    [
        (keys.PEAK_BYTES, math.inf),
        (keys.TRAIN_S, math.nan),
        (keys.TRAIN_S, -1.0),
        (keys.TRAIN_LOSS, math.nan),
        (keys.TRAIN_LOSS, 1e308),
        (keys.BASELINE_BYTES, -5),
        (keys.MESSAGE_BYTES, 10**30),
        (keys.STEPS_DONE, 2.5),
    ],
)
def test_a_figure_present_must_be_valid(key, value):
    with pytest.raises(MalformedReply, match=key):
        read_train_reply(reply({keys.NUM_EXAMPLES: 10, key: value}), kind="full")


def test_missing_figures_are_none_as_from_a_stock_client():
    got, _ = read_train_reply(reply(), kind="full")
    assert got.peak_bytes is None and got.train_s is None and got.train_loss is None


@pytest.mark.parametrize("key", [keys.PEAK_METHOD, keys.KIND, keys.REASON, keys.WINDOW])
def test_a_report_entry_of_the_wrong_type_is_refused(key):
    with pytest.raises(MalformedReply, match=f"report {key}"):
        read_train_reply(reply(report={key: b"\x00\xff"}), kind="full")


@pytest.mark.parametrize(
    "metrics, word",
    [
        ({keys.EVAL_NUM_EXAMPLES: 5}, "but no"),
        (
            {
                keys.EVAL_NUM_EXAMPLES: math.inf,
                keys.EVAL_LOSS: 1.0,
                keys.EVAL_ACCURACY: 0.5,
            },
            keys.EVAL_NUM_EXAMPLES,
        ),
        (
            {keys.EVAL_NUM_EXAMPLES: 5, keys.EVAL_LOSS: 1.0, keys.EVAL_ACCURACY: 7.0},
            keys.EVAL_ACCURACY,
        ),
        (
            {
                keys.EVAL_NUM_EXAMPLES: 5,
                keys.EVAL_LOSS: math.nan,
                keys.EVAL_ACCURACY: 0.5,
            },
            keys.EVAL_LOSS,
        ),
    ],
)
def test_an_evaluation_that_is_not_one_is_refused(metrics, word):
    with pytest.raises(MalformedReply, match=word):
        read_train_reply(RecordDict({keys.METRICS: MetricRecord(metrics)}), kind="none")


def test_an_honest_evaluation_reads():
    metrics = {keys.EVAL_NUM_EXAMPLES: 5, keys.EVAL_LOSS: 1.0, keys.EVAL_ACCURACY: 0.4}
    got, state = read_train_reply(
        RecordDict({keys.METRICS: MetricRecord(metrics)}), kind="none"
    )
    assert state is None and got.eval is not None
    assert (got.eval.num_examples, got.eval.loss, got.eval.accuracy) == (5, 1.0, 0.4)


def test_node_facts_out_of_range_are_unknown():
    for bad in (math.inf, math.nan, 0, -1, 2**70, "abc", b"x", [1], True):
        facts, refused = NodeFacts.read(
            {keys.BUDGET_BYTES: bad, keys.PARTITION_ID: bad, keys.NUM_CPUS: bad}
        )
        assert any(r.startswith(keys.BUDGET_BYTES) for r in refused), bad
        want = (
            NodeFacts(partition_id=0) if bad == 0 and bad is not True else NodeFacts()
        )
        assert facts == want, bad
    assert NodeFacts.from_record("not a record") == NodeFacts()  # type: ignore[arg-type]
    assert NodeFacts.from_record({keys.BUDGET_BYTES: 2**20}).budget_bytes == 2**20


def test_weights_are_clipped_to_a_multiple_of_the_median():
    honest = [Update(i, i, 100, {"w": torch.zeros(1)}) for i in range(3)]
    claimant = Update(9, 9, 10**15, {"w": torch.ones(1)})
    clipped = clip_weights([*honest, claimant], 4.0)
    assert [u.num_examples for u in clipped] == [100, 100, 100, 400]
    avg = weighted_average(clipped, {"w": torch.zeros(1)})["w"]
    assert float(avg) == pytest.approx(400 / 700)  # not 1.0: the claim does not decide
    assert clip_weights([*honest, claimant], 0.0)[-1].num_examples == 10**15


def test_caps_are_run_config_keys_with_checked_values():
    cfg = ServerConfig.from_run_config({"max-examples": 50, "weight-clip": 2.0})
    assert (cfg.max_examples, cfg.weight_clip) == (50, 2.0)
    for key, value in (
        ("max-examples", 0),
        ("weight-clip", 0.5),
        ("weight-clip", math.inf),
    ):
        with pytest.raises(ValueError, match=key):
            ServerConfig.from_run_config({key: value})


def test_files_hold_strict_json_and_no_nan(tmp_path):
    summary = {"rounds": [{"round": 1, "loss": math.nan, "x": b"\x00\x01", "t": (1,)}]}
    persist.save_round(tmp_path, 1, STATE, {"round": "1"}, summary, {})

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))

    on_disk = strict((tmp_path / persist.SUMMARY_FILE).read_text())
    assert on_disk["rounds"][0] == {
        "round": 1,
        "loss": None,
        "x": "<2 bytes>",
        "t": [1],
    }
    strict((tmp_path / "state" / persist.STATE_FILE).read_text())
    assert "nan" not in (tmp_path / persist.CSV_FILE).read_text().lower()


def test_a_failing_write_leaves_every_file_at_the_previous_round(tmp_path, monkeypatch):
    persist.save_round(
        tmp_path, 1, STATE, {"round": "1"}, {"rounds": [{"round": 1}]}, {}
    )

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(persist, "json_bytes", broken)
    summary = {"rounds": [{"round": 1}, {"round": 2}]}
    with pytest.raises(OSError, match="disk full"):
        persist.save_round(tmp_path, 2, STATE, {"round": "2"}, summary, {})
    monkeypatch.undo()
    _, meta = persist.load_model(tmp_path / persist.MODEL_FILE)
    saved = persist.load_state(tmp_path)
    assert saved is not None
    assert meta["round"] == "1" and saved[0] == 1
    assert len(json.loads((tmp_path / persist.SUMMARY_FILE).read_text())["rounds"]) == 1
    assert not list(tmp_path.rglob("*.tmp"))
