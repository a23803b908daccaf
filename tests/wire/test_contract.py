"""The wire contract: what one side writes the other reads, and replies crafted to
break the server are data (``MalformedReply`` or ``None``), never a crash."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from server.config import ServerConfig
from wire import keys
from wire.facts import NodeFacts, fleet_entry
from wire.flat import from_flat, to_flat
from wire.instruction import TrainInstruction, resolve_measure
from wire.reply import EvalReply, EvalResult, MalformedReply, TrainReply

ROOT = Path(__file__).resolve().parents[2]


def arrays() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.ones(3, dtype=np.float32))})


def test_a_train_reply_reads_back_as_written():
    sent = TrainReply(
        "part",
        num_examples=120,
        partition_id=3,
        train_loss=0.25,
        train_s=1.5,
        peak_bytes=5 * 2**20,
        baseline_bytes=2**20,
        message_bytes=4096,
        steps_done=7,
        peak_method="child",
        window=(1, 3),
    )
    content = sent.to_content(arrays())
    assert content.config_records[keys.REPORT][keys.WINDOW] == [1, 3]
    got = TrainReply.from_content(content, kind="part")
    assert got == TrainReply(**{**sent.__dict__, "window": None})  # the server's own
    assert list(TrainReply.arrays(content)) == ["w"]


def test_an_evaluation_only_reply_reads_back_as_written():
    ran = EvalResult(0.5, 0.75, 40, 0.2, "onnxruntime", "", 3 * 2**20, 2**20)
    sent = TrainReply(
        "none",
        num_examples=0,
        partition_id=1,
        eval=ran,
        peak_method="ort-child",
        min_budget_bytes=2**24,
        reason="small",
    )
    got = TrainReply.from_content(sent.to_content(), kind="none")
    assert got.eval == ran and got.peak_bytes == ran.peak_bytes
    assert got.reason == "small" and got.min_budget_bytes == 2**24
    failed = TrainReply("none", eval=EvalResult(error="no ONNX model"))
    got = TrainReply.from_content(failed.to_content(), kind="none")
    assert got.eval is not None and got.eval.error == "no ONNX model"
    assert not got.eval.ran
    assert (
        TrainReply.from_content(TrainReply("none").to_content(), kind="none").eval
        is None
    )


def test_a_stock_client_reply_is_read():
    """Flower's stock clients name their single records otherwise."""
    content = RecordDict(
        {"model": arrays(), "m": MetricRecord({keys.NUM_EXAMPLES: 10})}
    )
    got = TrainReply.from_content(content, kind="full")
    assert got.num_examples == 10 and got.partition_id is None
    assert got.peak_bytes is None and got.train_loss is None


@pytest.mark.parametrize(
    "metrics, why",
    [
        ({}, keys.NUM_EXAMPLES),
        ({keys.NUM_EXAMPLES: 3.5}, "integer"),
        ({keys.NUM_EXAMPLES: [1.0]}, "integer"),
        ({keys.NUM_EXAMPLES: [1, 2]}, "integer"),
        ({keys.NUM_EXAMPLES: math.nan}, "integer"),
        ({keys.NUM_EXAMPLES: math.inf}, "integer"),
        ({keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: [0.1]}, "train-loss"),
        ({keys.NUM_EXAMPLES: 5, keys.PARTITION_ID: 1.5}, "integer"),
    ],
)
def test_crafted_train_replies_are_malformed_naming_the_cause(metrics, why):
    content = RecordDict({keys.ARRAYS: arrays(), keys.METRICS: MetricRecord(metrics)})
    with pytest.raises(MalformedReply, match=why):
        TrainReply.from_content(content, kind="full")


def test_replies_without_their_records_are_malformed():
    two = RecordDict({"a": MetricRecord({keys.NUM_EXAMPLES: 1}), "b": MetricRecord({})})
    with pytest.raises(MalformedReply, match="MetricRecord"):
        TrainReply.from_content(two, kind="none")
    no_arrays = RecordDict({keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 1})})
    with pytest.raises(MalformedReply, match="ArrayRecord"):
        TrainReply.from_content(no_arrays, kind="part")


@pytest.mark.parametrize(
    "metrics, report, why",
    [
        ({keys.PEAK_BYTES: [1, 2]}, {}, keys.PEAK_BYTES),
        ({keys.MESSAGE_BYTES: math.inf}, {}, keys.MESSAGE_BYTES),
        ({keys.TRAIN_S: [0.5]}, {}, keys.TRAIN_S),
        ({}, {keys.PEAK_METHOD: 7}, keys.PEAK_METHOD),
    ],
)
def test_optional_figures_may_be_missing_but_not_wrong(metrics, report, why):
    """A stock client sends no figures (None); one that sends a figure of the wrong
    type is refused, naming it (issue 13: metrics checked for range)."""
    content = RecordDict(
        {
            keys.ARRAYS: arrays(),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 4, **metrics}),
            keys.REPORT: ConfigRecord(report),
        }
    )
    with pytest.raises(MalformedReply, match=why):
        TrainReply.from_content(content, kind="full")
    bare = RecordDict(
        {keys.ARRAYS: arrays(), keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 4})}
    )
    got = TrainReply.from_content(bare, kind="full")
    assert (got.num_examples, got.peak_bytes, got.train_s, got.peak_method) == (
        4,
        None,
        None,
        None,
    )


