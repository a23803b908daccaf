"""The ServerApp's loop with the ClientApp called directly with built messages."""

import json

import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from server.config import ServerConfig
from server.loop import Federation
from server.persist import load_model
from tests.fakes import DirectTransport
from wire.shape import RunShape


def run(tmp_path, transport, seed=0, **kw):
    cfg = ServerConfig(
        shape=RunShape(local_steps=5, seed=seed),
        num_server_rounds=2,
        min_nodes=1,
        out=str(tmp_path / "run"),
        client_measure="inline",
        **kw,
    )
    return Federation(cfg, transport).run(), tmp_path / "run"


@pytest.fixture(scope="module")
def seed0(tmp_path_factory):
    """Three nodes, seed 0: one run read by two tests."""
    return run(tmp_path_factory.mktemp("seed0"), DirectTransport(3))


def test_federation_writes_run_folder_and_improves(seed0):
    summary, out = seed0
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(r["num_clients"] == 3 for r in summary["rounds"])
    assert summary["rounds"][-1]["accuracy"] > 0.3
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["rounds"] == summary["rounds"] and on_disk["schema"] == 1
    assert (out / "summary.csv").read_text().startswith("round,")
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    state, meta = load_model(out / "model.safetensors")
    assert meta["workload"] == "digits-cnn" and meta["round"] == "2"
    assert set(state) == set(
        Federation(ServerConfig(), DirectTransport(1)).model.state_dict()
    )


def test_failed_and_malformed_clients_do_not_stop_the_round(tmp_path):
    def tamper(node_id, reply):
        if node_id == 1001:  # NaN update
            sd = reply.content.array_records["arrays"].to_torch_state_dict()
            sd = {
                k: v * float("nan") if v.is_floating_point() else v
                for k, v in sd.items()
            }
            content = RecordDict(
                {
                    "arrays": ArrayRecord(sd),
                    "metrics": reply.content.metric_records["metrics"],
                }
            )
            return Message(content=content, metadata=reply.metadata)
        if node_id == 1002:  # no arrays at all
            content = RecordDict({"metrics": MetricRecord({"num-examples": 3})})
            return Message(content=content, metadata=reply.metadata)
        return reply

    summary, _ = run(tmp_path, DirectTransport(4, tamper=tamper, fail={1003}))
    for r in summary["rounds"]:
        assert (
            r["num_sampled"] == 4 and r["num_clients"] == 1 and r["num_rejected"] == 1
        )
        assert any("malformed" in e for e in r["errors"])
        assert torch.isfinite(torch.tensor(r["loss"]))


def test_same_seed_same_model_bits(seed0, tmp_path):
    _, out_a = seed0
    b, out_b = run(tmp_path / "b", DirectTransport(3), seed=0)
    sa, _ = load_model(out_a / "model.safetensors")
    sb, _ = load_model(out_b / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c, out_c = run(tmp_path / "c", DirectTransport(3), seed=8)
    sc, _ = load_model(out_c / "model.safetensors")
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_sampling_fraction_is_seeded(tmp_path):
    t = DirectTransport(6)
    summary, _ = run(tmp_path, t, fraction_train=0.5)
    assert all(r["num_sampled"] == 3 for r in summary["rounds"])
    t2 = DirectTransport(6)
    run(tmp_path / "x", t2, fraction_train=0.5)
    assert t.sent == t2.sent


def test_a_run_that_accepted_no_update_fails_with_the_reason(tmp_path):
    from fleetfit.cmd_federation import run_failure

    def garbage(node_id, reply):  # every node: arrays that are not arrays
        content = RecordDict({"metrics": MetricRecord({"num-examples": float("inf")})})
        return Message(content=content, metadata=reply.metadata)

    summary, out = run(tmp_path / "bad", DirectTransport(2, tamper=garbage))
    assert all(r["num_clients"] == 0 for r in summary["rounds"])
    why = run_failure(out, 2, 0)
    assert "no update was accepted in any of 2 round(s)" in why
    assert "malformed: num-examples" in why  # why the replies were refused
    _, good = run(tmp_path / "good", DirectTransport(1))
    assert run_failure(good, 2, 0) == ""
    assert "after 2 of 3 rounds" in run_failure(good, 3, 0)
    assert "flwr run exit 1" in run_failure(good, 2, 1)
