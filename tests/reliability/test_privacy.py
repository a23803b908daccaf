"""Differential privacy and secure aggregation with fleetfit's apps (issue 8, item 6).

- Flower's central-DP wrappers (server-side and client-side fixed clipping) drive
  fleetfit's ClientApp through Flower's FedAvg: every reply keeps the received arrays'
  order (the wrappers pair arrays by position), and client-side clipping bounds every
  update that leaves a node.
- ``client.app.clipping_mod`` equals Flower's ``fixedclipping_mod`` on a ``full``
  update and also clips a ``part`` window (Flower's refuses: its keys differ).
- ``server.privacy`` (fleetfit's own aggregation): clipping, uniform averaging, noise
  of Flower's standard deviation, per-key divisors for partial updates; and the whole
  fleetfit loop with it, mixed ``full``/``part`` nodes.
- SecAgg+: why Flower 1.42's cannot serve fleetfit (pinned, so a Flower upgrade that
  changes it shows up here).
"""

from __future__ import annotations

import numpy as np
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
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.supercore.differential_privacy import compute_stdv

import client.app as ca
from server import privacy
from server.aggregate import Update
from server.config import FleetConfig, PrivacyConfig
from server.persist import load_model
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, digits_mins, federate, nodes
from wire import keys as wire_keys
from wire.instruction import TrainInstruction
from wire.shape import RunShape
from workloads import get_workload


def float_norm(state, reference):
    """The change's L2 norm over the reference's floating keys (Flower's FedAvg
    returns BatchNorm's integer step counters as float64)."""
    return privacy.update_norm(
        {k: v for k, v in state.items() if reference[k].is_floating_point()}, reference
    )


class Recorder:
    """A FakeGrid tamper hook that keeps a copy of every train reply's arrays, as they
    left the node (Flower's server-side wrapper clips the replies in place)."""

    def __init__(self):
        self.sent = []

    def __call__(self, node_id, reply):
        if not reply.has_error() and reply.metadata.message_type == "train":
            arrays = reply.content["arrays"]
            self.sent.append(
                (
                    list(arrays.keys()),
                    {k: v.clone() for k, v in arrays.to_torch_state_dict().items()},
                )
            )
        return reply


def start_fedavg(strategy, grid, model, workload, rounds=2):
    return strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=rounds,
        timeout=60,
        train_config=ConfigRecord(
            {"local-steps": 5, "measure": "inline", "workload": workload}
        ),
    )


# ------------------------------------------------------------- Flower's wrappers
@pytest.mark.parametrize("workload", ["digits-cnn", "digits-cnn-bn"])
def test_flowers_server_side_dp_drives_fleetfit_clients(workload):
    model = get_workload(workload).make_model(0)
    start = model.state_dict()
    rec = Recorder()
    clip = 0.005
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2),
        noise_multiplier=0.0,  # noise-free: the aggregate's change is bounded by clip
        clipping_norm=clip,
        num_sampled_clients=2,
    )
    result = start_fedavg(strategy, FakeGrid(nodes(2), tamper=rec), model, workload, 1)
    assert len(rec.sent) == 2
    for keys, sent in rec.sent:  # the received order (BatchNorm buffers sit in blocks)
        assert keys == list(start)
        assert float_norm(sent, start) > clip
    final = result.arrays.to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in final.values())
    change = float_norm(final, start)
    if workload == "digits-cnn":  # both clipped to exactly clip, nearly parallel
        assert clip / 2 < change <= clip * (1 + 1e-5)
    else:  # Flower counts BatchNorm's step counters (+5 each) in the norm: far less
        assert 0 < change < clip / 2


@pytest.mark.parametrize("workload", ["digits-cnn", "digits-cnn-bn"])
def test_flowers_client_side_dp_clips_every_fleetfit_update(workload):
    model = get_workload(workload).make_model(0)
    start = model.state_dict()
    rec = Recorder()
    clip = 0.005
    z = 1.0
    strategy = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2),
        noise_multiplier=z,
        clipping_norm=clip,
        num_sampled_clients=2,
    )
    result = start_fedavg(strategy, FakeGrid(nodes(2), tamper=rec), model, workload, 2)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert len(rec.sent) == 4
    for keys, _ in rec.sent:
        assert keys == list(start)
    for _, sent in rec.sent[:2]:  # round 1, against the model both nodes received
        assert float_norm(sent, start) == pytest.approx(clip, rel=1e-5)
    final = result.arrays.to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in final.values())
    # two rounds of noise of Flower's std on the average (~ z * clip / 2 per value)
    n = sum(v.numel() for v in start.values() if v.is_floating_point())
    std = compute_stdv(z, clip, 2)
    assert float_norm(final, start) == pytest.approx(std * (2 * n) ** 0.5, rel=0.1)


