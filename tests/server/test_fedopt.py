"""Server optimisers per key (server/fedopt.py), robust aggregation, their run-config
keys, and resume of the optimiser's state."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from server import persist
from server.aggregate import Update, robust_average, weighted_average
from server.config import FleetConfig, PrivacyConfig, ServerConfig
from server.fedopt import ServerOptConfig, ServerOptimizer
from server.persist import load_model, load_server_opt_state, load_state
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, digits_mins, federate, nodes
from workloads import get_workload

B1, B2, TAU, LR = 0.9, 0.99, 1e-3, 0.1


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def rounds_of(name: str, **kw):
    """Three rounds over keys a and b; b is not trained in round 2."""
    opt = ServerOptimizer(ServerOptConfig(name=name, **kw), ["a", "b"])
    x = {"a": t(1.0, -2.0), "b": t(0.5)}
    aggs = [
        ({"a": t(1.5, -2.5), "b": t(0.25)}, {"a", "b"}),
        ({"a": t(1.0, -1.0), "b": x["b"]}, {"a"}),  # b: nobody trained it
        ({"a": t(2.0, 0.0), "b": t(1.0)}, {"a", "b"}),
    ]
    seen = [x]
    for agg, trained in aggs:
        # the aggregate is relative to the current model: shift a, keep b's value
        # when untrained (weighted_average keeps the reference for such keys)
        step_agg = {"a": seen[-1]["a"] + (agg["a"] - x["a"])}
        step_agg["b"] = agg["b"] if "b" in trained else seen[-1]["b"]
        seen.append(opt.step(seen[-1], step_agg, trained))
    return opt, seen


def hand_adam(deltas: list[float]) -> list[float]:
    """Adam's per-key changes, by hand: t counts this key's own steps."""
    m = v = 0.0
    out = []
    for step, d in enumerate(deltas, start=1):
        m = B1 * m + (1 - B1) * d
        v = B2 * v + (1 - B2) * d * d
        scale = LR * math.sqrt(1 - B2**step) / (1 - B1**step)
        out.append(scale * m / (math.sqrt(v) + TAU))
    return out


def test_fedadam_masks_untrained_key_and_corrects_by_its_own_steps():
    opt, xs = rounds_of("fedadam")
    # key b: trained in rounds 1 and 3 only: its deltas and its own step count 1, 2
    b1 = 0.5 + hand_adam([0.25 - 0.5])[0]
    assert xs[1]["b"].item() == pytest.approx(b1, abs=1e-12)
    assert xs[2]["b"].item() == xs[1]["b"].item()  # round 2: not moved
    b3 = b1 + hand_adam([0.25 - 0.5, 1.0 - b1])[1]
    assert xs[3]["b"].item() == pytest.approx(b3, abs=1e-12)
    assert opt.steps == {"a": 3, "b": 2}
    # key a (first coordinate): trained every round
    a = [1.0]
    deltas = []
    for shift in (0.5, 0.0, 1.0):  # each round's aggregate minus the current value
        deltas.append(shift)
        a.append(a[-1] + hand_adam(deltas)[-1])
    assert [x["a"][0].item() for x in xs] == pytest.approx(a, abs=1e-12)


def test_untrained_round_leaves_state_bit_for_bit():
    opt = ServerOptimizer(ServerOptConfig(name="fedyogi"), ["a", "b"])
    x = {"a": t(1.0), "b": t(2.0)}
    x = opt.step(x, {"a": t(1.5), "b": t(2.5)}, {"a", "b"})
    before = opt.state_dict()
    y = opt.step(x, {"a": t(0.0), "b": x["b"]}, {"a"})
    after = opt.state_dict()
    assert torch.equal(y["b"], x["b"])
    for k in ("step/b", "m/b", "v/b"):
        assert torch.equal(before[k], after[k]), k
    assert after["step/a"].item() == 2 and after["step/b"].item() == 1


def test_fedyogi_fedadagrad_fedavgm_by_hand():
    _, xs = rounds_of("fedyogi")
    m = v = 0.0
    b = [0.5]
    for d_agg in (0.25, None, 1.0):
        if d_agg is None:
            b.append(b[-1])
            continue
        d = d_agg - b[-1]
        m = B1 * m + (1 - B1) * d
        v = v - (1 - B2) * d * d * math.copysign(1, v - d * d)
        b.append(b[-1] + 0.01 * m / (math.sqrt(v) + TAU))  # yogi's default lr 0.01
    assert [x["b"].item() for x in xs] == pytest.approx(b, abs=1e-12)

    _, xs = rounds_of("fedadagrad")
    v, b = 0.0, [0.5]
    for d_agg in (0.25, None, 1.0):
        if d_agg is None:
            b.append(b[-1])
            continue
        d = d_agg - b[-1]
        v += d * d
        b.append(b[-1] + 0.1 * d / (math.sqrt(v) + TAU))
    assert [x["b"].item() for x in xs] == pytest.approx(b, abs=1e-12)

    _, xs = rounds_of("fedavgm", lr=0.5, momentum=0.8)
    mom, b = None, [0.5]
    for d_agg in (0.25, None, 1.0):
        if d_agg is None:
            b.append(b[-1])
            continue
        d = d_agg - b[-1]
        mom = d if mom is None else 0.8 * mom + d
        b.append(b[-1] + 0.5 * mom)
    assert [x["b"].item() for x in xs] == pytest.approx(b, abs=1e-12)


def test_fedavg_returns_the_aggregate_itself():
    opt = ServerOptimizer(ServerOptConfig(), ["a"])
    agg = {"a": t(3.0)}
    assert opt.step({"a": t(1.0)}, agg, {"a"}) is agg and opt.state_dict() == {}


def test_state_saved_and_restored_bit_for_bit(tmp_path):
    """k rounds, save through persist, restore: the next round equals an
    uninterrupted run's bit for bit."""
    gen = torch.Generator().manual_seed(0)
    keys = ["w", "b"]
    aggs = [{k: torch.randn(4, 3, generator=gen) for k in keys} for _ in range(4)]
    masks = [{"w", "b"}, {"w"}, {"w", "b"}, {"w", "b"}]

    def run(opt, x, rounds):
        for i in rounds:
            x = opt.step(x, aggs[i], masks[i])
        return x

    cfg = ServerOptConfig(name="fedadam", lr=0.05)
    x0 = {k: torch.zeros(4, 3) for k in keys}
    whole = run(ServerOptimizer(cfg, keys), x0, range(4))
    first = ServerOptimizer(cfg, keys)
    x2 = run(first, x0, range(2))
    persist.save_round(tmp_path, 2, x2, {}, {"rounds": []}, {}, first.state_dict())
    restored = ServerOptimizer(cfg, keys)
    restored.load_state_dict(load_server_opt_state(tmp_path))
    _, model, _, _ = load_state(tmp_path)
    resumed = run(restored, model, range(2, 4))
    assert all(torch.equal(whole[k], resumed[k]) for k in keys)
    # one file per kind in state/, the old round's removed
    persist.save_round(tmp_path, 3, x2, {}, {"rounds": []}, {}, first.state_dict())
    assert [p.name for p in (tmp_path / "state").glob("server-opt-*")] == [
        "server-opt-000003.safetensors"
    ]


