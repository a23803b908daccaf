"""The memory-aware federation through the real FlowerTransport and a fake Grid:
mixed budgets, malformed replies, dead nodes, resume, and Flower interoperability."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from client.app import app as client_app
from server.app import FlowerTransport
from server.assign import Assigner
from server.config import FleetConfig, ServerConfig
from server.loop import Federation
from server.persist import load_model, load_state
from tests.server.grid import FakeGrid
from wire.shape import RunShape
from workloads import get_workload


def nodes(n, app=client_app, **extra):
    return {
        2000 + i: (app, {"partition-id": i, "num-partitions": n, **extra})
        for i in range(n)
    }


def config(tmp_path, **kw):
    """A small run's settings; ``RunShape`` fields (``local_steps``, ``seed``, ...)
    by name, beside ``ServerConfig``'s own."""
    shape = {"local_steps": 5}
    shape.update({k: kw.pop(k) for k in SHAPE_FIELDS & set(kw)})
    base = dict(
        num_server_rounds=2,
        min_nodes=1,
        out=str(tmp_path / "run"),
        client_measure="inline",
        runtime_reserve="0",
    )
    return ServerConfig(shape=RunShape(**shape), **{**base, **kw})


SHAPE_FIELDS = {f.name for f in fields(RunShape)}


def federate(cfg, grid):
    query = cfg.fleet.to_query()
    return Federation(cfg, FlowerTransport(grid, query_config=query)).run()


def digits_mins():
    wl = get_workload("digits-cnn")
    a = Assigner(
        wl, wl.make_model(0), local_steps=5, runtime_reserve_bytes=0, train_time_s=1e3
    )
    return a._min_budget(3, 3, 0), a._min_budget(0, 3, 0)


