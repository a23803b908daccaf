"""ONNX in a federation: nodes too small for any training evaluate in a torch-free
process and are counted with their measured peak; central evaluation in ORT; the run
folder gets model.onnx, model.int8.onnx and export.json."""

from __future__ import annotations

import json

import pytest

from client.app import app as client_app
from server.app import FlowerTransport
from server.config import ExportConfig, FleetConfig, ServerConfig
from server.loop import Federation
from server.persist import load_model
from tests.server.grid import FakeGrid
from wire.shape import RunShape
from workloads import get_workload


@pytest.mark.child
def test_eval_only_nodes_are_counted_with_their_peak(tmp_path):
    n = 3
    nodes = {
        3000 + i: (client_app, {"partition-id": i, "num-partitions": n})
        for i in range(n)
    }
    cfg = ServerConfig(
        shape=RunShape(local_steps=5),
        num_server_rounds=2,
        min_nodes=1,
        out=str(tmp_path / "run"),
        client_measure="inline",
        runtime_reserve="0",
        # the last fits no part: evaluation only
        fleet=FleetConfig(memory_budgets=(10**9, 10**9, 1000), disk_budgets=(0,)),
        export=ExportConfig(eval_runtime="onnxruntime", quantize=True),
    )
    transport = FlowerTransport(FakeGrid(nodes), query_config=cfg.fleet.to_query())
    fed = Federation(cfg, transport)
    summary = fed.run()
    wl = get_workload("digits-cnn")
    share = len(wl.client_items(2, n, "iid", seed=0))
    for r in summary["rounds"]:
        by_pid = {a["partition_id"]: a for a in r["assignments"]}
        small = by_pid[2]
        assert small["kind"] == "none" and small["status"] == "none"
        assert small["eval_runtime"] == "onnxruntime"
        assert small["eval_num_examples"] == share
        assert 0 <= small["eval_accuracy"] <= 1 and small["eval_loss"] > 0
        assert small["peak_method"] == "ort-child"
        assert 0 < small["measured_peak_bytes"] < 200e6
        assert small["message_bytes"] > 50_000  # the ONNX model
        assert r["num_evaluated"] == 1 and r["num_failed"] == 0
        assert r["num_clients"] == 2
        fe = r["federated_eval"]
        assert fe["num_nodes"] == 1 and fe["num_examples"] == share
        assert fe["accuracy"] == small["eval_accuracy"]
        assert "eval_accuracy" not in by_pid[0]
    # central evaluation ran in ONNX Runtime and agrees with torch on the saved model
    out = tmp_path / "run"
    state, _ = load_model(out / "model.safetensors")
    model = wl.make_model(0)
    model.load_state_dict(state)
    ref = wl.evaluate(model)
    last = summary["rounds"][-1]
    assert last["accuracy"] == ref["accuracy"]
    assert last["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    report = json.loads((out / "export.json").read_text())
    assert report["round"] == 2 and report["verification"]["ok"]
    assert (out / "model.onnx").exists() and (out / "model.int8.onnx").exists()
    assert report["evaluation"]["onnxruntime"]["accuracy"] == ref["accuracy"]
    assert "accuracy_change" in report["int8"]


def test_eval_only_off_and_export_off(tmp_path):
    nodes = {
        3100 + i: (client_app, {"partition-id": i, "num-partitions": 2})
        for i in range(2)
    }
    cfg = ServerConfig(
        shape=RunShape(local_steps=2),
        num_server_rounds=1,
        min_nodes=1,
        out=str(tmp_path / "run"),
        client_measure="inline",
        fleet=FleetConfig(memory_budgets=(10**9, 1000), disk_budgets=(0,)),
        export=ExportConfig(eval_only="off", onnx="off"),
    )
    transport = FlowerTransport(FakeGrid(nodes), query_config=cfg.fleet.to_query())
    summary = Federation(cfg, transport).run()
    (r,) = summary["rounds"]
    small = next(a for a in r["assignments"] if a["kind"] == "none")
    assert "eval_accuracy" not in small and small["message_bytes"] < 10_000
    assert r["num_evaluated"] == 0 and r["federated_eval"] is None
    assert not (tmp_path / "run" / "model.onnx").exists()


def test_bad_onnx_settings_fail_before_round_one():
    for key, value in (
        ("eval-runtime", "tf"),
        ("eval-only", "yes"),
        ("export-onnx", "always"),
    ):
        with pytest.raises(ValueError, match=key):
            ServerConfig.from_run_config({key: value})