def test_an_evaluate_reply_reads_back_and_refuses_what_is_missing():
    sent = EvalReply(0.5, 0.9, 30)
    assert EvalReply.from_content(sent.to_content()) == sent
    with pytest.raises(MalformedReply, match=keys.EVAL_ACCURACY):
        EvalReply.from_content(
            RecordDict({keys.METRICS: MetricRecord({keys.EVAL_LOSS: 1.0})})
        )


def test_node_facts_read_back_and_nonsense_is_none():
    facts = NodeFacts(0, 4, 2**28, 0, "fleet", 2**34, 2**33, 2**35, 1e9, 2, False)
    assert NodeFacts.from_record(facts.to_record()) == facts
    assert NodeFacts.from_record({}) == NodeFacts() and NodeFacts().budget_bytes is None
    crafted = {
        keys.PARTITION_ID: "0",
        keys.BUDGET_BYTES: math.nan,
        keys.DISK_BUDGET_BYTES: True,
        keys.BUDGET_SOURCE: "trust me",
        keys.FLOPS_PER_S: -1.0,
        keys.NUM_CPUS: [4],
        keys.ADAPTERS: 1,  # not a bool
    }
    assert NodeFacts.from_record(crafted) == NodeFacts()


@pytest.mark.parametrize(
    "requested, source, measure",
    [
        ("auto", "measured", "inline"),
        ("auto", "node-config", "child"),
        ("auto", "fleet", "child"),
        ("auto", None, "auto"),  # the node resolves it with its own facts
        ("inline", "node-config", "inline"),
        ("child", "measured", "child"),
    ],
)
def test_the_measurement_rule(requested, source, measure):
    assert resolve_measure(requested, source) == measure


def test_fleet_entries_wrap_by_partition():
    key = "fleet-memory-budgets"
    assert fleet_entry({key: "1GB, 2GB ,"}, key, 3) == "2GB"
    assert fleet_entry({key: ["1GB", 2 * 10**9]}, key, 3) == 2 * 10**9
    assert fleet_entry({key: " , "}, key, 0) is None
    assert fleet_entry({key: None}, key, 0) is None and fleet_entry({}, key, 0) is None


def test_fleet_entries_are_read_as_the_run_configs_lists():
    """The node reads a fleet list as ServerConfig reads it (``wire.flat``): the same
    entries, and a value that is no list fails naming the key."""
    from server.config import FleetConfig
    from wire.flat import from_flat

    spec = {"fleet-speeds": " 1, 0.25 ,", "fleet-disk-budgets": ["0", "2GB"]}
    cfg = from_flat(FleetConfig, spec, what="run-config")
    for pid in range(4):
        assert float(fleet_entry(spec, "fleet-speeds", pid)) == cfg.speeds[pid % 2]
    assert fleet_entry(spec, "fleet-disk-budgets", 1) == "2GB"
    with pytest.raises(ValueError, match="fleet fleet-speeds=True must be a comma"):
        fleet_entry({"fleet-speeds": True}, "fleet-speeds", 0)
    with pytest.raises(ValueError, match="fleet-speeds.*entry True is neither"):
        fleet_entry({"fleet-speeds": [True]}, "fleet-speeds", 0)


@dataclass(frozen=True)
class _Flat:
    num_steps: int = 1
    rate: float = 0.5
    on: bool = False
    wait_s: float = field(default=2.0, metadata={"key": "wait"})


def test_one_flat_parser_for_both_sides():
    got = from_flat(_Flat, {"num-steps": 3, "rate": 1, "wait": 4}, what="cfg")
    assert got == _Flat(3, 1.0, False, 4.0) and isinstance(got.rate, float)
    assert from_flat(_Flat, to_flat(got), what="cfg") == got
    assert from_flat(_Flat, {"other": 1}, what="cfg") == _Flat()
    with pytest.raises(ValueError, match="unknown cfg key.*other.*known: num-steps"):
        from_flat(_Flat, {"other": 1}, what="cfg", strict=True)
    with pytest.raises(ValueError, match="cfg num-steps=True must be a int"):
        from_flat(_Flat, {"num-steps": True}, what="cfg")
    with pytest.raises(ValueError, match="cfg on=1 must be a bool"):
        from_flat(_Flat, {"on": 1}, what="cfg")
    # the run config and the instruction are parsed by it
    cfg = ServerConfig.from_run_config({"round-timeout": 5, "local-steps": 2})
    assert cfg.round_timeout_s == 5.0 and cfg.to_run_config()["round-timeout"] == 5.0
    ins = TrainInstruction.from_config({"server-round": 4, "clipping_norm": 1.0})
    assert ins.server_round == 4 and ins.window is None
    with pytest.raises(ValueError, match="train instruction lr='x' must be a float"):
        TrainInstruction.from_config({"lr": "x"})


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def test_neither_side_spells_a_message_key_of_its_own():
    """Every reply, report and fact key is written as ``wire.keys``' name: a side
    that spells one out can drift from the other (the run config's own keys, such as
    ``eval-runtime``, are ``server.config``'s)."""
    message_keys = {
        v
        for k, v in vars(keys).items()
        if k.isupper() and isinstance(v, str) and "-" in v
    }
    bad = []
    for package in ("client", "server"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "config.py" and package == "server":
                continue  # run-config keys share some names (eval-runtime)
            if path.name == "config.py" and package == "client":
                # Flower's node-config keys partition-id and num-partitions
                found = _string_constants(path) & message_keys - {
                    keys.PARTITION_ID,
                    keys.NUM_PARTITIONS,
                }
            else:
                found = _string_constants(path) & message_keys
            bad += [f"{path.relative_to(ROOT)}: {k}" for k in sorted(found)]
    assert not bad, bad