def train_message(model, config):
    msg = Message(
        RecordDict(
            {
                wire_keys.ARRAYS: ArrayRecord(model.state_dict()),
                wire_keys.CONFIG: ConfigRecord(config),
            }
        ),
        2000,
        MessageType.TRAIN,
    )
    msg.metadata.__dict__["_message_id"] = "m0"
    return msg


def call(app, msg, partition=0):
    ctx = Context(
        run_id=1,
        node_id=2000,
        node_config={"partition-id": partition, "num-partitions": 2},
        state=RecordDict(),
        run_config={},
    )
    return app(msg, ctx)


flower_clip_app = ClientApp()
flower_clip_app.train(mods=[fixedclipping_mod])(ca.train)


def test_clipping_mod_equals_flowers_fixedclipping_mod_on_a_full_update():
    model = get_workload("digits-cnn").make_model(0)
    config = {"local-steps": 3, "measure": "inline", privacy.KEY_CLIPPING_NORM: 0.02}
    ours = call(ca.app, train_message(model, config))
    theirs = call(flower_clip_app, train_message(model, config))
    a = ours.content["arrays"].to_torch_state_dict()
    b = theirs.content["arrays"].to_torch_state_dict()
    assert list(a) == list(b) == list(model.state_dict())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    assert float_norm(a, model.state_dict()) == pytest.approx(0.02, rel=1e-5)
    # without clipping_norm the same app trains unclipped
    plain = call(ca.app, train_message(model, {"local-steps": 3, "measure": "inline"}))
    assert float_norm(plain.content["arrays"].to_torch_state_dict(), a) > 0.1


def test_clipping_mod_clips_a_part_window_that_flowers_mod_refuses():
    model = get_workload("digits-cnn").make_model(0)
    ins = TrainInstruction(
        shape=RunShape(local_steps=3),
        kind="part",
        window_start=1,
        window_stop=2,
        measure="inline",
    ).to_config()
    config = {**ins, privacy.KEY_CLIPPING_NORM: 0.01}
    ours = call(ca.app, train_message(model, config))
    assert not ours.has_error()
    sent = ours.content["arrays"].to_torch_state_dict()
    assert set(sent) < set(model.state_dict())  # the window and the head only
    assert float_norm(sent, model.state_dict()) == pytest.approx(0.01, rel=1e-5)
    theirs = call(flower_clip_app, train_message(model, config))
    assert theirs.has_error() and "keys" in theirs.error.reason


def test_clipping_mod_refuses_a_bad_clipping_norm_before_training():
    model = get_workload("digits-cnn").make_model(0)
    for bad in (0.0, -1.0, "big"):
        reply = call(ca.app, train_message(model, {privacy.KEY_CLIPPING_NORM: bad}))
        assert reply.has_error() and "clipping_norm" in reply.error.reason


# ------------------------------------------------------------- server.privacy
def upd(pid, state, expected=None):
    return Update(pid, 3000 + pid, 10 * (pid + 1), state, expected)


def test_clip_update_bounds_the_norm_and_leaves_small_changes():
    ref = {"w": torch.zeros(4), "n": torch.tensor(0)}
    big = {"w": torch.tensor([3.0, 4.0, 0.0, 0.0]), "n": torch.tensor(7)}
    change, norm = privacy.clip_update(big, ref, 1.0)
    assert norm == 5.0 and set(change) == {"w"}  # integer buffers are not counted
    torch.testing.assert_close(change["w"], torch.tensor([0.6, 0.8, 0, 0]).double())
    change, norm = privacy.clip_update(big, ref, 10.0)
    torch.testing.assert_close(change["w"], big["w"].double())
    with pytest.raises(ValueError, match="clipping_norm"):
        privacy.clip_update(big, ref, 0.0)


def test_noise_free_private_average_is_the_uniform_mean_of_clipped_changes():
    ref = {"a": torch.zeros(2), "b": torch.ones(1), "n": torch.tensor(1)}
    u0 = upd(
        0, {"a": torch.tensor([2.0, 0.0]), "b": torch.ones(1), "n": torch.tensor(4)}
    )
    u1 = upd(
        1, {"a": torch.tensor([0.0, 0.5]), "b": torch.ones(1), "n": torch.tensor(6)}
    )
    state, rec = privacy.private_average(
        [u0, u1], ref, clipping_norm=1.0, noise_multiplier=0.0
    )
    # u0 clipped to norm 1, u1 kept; uniform weights (not 10:20 by examples)
    torch.testing.assert_close(state["a"], torch.tensor([0.5, 0.25]))
    torch.testing.assert_close(state["b"], torch.ones(1))
    assert int(state["n"]) == 6  # integer buffers: the largest, as weighted_average
    assert rec["num_clipped"] == 1 and rec["update_norms"] == [2.0, 0.5]


