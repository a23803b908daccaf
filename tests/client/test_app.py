"""The ClientApp called directly with built messages."""

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)

from client.app import app
from tests import fakes  # noqa: F401  (sets Flower's task identity)
from wire.instruction import TrainInstruction
from wire.shape import RunShape
from workloads import get_workload


def ctx(node_config):
    return Context(
        run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={}
    )


def train_msg(workload="digits-mlp", **kw):
    model = get_workload(workload).make_model(0)
    ins = TrainInstruction(
        server_round=1,
        shape=RunShape(workload=workload, local_steps=3, lr=0.01),
        measure="inline",
    )
    config = {**ins.to_config(), **kw}
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord(config)}
    )
    return Message(content, 5, MessageType.TRAIN), model


def test_train_replies_with_changed_arrays_and_metrics():
    msg, model = train_msg()
    reply = app(msg, ctx({"partition-id": 1, "num-partitions": 4}))
    assert not reply.has_error()
    metrics = reply.content.metric_records["metrics"]
    assert metrics["num-examples"] > 300 and metrics["partition-id"] == 1
    new = reply.content.array_records["arrays"].to_torch_state_dict()
    old = model.state_dict()
    assert set(new) == set(old)
    assert any(not torch.equal(new[k], old[k]) for k in old)


def test_query_reports_node_facts():
    msg = Message(RecordDict({"config": ConfigRecord({})}), 5, MessageType.QUERY)
    node = {"partition-id": 2, "num-partitions": 3}
    node |= {"memory-budget": "512MB", "disk-budget": "0"}
    facts = dict(app(msg, ctx(node)).content.config_records["node"])
    assert facts["partition-id"] == 2 and facts["num-partitions"] == 3
    assert facts["budget-bytes"] == 512 * 10**6 and facts["disk-budget-bytes"] == 0
    assert facts["budget-source"] == "node-config"
    assert facts["total-memory-bytes"] >= facts["available-memory-bytes"] > 0
    assert facts["flops-per-s"] > 1e6 and facts["free-disk-bytes"] > 0


def test_query_takes_budgets_from_the_fleet_by_partition_id():
    fleet = {"fleet-memory-budgets": "100MB, 2GiB", "fleet-speeds": "1,0.25"}
    msg = Message(RecordDict({"config": ConfigRecord(fleet)}), 5, MessageType.QUERY)
    slow = dict(
        app(msg, ctx({"partition-id": 3, "num-partitions": 4})).content.config_records[
            "node"
        ]
    )
    fast = dict(
        app(msg, ctx({"partition-id": 2, "num-partitions": 4})).content.config_records[
            "node"
        ]
    )
    assert slow["budget-bytes"] == 2 * 2**30 and fast["budget-bytes"] == 100 * 10**6
    assert slow["budget-source"] == "fleet"
    assert slow["flops-per-s"] < fast["flops-per-s"] / 2
    # no budget anywhere: a measured share of the available memory
    msg = Message(RecordDict({"config": ConfigRecord({})}), 5, MessageType.QUERY)
    own = dict(
        app(msg, ctx({"partition-id": 0, "num-partitions": 1})).content.config_records[
            "node"
        ]
    )
    assert own["budget-source"] == "measured"
    assert 0 < own["budget-bytes"] < own["total-memory-bytes"]


def test_bad_budget_is_an_error_reply_naming_it():
    msg = Message(RecordDict({"config": ConfigRecord({})}), 5, MessageType.QUERY)
    node = {"partition-id": 0, "num-partitions": 1, "memory-budget": "lots"}
    reply = app(msg, ctx(node))
    assert reply.has_error() and "memory-budget 'lots'" in reply.error.reason


@pytest.mark.parametrize(
    "node_config,needle",
    [
        ({}, "partition-id"),
        ({"partition-id": 5, "num-partitions": 2}, "partition-id=5"),
        ({"partition-id": "x", "num-partitions": 2}, "must be integers"),
    ],
)
def test_bad_node_config_becomes_an_error_reply(node_config, needle):
    msg, _ = train_msg()
    reply = app(msg, ctx(node_config))
    assert reply.has_error() and needle in reply.error.reason


def test_unknown_workload_in_instruction_is_an_error_reply():
    msg, _ = train_msg()
    msg.content.config_records["config"]["workload"] = "nope"
    reply = app(msg, ctx({"partition-id": 0, "num-partitions": 2}))
    assert reply.has_error() and "unknown workload 'nope'" in reply.error.reason


@pytest.mark.child
def test_part_training_in_a_measured_child_sends_only_the_window():
    msg, model = train_msg()  # digits-mlp: blocks 0, 1 and the head 2
    cfg = msg.content.config_records["config"]
    cfg["kind"], cfg["window-start"], cfg["window-stop"] = "part", 1, 2
    cfg["measure"] = "child"
    reply = app(msg, ctx({"partition-id": 0, "num-partitions": 2}))
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    new = reply.content.array_records["arrays"].to_torch_state_dict()
    assert sorted(new) == ["1.0.bias", "1.0.weight", "2.bias", "2.weight"]
    old = model.state_dict()
    assert all(not torch.equal(new[k], old[k]) for k in new)
    m = reply.content.metric_records["metrics"]
    assert m["measured-peak-bytes"] > 0 and m["baseline-bytes"] > 100 * 2**20
    assert m["message-bytes"] >= sum(v.numel() * 4 for v in old.values())
    assert reply.content.config_records["report"]["peak-method"] == "child"


def test_none_assignment_replies_with_the_smallest_budget():
    msg, _ = train_msg()
    cfg = msg.content.config_records["config"]
    cfg["kind"], cfg["min-budget-bytes"], cfg["reason"] = "none", 12345, "too small"
    reply = app(msg, ctx({"partition-id": 0, "num-partitions": 2}))
    assert not reply.has_error()
    m = reply.content.metric_records["metrics"]
    assert m["min-budget-bytes"] == 12345 and m["num-examples"] == 0
    assert not reply.content.array_records