def test_load_refuses_state_of_another_model():
    opt = ServerOptimizer(ServerOptConfig(name="fedadam"), ["a"])
    with pytest.raises(ValueError, match="names no parameter"):
        opt.load_state_dict({"m/zz": torch.zeros(1)})


# ---------------------------------------------------------------- aggregation
def upd(pid, n, **state):
    return Update(pid, pid, n, {k: torch.tensor(v) for k, v in state.items()})


def test_median_and_trimmed_mean_per_key_unweighted():
    ref = {"a": torch.tensor([0.0]), "b": torch.tensor([9.0]), "c": torch.tensor(0)}
    ups = [
        upd(0, 1000, a=[1.0], b=[4.0], c=3),
        upd(1, 1, a=[2.0], c=5),
        upd(2, 1, a=[10.0], b=[6.0]),
        upd(3, 1, a=[4.0]),
    ]
    med = robust_average(ups, ref, how="median")
    assert med["a"].item() == 3.0  # (2 + 4) / 2: even count, weights ignored
    assert med["b"].item() == 5.0  # over the two replies that trained b
    assert med["c"].item() == 5  # integers: the largest, as the mean does
    trim = robust_average(ups, ref, how="trimmed-mean", trim_fraction=0.25)
    assert trim["a"].item() == 3.0  # int(0.25 * 4) = 1 cut at each end: (2 + 4) / 2
    assert trim["b"].item() == 5.0  # int(0.25 * 2) = 0 cut
    none = robust_average([], ref, how="median")
    assert all(torch.equal(none[k], ref[k]) for k in ref)
    assert weighted_average(ups, ref)["a"].item() == pytest.approx(
        (1000 + 2 + 10 + 4) / 1003
    )


