"""A short simulation on Flower's simulation engine (Ray), and its determinism."""

import json

import pytest
import torch

from server.persist import load_model
from simulations.run import SimulationSettings, simulate
from wire.shape import RunShape

pytestmark = pytest.mark.simulation


def test_two_simulations_same_seed_same_model(tmp_path):
    kw = dict(
        num_clients=3, num_server_rounds=2, shape=RunShape(local_steps=5, seed=11)
    )
    a = simulate(SimulationSettings(out=str(tmp_path / "a"), **kw))
    b = simulate(SimulationSettings(out=str(tmp_path / "b"), **kw))
    assert [r["round"] for r in a["rounds"]] == [1, 2]
    assert all(r["num_clients"] == 3 for r in a["rounds"])
    sa, meta = load_model(tmp_path / "a" / "model.safetensors")
    sb, _ = load_model(tmp_path / "b" / "model.safetensors")
    assert meta["workload"] == "digits-cnn"
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [r["accuracy"] for r in a["rounds"]] == [r["accuracy"] for r in b["rounds"]]
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert {"summary.json", "summary.csv", "accuracy.png", "model.safetensors"} <= files
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["schema"] == 1
