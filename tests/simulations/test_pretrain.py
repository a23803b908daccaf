"""Pretraining (issue 16 item 4): public data no device holds, each model pretrained
once per comparison, and a short comparison whose summaries carry simulated time."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from simulations.fleet import parse_fleet
from workloads import get_workload
from workloads.splits import private_indices, public_indices, split_indices


@pytest.mark.parametrize(
    "workload, split", [("digits-cnn", "dirichlet"), ("gpt-byte", "natural")]
)
def test_public_data_is_disjoint_from_every_device(workload, split):
    wl = get_workload(workload)
    items = wl.items(train=True)
    share = 0.2
    public = public_indices(items.groups, share)
    private = private_indices(items.groups, share)
    assert len(public) and len(np.intersect1d(public, private)) == 0
    assert len(public) + len(private) == len(items)
    # every group gives its share, whatever the run's seed
    for g in np.unique(items.groups):
        n = int((items.groups == g).sum())
        assert int((items.groups[public] == g).sum()) == int(share * n)
    classes = [0, 0, 1, 1, 2, 2]
    parts = split_indices(
        items.groups[private], 6, split, seed=3, classes=classes, alpha=1.0
    )
    for p, part in enumerate(parts):
        mine = private[part]  # indices into the whole training set
        assert len(np.intersect1d(mine, public)) == 0
        # what a client trains on is exactly that
        got = wl.client_items(
            p, 6, split, seed=3, alpha=1.0, classes=classes, public_share=share
        )
        assert np.array_equal(got.inputs.numpy(), items.inputs[mine].numpy())
    assert np.array_equal(
        wl.public_items(share).inputs.numpy(), items.inputs[public].numpy()
    )


def _cnn_fleet(pretrain):
    """Two digits-cnn devices, one too small for the plain step, one round."""
    return parse_fleet(
        {
            "name": "tiny",
            "clients": 2,
            "num-server-rounds": 1,
            "local-steps": 2,
            "workload": "digits-cnn",
            "split": "iid",
            "pretrain": pretrain,
            "classes": [
                {"name": "small", "share": 0.5, "memory": "110.3MB", "speed": 0.5},
                {"name": "large", "share": 0.5, "memory": "1GB", "uplink": "1MB/s"},
            ],
        }
    )


def test_compare_pretrains_each_model_once_and_records_simulated_time(
    tmp_path, monkeypatch
):
    """Three strategies over in-process ClientApps (the same server and clients as
    on the engine, without Ray: ``test_compare_baselines.in_process``); a comparison
    on Flower's engine with pretraining is
    ``test_compare_trains_each_model_at_its_pretraining_lr``."""
    import simulations.compare
    from simulations.compare import compare
    from tests.simulations.test_compare_baselines import in_process

    monkeypatch.setattr(simulations.compare, "simulate", in_process)
    fleet = _cnn_fleet({"share": 0.2, "steps": 5})
    out = tmp_path / "out"
    result = compare(
        fleet,
        ["fleetfit", "exclude", "smallest-model"],
        out,
        client_measure="inline",
        progress=False,
    )
    s = result["strategies"]
    # fleetfit and exclude share the base model: one pretraining; the shrunk model
    # of smallest-model gets its own
    models = sorted(p.name for p in (out / "pretrain").glob("*.safetensors"))
    assert len(models) == 2
    assert s["fleetfit"]["pretrain"]["cached"] is False
    assert s["exclude"]["pretrain"]["cached"] is True
    assert s["smallest-model"]["pretrain"]["cached"] is False
    assert s["smallest-model"]["pretrain"]["workload"].startswith("digits-cnn@")
    for name, e in s.items():
        run = json.loads((out / name / "summary.json").read_text())
        assert run["config"]["init-model"].startswith(str(out / "pretrain"))
        assert run["config"]["public-share"] == 0.2
        elapsed = 0.0
        for r in run["rounds"]:
            assert r["sim_round_s"] >= 0
            elapsed += r["sim_round_s"]
            assert r["sim_elapsed_s"] == pytest.approx(elapsed)
            trained = [a for a in r["assignments"] if a["status"] == "ok"]
            assert trained and all(a["sim_s"] > 0 for a in trained)
            assert r["sim_round_s"] == pytest.approx(max(a["sim_s"] for a in trained))
        assert e["sim_s"] == pytest.approx(elapsed) and elapsed > 0
    with open(out / "rounds.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(float(r["sim_elapsed_s"]) > 0 for r in rows)
    assert (out / "metric_time.png").read_bytes()[:4] == b"\x89PNG"
    assert "simulated s" in (out / "report.md").read_text()


def _tiny_fleet(pretrain):
    return parse_fleet(
        {
            "name": "tiny",
            "clients": 2,
            "num-server-rounds": 1,
            "local-steps": 2,
            "workload": "digits-mlp",
            "split": "iid",
            "pretrain": pretrain,
            "classes": [{"name": "all", "share": 1.0, "memory": "1GB"}],
        }
    )


def test_pretrain_lr_candidates_parse_and_bad_ones_fail_naming_the_field():
    fleet = _tiny_fleet({"steps": 3, "lr": [0.01, 0.001, 0.01]})
    assert fleet.pretrain.lrs == (0.001, 0.01) and fleet.pretrain.lr == 0.0
    # one lr: the cache key of before candidates existed (no "lrs" in it)
    assert "lrs" not in _tiny_fleet({"steps": 3, "lr": 0.01}).pretrain.describe()
    for bad in ([], [0.01, 0], [0.01, "x"], [True]):
        with pytest.raises(ValueError, match=r"pretrain\.lr"):
            _tiny_fleet({"steps": 3, "lr": bad})


def test_each_model_keeps_its_best_candidate_and_each_candidate_is_cached(tmp_path):
    from simulations.pretrain import pretrained_model

    fleet = _tiny_fleet({"steps": 20, "lr": [1e-6, 0.003, 50.0]})
    done = pretrained_model(fleet, "digits-mlp", tmp_path)
    sweep = {row["lr"]: row["metric"] for row in done.record["lr_sweep"]}
    assert sorted(sweep) == [1e-6, 0.003, 50.0]
    # accuracy: the highest wins; 20 steps at 1e-6 learn nothing and lr 50 diverges
    assert done.record["lr"] == max(sweep, key=lambda lr: sweep[lr]) == 0.003
    assert done.cached is False
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    # a candidate's model is the one a single-lr pretraining at it gives
    one = pretrained_model(
        _tiny_fleet({"steps": 20, "lr": 0.003}), "digits-mlp", tmp_path
    )
    assert one.cached is True and one.path == done.path
    again = pretrained_model(fleet, "digits-mlp", tmp_path)
    assert again.cached is True and again.record["lr"] == 0.003


def test_lr_from_pretrain_needs_candidates(tmp_path):
    from simulations.compare import compare

    with pytest.raises(ValueError, match="lr_from_pretrain"):
        compare(
            _tiny_fleet({"steps": 2}), ["fleetfit"], tmp_path, lr_from_pretrain=True
        )
    fleet = _tiny_fleet({"steps": 2, "lr": [0.001, 0.01]})
    with pytest.raises(ValueError, match="no lrs"):
        compare(
            fleet, ["fleetfit"], tmp_path, lr_from_pretrain=True, lrs={"fleetfit": 0.1}
        )


@pytest.mark.heavy
@pytest.mark.simulation
def test_compare_trains_each_model_at_its_pretraining_lr(tmp_path):
    from simulations.compare import compare

    fleet = _cnn_fleet({"share": 0.2, "steps": 5, "lr": [0.001, 0.01]})
    out = tmp_path / "out"
    result = compare(
        fleet,
        ["fleetfit", "smallest-model"],
        out,
        client_measure="inline",
        progress=False,
        cpus_per_client=min(2, os.cpu_count() or 1),  # 2 cores: 1 actor, 2 nodes
        lr_from_pretrain=True,
        pretrain_dir=tmp_path / "cache",
    )
    assert result["lr_rule"] == "pretrain"
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 4
    for name, e in result["strategies"].items():
        pre = e["pretrain"]
        assert [r["lr"] for r in pre["lr_sweep"]] == [0.001, 0.01]
        assert e["lr"] == pre["lr"]
        run = json.loads((out / name / "summary.json").read_text())
        assert run["config"]["lr"] == pre["lr"]
        assert run["config"]["init-model"].startswith(str(tmp_path / "cache"))
    assert "Pretraining lr candidates" in (out / "report.md").read_text()