# ---------------------------------------------------------------- run config
@pytest.mark.parametrize(
    "key,value,words",
    [
        ("server-opt", "adam", "fedadam"),
        ("server-lr", -1.0, "server-lr=-1.0"),
        ("server-momentum", 1.0, "[0, 1)"),
        ("server-beta2", 1.5, "server-beta2"),
        ("server-tau", 0.0, "positive"),
        ("aggregation", "krum", "median"),
        ("trim-fraction", 0.5, "[0, 0.5)"),
        ("proximal-mu", -0.1, "proximal-mu"),
    ],
)
def test_bad_values_name_the_key(key, value, words):
    with pytest.raises(ValueError, match="invalid") as e:
        ServerConfig.from_run_config({key: value})
    assert key in str(e.value) and words in str(e.value)


def test_defaults_and_ignored_settings():
    cfg = ServerConfig.from_run_config({})
    assert cfg.server_opt == ServerOptConfig() and cfg.shape.proximal_mu == 0.0
    assert ServerOptConfig(name="fedyogi").resolved_lr == 0.01
    assert ServerOptConfig(name="fedadam", lr=0.3).resolved_lr == 0.3
    assert ServerOptConfig(name="fedadam", momentum=0.5).ignored() == [
        "server-momentum"
    ]
    assert ServerOptConfig(trim_fraction=0.1).ignored() == ["trim-fraction"]
    with pytest.raises(ValueError, match="aggregation=mean"):
        ServerConfig(
            server_opt=ServerOptConfig(aggregation="median"),
            privacy=PrivacyConfig(clipping_norm=1.0),
        ).validate()


# ---------------------------------------------------------------- a federation
def test_fedadam_federation_with_part_windows_resumes_bit_identical(tmp_path, caplog):
    """Two part nodes: the keys no window reaches never move under FedAdam, and a
    run stopped after round 1 and resumed ends with the uninterrupted run's bits."""
    head_min, whole_min = digits_mins()
    common = dict(
        num_server_rounds=2,
        fleet=FleetConfig(memory_budgets=((head_min + whole_min) // 2, head_min + 1)),
        seed=3,
        server_opt=ServerOptConfig(name="fedadam", lr=0.02),
    )
    whole = federate(config(tmp_path / "a", **common), FakeGrid(nodes(2)))
    assert all(r["num_clients"] == 2 for r in whole["rounds"])
    assert all(a["kind"] == "part" for r in whole["rounds"] for a in r["assignments"])
    federate(
        config(tmp_path / "b", **{**common, "num_server_rounds": 1}),
        FakeGrid(nodes(2)),
    )
    with caplog.at_level(logging.WARNING):
        federate(config(tmp_path / "b", **common, resume=True), FakeGrid(nodes(2)))
    assert "no server optimiser state" not in caplog.text
    sa, _ = load_model(tmp_path / "a" / "run" / "model.safetensors")
    sb, _ = load_model(tmp_path / "b" / "run" / "model.safetensors")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    opt = load_server_opt_state(tmp_path / "a" / "run")
    steps = {k[5:]: int(v) for k, v in opt.items() if k.startswith("step/")}
    init = get_workload("digits-cnn").make_model(3)
    untouched = [k for k, _ in init.named_parameters() if k not in steps]
    assert untouched, "some block should be outside every window"
    for k in untouched:
        assert torch.equal(sa[k], init.state_dict()[k]), k
    # an optimiser state resumed with another server-opt is refused
    other = {**common, "server_opt": ServerOptConfig(name="fedyogi"), "resume": True}
    with pytest.raises(ValueError, match="server-opt"):
        federate(config(tmp_path / "b", **other), FakeGrid(nodes(2)))
