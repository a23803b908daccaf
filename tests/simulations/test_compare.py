"""``--compare`` on Flower's simulation engine: each strategy's own run folder, one
summary in the documented schema, the report files; and every shipped fleet runs."""

from __future__ import annotations

import json

import pytest

from simulations.compare import compare
from simulations.fleet import load_fleet, parse_fleet

pytestmark = pytest.mark.simulation


def digits_fleet():
    # digits with a Dirichlet split (a natural split of digits gives each device one
    # or two digit classes, which FedAvg cannot learn); small devices cannot train
    # the plain step, whose need is about 110.7 MB with the runtime reserve
    return parse_fleet(
        {
            "name": "tiny",
            "clients": 4,
            "num-server-rounds": 2,
            "local-steps": 10,
            "workload": "digits-cnn",
            "split": "dirichlet",
            "dirichlet-alpha": 1.0,
            "classes": [
                {"name": "small", "share": 0.5, "memory": "110.3MB"},
                {"name": "large", "share": 0.5, "memory": "1GB"},
            ],
        }
    )


def test_compare_writes_one_summary_and_a_run_folder_each(tmp_path):
    fleet = digits_fleet()
    result = compare(fleet, ["fleetfit", "exclude", "smallest-model"], tmp_path / "out")
    out = tmp_path / "out"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    s = on_disk["strategies"]
    assert list(s) == ["fleetfit", "exclude", "smallest-model"]
    for name, e in s.items():
        assert (out / name / "summary.json").exists()
        assert (out / name / "model.safetensors").exists()
        assert 0 <= e["participation"] <= 1 and 0 <= e["data_share"] <= 1
        assert e["metric_name"] == "accuracy"
        assert isinstance(e["final_metric"], float)
        assert [r["round"] for r in e["rounds"]] == [1, 2]
        assert set(e["classes"]) == {"small", "large"}
    assert s["fleetfit"]["participation"] == 1.0
    assert s["fleetfit"]["data_share"] == 1.0
    assert s["exclude"]["classes"]["small"]["participation"] == 0.0
    assert s["exclude"]["classes"]["small"]["data_share"] == 0.0
    assert s["exclude"]["classes"]["large"]["participation"] == 1.0
    assert 0 < s["exclude"]["data_share"] < 1
    assert s["smallest-model"]["workload"].startswith("digits-cnn@")
    assert s["smallest-model"]["participation"] == 1.0
    for e in s.values():  # every measured peak within its budget
        for r in e["rounds"]:
            for a in r["assignments"]:
                if a["kind"] in ("full", "part"):
                    assert a["peak_method"] == "child"
                    assert 0 < a["measured_peak_bytes"] <= a["budget_bytes"], a
    for f in ("compare.csv", "rounds.csv", "metric.png", "report.md"):
        assert (out / f).stat().st_size > 0


@pytest.mark.parametrize("name", ["phones", "sbc", "edge"])
def test_every_shipped_fleet_compares(name, tmp_path):
    full = load_fleet(name)
    fleet = load_fleet(  # 16 held-out windows: central evaluation was most of the time
        name,
        clients=len(full.classes),
        num_server_rounds=1,
        local_steps=1,
        fraction_train=1.0,
        eval_windows=16,
    )
    result = compare(
        fleet,
        ["fleetfit", "exclude", "smallest-model"],
        tmp_path,
        report=False,
        client_measure="inline",  # quicker; the test above measures in children
    )
    s = result["strategies"]
    assert result["metric_name"] == "perplexity"
    available = [a for r in s["fleetfit"]["rounds"] for a in r["assignments"]]
    assert available and all(a["status"] == "ok" for a in available)
    assert s["fleetfit"]["participation"] == 1.0
    assert s["exclude"]["participation"] < 1.0