@pytest.mark.child
def test_mixed_budgets_every_node_contributes(tmp_path):
    head_min, whole_min = digits_mins()
    budgets = [10 * whole_min, (head_min + whole_min) // 2, head_min + 1, head_min // 2]
    cfg = config(
        tmp_path,
        num_server_rounds=3,
        fleet=FleetConfig(memory_budgets=tuple(budgets), disk_budgets=(0,)),
    )
    summary = federate(cfg, FakeGrid(nodes(4)))
    for r in summary["rounds"]:
        kinds = {a["partition_id"]: a["kind"] for a in r["assignments"]}
        assert kinds == {0: "full", 1: "part", 2: "part", 3: "none"}
        assert r["num_clients"] == 3 and r["num_failed"] == 0
        for a in r["assignments"]:
            assert a["budget_bytes"] == budgets[a["partition_id"]]
            assert set(a) >= {
                "node_id",
                "budget_bytes",
                "kind",
                "measured_peak_bytes",
                "message_bytes",
            }
            if a["kind"] == "none":
                assert a["status"] == "none" and a["min_budget_bytes"] == head_min
            else:
                assert a["status"] == "ok" and a["measured_peak_bytes"] >= 0
                assert a["peak_method"].startswith("inline")
                assert a["message_bytes"] > 100_000  # the model's arrays
    acc = [r["accuracy"] for r in summary["rounds"]]
    assert acc[-1] > acc[0] + 0.15
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["rounds"][0]["assignments"] == summary["rounds"][0]["assignments"]


def test_malformed_replies_and_dead_nodes_do_not_stop_rounds(tmp_path):
    def tamper(node_id, reply):
        if reply.has_error() or reply.metadata.message_type != "train":
            return reply
        sd = reply.content.array_records["arrays"].to_torch_state_dict()
        metrics = reply.content.metric_records["metrics"]
        if node_id == 2001:  # NaN
            sd = {
                k: v * float("nan") if v.is_floating_point() else v
                for k, v in sd.items()
            }
        elif node_id == 2002:  # wrong shape
            k = next(iter(sd))
            sd[k] = torch.zeros(3, 3)
        elif node_id == 2003:  # a missing key
            sd.pop(next(iter(sd)))
        elif node_id == 2004:  # huge norm
            sd = {k: v * 1e6 if v.is_floating_point() else v for k, v in sd.items()}
        elif node_id == 2005:  # no metrics at all
            content = RecordDict({"arrays": ArrayRecord(sd)})
            return Message(content=content, metadata=reply.metadata)
        else:
            return reply
        content = RecordDict({"arrays": ArrayRecord(sd), "metrics": metrics})
        return Message(content=content, metadata=reply.metadata)

    grid = FakeGrid(nodes(8), tamper=tamper, silent={2007})
    cfg = config(tmp_path, num_server_rounds=1, round_timeout_s=1.0)
    summary = federate(cfg, grid)
    r = summary["rounds"][0]
    status = {a["node_id"]: a["status"] for a in r["assignments"]}
    assert status[2000] == "ok" and status[2006] == "ok"
    assert "NaN" in status[2001] and "shape" in status[2002]
    assert "missing" in status[2003] and "norm" in status[2004]
    # keys are checked before any array is decoded (wire.reply): malformed
    assert status[2003].startswith("malformed") and "nothing decoded" in status[2003]
    assert status[2005].startswith("malformed") and status[2007] == "no reply"
    assert r["num_clients"] == 2 and r["num_rejected"] == 3 and r["num_failed"] == 6
    assert np.isfinite(r["loss"])


def test_min_replies_keeps_the_model_when_too_few_arrive(tmp_path):
    grid = FakeGrid(nodes(3), silent={2001, 2002})
    cfg = config(tmp_path, num_server_rounds=1, min_replies=2, round_timeout_s=1.0)
    summary = federate(cfg, grid)
    r = summary["rounds"][0]
    assert r["num_clients"] == 0 and any("min-replies=2" in e for e in r["errors"])
    state, _ = load_model(tmp_path / "run" / "model.safetensors")
    init = get_workload("digits-cnn").make_model(0).state_dict()
    assert all(torch.equal(state[k], init[k]) for k in init)


def test_killed_and_resumed_run_ends_bit_identical(tmp_path):
    head_min, whole_min = digits_mins()
    budgets = (10 * whole_min, (head_min + whole_min) // 2, head_min + 1)
    common = dict(
        num_server_rounds=4, fleet=FleetConfig(memory_budgets=budgets), seed=3
    )
    federate(config(tmp_path / "a", **common), FakeGrid(nodes(3)))
    # "killed" after round 2: a run that stops there, then a resumed one
    federate(
        config(tmp_path / "b", **{**common, "num_server_rounds": 2}), FakeGrid(nodes(3))
    )
    assert load_state(tmp_path / "b" / "run")[0] == 2
    resumed = federate(
        config(tmp_path / "b", **common, resume=True), FakeGrid(nodes(3))
    )
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3, 4]
    sa, _ = load_model(tmp_path / "a" / "run" / "model.safetensors")
    sb, _ = load_model(tmp_path / "b" / "run" / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert load_state(tmp_path / "b" / "run")[0] == 4
    assert len(list((tmp_path / "b" / "run" / "state").glob("model-*"))) == 1


def test_waiting_ends_when_the_silent_nodes_have_left(tmp_path):
    class Leaving(FakeGrid):
        def get_node_ids(self):
            live = list(self.nodes)
            if any(t == "train" for t, _ in self.log):  # 2001 dies in round 1
                live.remove(2001)
            return live

    grid = Leaving(nodes(2), silent={2001})
    cfg = config(tmp_path, num_server_rounds=1, round_timeout_s=300.0)
    summary = federate(cfg, grid)  # returns long before the 300 s deadline
    r = summary["rounds"][0]
    assert r["num_clients"] == 1 and r["round_s"] < 60


def test_resume_refuses_another_workload(tmp_path):
    federate(config(tmp_path, num_server_rounds=1), FakeGrid(nodes(1)))
    cfg = config(tmp_path, num_server_rounds=2, workload="digits-mlp", resume=True)
    try:
        federate(cfg, FakeGrid(nodes(1)))
    except ValueError as e:
        assert "workload='digits-cnn'" in str(e)
    else:
        raise AssertionError("resume with another workload must fail")


# ---------------------------------------------------------------- interoperability
plain = ClientApp()


@plain.train()
def _plain_train(msg: Message, context) -> Message:  # a stock Message-API client
    sd = msg.content["arrays"].to_torch_state_dict()
    sd = {k: v + 0.001 if v.is_floating_point() else v for k, v in sd.items()}
    content = RecordDict(
        {"arrays": ArrayRecord(sd), "train_metrics": MetricRecord({"num-examples": 50})}
    )
    return Message(content=content, reply_to=msg)


def test_a_plain_flower_client_takes_part(tmp_path):
    mixed = nodes(2)
    mixed[2002] = (plain, {"partition-id": 2, "num-partitions": 3})
    summary = federate(config(tmp_path, num_server_rounds=1), FakeGrid(mixed))
    r = summary["rounds"][0]
    got = {a["node_id"]: a for a in r["assignments"]}
    assert got[2002]["kind"] == "full" and got[2002]["budget_bytes"] is None
    assert got[2002]["status"] == "ok" and got[2002]["message_bytes"] > 0
    assert r["num_clients"] == 3


def test_fleetfit_client_under_flowers_stock_fedavg():
    model = get_workload("digits-cnn").make_model(0)
    grid = FakeGrid(nodes(2))
    result = FedAvg(
        fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2
    ).start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=2,
        timeout=60,
        # stock keys only, plus two that fleetfit's client reads if present
        train_config=ConfigRecord({"local-steps": 5, "measure": "inline"}),
    )
    assert set(result.train_metrics_clientapp) == {1, 2}
    assert result.train_metrics_clientapp[2]["train-loss"] > 0
    final = result.arrays.to_torch_state_dict()
    start = model.state_dict()
    assert set(final) == set(start)
    assert any(not torch.equal(final[k], start[k]) for k in start)