def test_noise_has_flowers_std_and_partial_keys_divide_by_their_assigned_nodes():
    n = 200_000
    ref = {"early": torch.zeros(n), "head": torch.zeros(n)}
    window = frozenset({"head"})  # a part node's window and head
    # four nodes: two full, two assigned a window; one of each never replied
    counts = privacy.expected_counts([None, None, window, window], ref)
    assert counts == {"early": 2, "head": 4}
    updates = [
        upd(0, {k: v.clone() for k, v in ref.items()}),
        upd(2, {"head": torch.zeros(n)}, window),
    ]
    z, clip = 1.5, 0.3
    state, rec = privacy.private_average(
        updates,
        ref,
        clipping_norm=clip,
        noise_multiplier=z,
        counts=counts,
        rng=np.random.default_rng(0),
    )
    assert rec["noise_std"] == compute_stdv(z, clip, 4)  # Flower's formula, all keys
    std = {k: float(v.std()) for k, v in state.items()}
    assert std["head"] == pytest.approx(compute_stdv(z, clip, 4), rel=0.01)
    assert std["early"] == pytest.approx(compute_stdv(z, clip, 2), rel=0.01)
    # a dropped node still counts: a missing reply is a zero change, not a smaller m
    one = privacy.private_average(
        [upd(0, {"early": torch.ones(n), "head": torch.zeros(n)})],
        ref,
        clipping_norm=1e9,
        noise_multiplier=0.0,
        counts=counts,
    )[0]
    torch.testing.assert_close(one["early"], torch.full((n,), 0.5))
    with pytest.raises(ValueError, match="noise_multiplier"):
        privacy.private_average(updates, ref, clipping_norm=1.0, noise_multiplier=-1)


def test_noise_is_not_seeded_by_default():
    ref = {"w": torch.zeros(1000)}
    kw = dict(clipping_norm=1.0, noise_multiplier=1.0)
    a = privacy.private_average([upd(0, {"w": torch.zeros(1000)})], ref, **kw)[0]
    b = privacy.private_average([upd(0, {"w": torch.zeros(1000)})], ref, **kw)[0]
    assert not torch.equal(a["w"], b["w"])


def test_fleetfits_loop_with_private_averaging_mixed_full_and_part(tmp_path):
    """``dp-clipping-norm`` in fleetfit's own loop: full and part nodes both clipped,
    the uniform average's change bounded, the round's record carries the DP facts."""
    head_min, whole_min = digits_mins()
    clip = 0.5
    cfg = config(
        tmp_path,
        norm_bound=0.0,
        fleet=FleetConfig(
            memory_budgets=(10 * whole_min, (head_min + whole_min) // 2),
            disk_budgets=(0,),
        ),
        privacy=PrivacyConfig(clipping_norm=clip, noise_multiplier=0.0),
    )
    summary = federate(cfg, FakeGrid(nodes(2)))
    previous = get_workload("digits-cnn").make_model(0).state_dict()
    from server.persist import load_state

    for r in summary["rounds"]:
        assert {x["kind"] for x in r["assignments"]} == {"full", "part"}
        assert r["num_clients"] == 2
        rec = r["dp"]
        # nodes clip before sending (clipping_mod) and the server clips again: every
        # update arrives with a norm of at most clip
        assert rec["clipping_norm"] == clip and len(rec["update_norms"]) == 2
        assert all(n <= clip * (1 + 1e-4) for n in rec["update_norms"])
    state = load_state(tmp_path / "run")[1]
    # per-key means of two changes of norm <= clip: keys only the full node trains
    # move by its whole change, so the bound over two rounds is 2 x 2 x clip
    change = privacy.update_norm(state, previous)
    assert 0 < change <= 4 * clip
    saved, _ = load_model(tmp_path / "run" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())


# ------------------------------------------------------------- SecAgg+
def test_secaggplus_needs_flowers_legacy_server_and_reply_layout():
    """Why fleetfit cannot use Flower 1.42's SecAgg+ as it stands (docs/security.md).

    The server side is a workflow of the legacy ``flwr.server`` API: it needs a
    ``LegacyContext`` (a legacy ``Strategy``'s ``configure_fit``/``aggregate_fit`` on
    FitIns/FitRes), which neither fleetfit's loop nor a Message-API ServerApp has. The
    client side, ``secaggplus_mod``, reads the reply in the legacy FitRes layout
    (``fitres.parameters``), which fleetfit's ClientApp does not write.
    """
    workflow = SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2)
    ctx = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}
    )
    with pytest.raises(TypeError, match="LegacyContext"):
        workflow(FakeGrid({}), ctx)
    model = get_workload("digits-cnn").make_model(0)
    reply = call(ca.app, train_message(model, {"local-steps": 1, "measure": "inline"}))
    assert not reply.has_error()
    with pytest.raises(KeyError, match="fitres"):
        compat.recorddict_to_fitres(reply.content, keep_input=True)
