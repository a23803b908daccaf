"""On Flower's simulation engine (Ray): devices too small for any training evaluate
the round's model in a torch-free ONNX Runtime process, and the run's summary counts
them with their measured peak."""

import json

import pytest

pytestmark = pytest.mark.simulation


def test_simulation_counts_eval_only_devices(tmp_path):
    from flwr.simulation import run_simulation

    from client.app import app as client_app
    from server.app import make_app
    from server.config import ExportConfig, FleetConfig, ServerConfig
    from wire.shape import RunShape

    out = tmp_path / "run"
    cfg = ServerConfig(
        shape=RunShape(local_steps=5),
        num_server_rounds=2,
        min_nodes=4,
        out=str(out),
        # partitions 2 and 3: evaluation only
        fleet=FleetConfig(memory_budgets=(10**9, 10**9, 1000, 1000), disk_budgets=(0,)),
        export=ExportConfig(quantize=True),
    )
    run_simulation(
        server_app=make_app(cfg.to_run_config()),
        client_app=client_app,
        num_supernodes=4,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"include_dashboard": False, "log_to_driver": True},
        },  # type: ignore[arg-type]
    )
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rounds"]) == 2
    for r in summary["rounds"]:
        assert r["num_clients"] == 2 and r["num_evaluated"] == 2
        assert r["federated_eval"]["num_nodes"] == 2
        for a in r["assignments"]:
            if a["partition_id"] in (2, 3):
                assert a["kind"] == "none" and a["peak_method"] == "ort-child"
                assert 0 < a["measured_peak_bytes"] < 200e6
                assert a["eval_num_examples"] > 0 and 0 <= a["eval_accuracy"] <= 1
            else:
                assert a["kind"] == "full" and "eval_accuracy" not in a
    # the later round's evaluation-only nodes saw a trained model
    accs = [r["federated_eval"]["accuracy"] for r in summary["rounds"]]
    assert accs[1] > accs[0]
    assert json.loads((out / "export.json").read_text())["verification"]["ok"]
    assert (out / "model.int8.onnx").exists()
