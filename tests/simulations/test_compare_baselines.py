"""HeteroFL, FedRolex and fleetfit's adapter variants in ``--compare``: sized per
device from the memory model, run on Flower's simulation engine, reported like every
strategy (the machinery, not which one wins)."""

from __future__ import annotations

import json

import pytest

from simulations.baselines import sizing
from simulations.compare import compare
from simulations.fleet import load_fleet, parse_fleet
from simulations.report import format_table


def tiny_fleet():
    # digits-mlp's plain step needs 109.66 MB with the runtime reserve at full width,
    # 109.25 MB at 1/2, 109.14 MB at 1/4 and 109.08 MB at 1/16: "tiny" fits no
    # level, "small" 1/4
    return parse_fleet(
        {
            "name": "tiny",
            "clients": 4,
            "num-server-rounds": 1,
            "local-steps": 2,
            "workload": "digits-mlp",
            "split": "dirichlet",
            "dirichlet-alpha": 1.0,
            "classes": [
                {"name": "tiny", "share": 0.25, "memory": "50MB"},
                {"name": "small", "share": 0.25, "memory": "109.2MB"},
                {"name": "large", "share": 0.5, "memory": "1GB"},
            ],
        }
    )


def test_sizing_counts_the_devices_no_level_fits():
    fleet = tiny_fleet()
    got = sizing(fleet, "heterofl")
    assert got["excluded_devices"] == 1
    assert got["levels"][0] is None and got["levels"][2:] == [1.0, 1.0]
    assert got["levels"][1] == 0.25
    assert got["classes"]["tiny"] == {"none": 1}
    assert list(got["need_bytes"]) == ["1", "0.5", "0.25", "0.125", "0.0625"]
    assert sizing(fleet, "fedrolex")["levels"] == got["levels"]


def test_phones_sizing():
    got = sizing(load_fleet("phones"), "heterofl")
    assert list(got["need_bytes"]) == ["1", "0.5", "0.25", "0.125"]  # 8 heads
    # at 5% allocator slack (9% until 2026-12-06: [0.25, 0.25] + [0.5] * 7 + [1.0, 0.5,
    # 1.0]); by class: 2 GB 0.25, 3 GB and 4 GB 0.5, 6 GB 0.5 or 1, 8 GB 1
    assert got["levels"] == [0.25] + [0.5] * 8 + [1.0] * 3
    assert got["excluded_devices"] == 0


def in_process(settings):
    """``simulate`` without Ray: the same server over in-process ClientApps."""
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import federate, nodes

    return federate(settings.server_config(), FakeGrid(nodes(settings.num_clients)))


@pytest.mark.child
def test_compare_reports_the_baselines_and_adapter_variants_like_the_others(
    tmp_path, monkeypatch
):
    import simulations.compare

    monkeypatch.setattr(simulations.compare, "simulate", in_process)
    variants = ("fleetfit-adapter", "adapters")
    result = check_comparison(tmp_path / "out", variants, client_measure="inline")
    s = result["strategies"]
    for name in variants:
        e = s[name]
        assert (tmp_path / "out" / name / "model.safetensors").exists()
        assert isinstance(e["final_metric"], float)
        assert e["classes"]["tiny"]["data_share"] == 0.0  # 50 MB: nothing fits
    got = {k for c in s["adapters"]["classes"].values() for k in c["kinds"]}
    assert "adapter" in got and not got & {"full", "part"}, got
    assert s["adapters"]["participation"] > 0  # an adapter update counts
    got = {k for c in s["fleetfit-adapter"]["classes"].values() for k in c["kinds"]}
    assert "part" not in got, got  # a plan, else an adapter, never a window first


@pytest.mark.heavy
@pytest.mark.simulation
def test_compare_runs_heterofl_and_fedrolex_on_the_engine(tmp_path):
    check_comparison(tmp_path / "out")


def check_comparison(out, extra=(), **engine):
    names = ["heterofl", "fedrolex", "exclude", *extra]
    result = compare(tiny_fleet(), names, out, **engine)
    on_disk = json.loads((out / "summary.json").read_text())
    assert list(on_disk["strategies"]) == names
    for name in ("heterofl", "fedrolex"):
        e = result["strategies"][name]
        assert (out / name / "model.safetensors").exists()
        assert e["sizing"]["excluded_devices"] == 1
        assert isinstance(e["final_metric"], float)
        assert [r["round"] for r in e["rounds"]] == [1]
        widths = {a["partition_id"]: a["width"] for a in e["rounds"][0]["assignments"]}
        assert widths.get(0, None) is None and widths.get(3, 1.0) == 1.0
        assert e["classes"]["tiny"]["data_share"] == 0.0
        assert e["classes"]["large"]["data_share"] in (0.0, 1.0)  # sampled or offline
        assert 0 < e["data_share"] <= 1
    text = format_table(result)
    assert all(n in text for n in names)
    assert (out / "report.md").exists()
    return result
