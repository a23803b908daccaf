"""HeteroFL and FedRolex sub-models: slicing, the sub-models themselves, sizing, and
entry-wise aggregation against small worked examples (``workloads.width``,
``server.submodel``)."""

from __future__ import annotations

import pytest
import torch

from server.aggregate import Update, weighted_average
from server.submodel import SubmodelAssigner, expand
from wire.facts import NodeFacts
from workloads import get_workload, models
from workloads import width as W

# ---------------------------------------------------------------- a 2-layer MLP
# MLP(3 -> 4 -> 2): keys 0.1.weight [4, 3], 0.1.bias [4], 1.weight [2, 4], 1.bias [2];
# one hidden axis "0.1" of 4 units; inputs and the 2 outputs are never cut.


def small_mlp_state() -> dict[str, torch.Tensor]:
    m = models.MLP(in_features=3, hidden=(4,), out=2)
    return {
        k: torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape)
        for k, v in m.state_dict().items()
    }


def small_spec() -> W.WidthSpec:
    return W._chain_spec(models.MLP(in_features=3, hidden=(4,), out=2))


def test_spec_of_a_two_layer_mlp():
    spec = small_spec()
    assert dict(spec.axes) == {"0.1": 4}
    assert dict(spec.params) == {
        "0.1.weight": (W.Dim("0.1"), None),
        "0.1.bias": (W.Dim("0.1"),),
        "1.weight": (None, W.Dim("0.1")),
        "1.bias": (None,),
    }


def test_heterofl_takes_the_first_indices():
    state = small_mlp_state()
    sub = W.slice_state(state, W.index_maps(small_spec(), 0.5, 0))
    assert sub["0.1.weight"].tolist() == [[0, 1, 2], [3, 4, 5]]  # hidden units 0, 1
    assert sub["0.1.bias"].tolist() == [0, 1]
    assert sub["1.weight"].tolist() == [[0, 1], [4, 5]]  # both outputs, inputs 0, 1
    assert sub["1.bias"].tolist() == [0, 1]  # outputs are never cut


def test_fedrolex_window_rolls_and_wraps_around():
    spec = small_spec()
    assert W.rolling_offsets(spec, 1) == {"0.1": 0}
    assert W.rolling_offsets(spec, 4) == {"0.1": 3}
    assert W.rolling_offsets(spec, 5) == {"0.1": 0}  # a full turn
    assert W.axis_indices(4, 0.5, 3).tolist() == [3, 0]  # wraps
    sub = W.slice_state(small_mlp_state(), W.index_maps(spec, 0.5, 3))
    assert sub["0.1.weight"].tolist() == [[9, 10, 11], [0, 1, 2]]  # units 3, 0
    assert sub["0.1.bias"].tolist() == [3, 0]
    assert sub["1.weight"].tolist() == [[3, 0], [7, 4]]
    # a fused q, k, v projection: 4 heads of width 2, heads 3 and 0 of each third
    d = W.Dim("heads", inner=2, outer=3)
    got = W._dim_indices(d, 4, torch.tensor([3, 0])).tolist()
    assert got == [6, 7, 0, 1, 14, 15, 8, 9, 22, 23, 16, 17]


def test_entrywise_average_by_hand():
    """Three nodes on the 2-layer MLP: A full width (10 examples), B half width with
    FedRolex's window at units 3, 0 (30 examples), C a quarter, HeteroFL's unit 0
    (20 examples). Every entry averages over the nodes covering it."""
    spec = small_spec()
    ref = {k: torch.zeros_like(v) for k, v in small_mlp_state().items()}

    def update(pid, ratio, roll, value, n):
        maps = W.index_maps(spec, ratio, roll)
        sub = {
            k: torch.full_like(W.slice_tensor(v, maps[k]), value)
            for k, v in ref.items()
        }
        state, cover = expand(sub, ref, maps)
        return Update(pid, pid, n, state, None, cover or None)

    a = update(0, 1.0, 0, 1.0, 10)
    b = update(1, 0.5, 3, 5.0, 30)
    c = update(2, 0.25, 0, 9.0, 20)
    assert a.coverage is None  # full width: plain per-key averaging
    assert b.coverage is not None
    assert b.coverage["0.1.bias"].tolist() == [True, False, False, True]
    out = weighted_average([a, b, c], ref)
    # hidden unit 0: A, B, C -> (10*1 + 30*5 + 20*9) / 60; 1, 2: A only; 3: A, B
    assert out["0.1.bias"].tolist() == pytest.approx([340 / 60, 1, 1, 160 / 40])
    assert out["0.1.weight"][:, 0].tolist() == pytest.approx([340 / 60, 1, 1, 4])
    # output bias: every node covers it
    assert out["1.bias"].tolist() == pytest.approx([340 / 60] * 2)
    # 1.weight columns are hidden units: column 0 by all, 3 by A and B
    assert out["1.weight"][0].tolist() == pytest.approx([340 / 60, 1, 1, 4])
    # without the full-width node, units 1 and 2 are covered by nobody: kept
    out = weighted_average([b, c], ref)
    assert out["0.1.bias"].tolist() == pytest.approx([330 / 50, 0, 0, 5])
    assert out["1.bias"].tolist() == pytest.approx([330 / 50] * 2)


def test_expand_refuses_a_reply_of_another_shape():
    spec = small_spec()
    ref = small_mlp_state()
    maps = W.index_maps(spec, 0.5, 0)
    sub = W.slice_state(ref, maps)
    sub["0.1.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"0.1.bias: shape \(3,\), the sub-model's"):
        expand(sub, ref, maps)


# ---------------------------------------------------------------- built-ins
WORKLOADS = ["digits-mlp", "digits-cnn", "digits-cnn-bn", "gpt-tiny", "gpt-byte"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_sub_models_take_the_slices_and_keep_inputs_and_outputs(name):
    wl = get_workload(name)
    full = wl.make_model(0)
    x, _ = wl.example_batch()
    full.eval()
    with torch.no_grad():
        want = full(x).shape
    spec = W.width_spec(name)
    assert set(spec.params) == set(full.state_dict())
    for ratio in W.levels(name):
        for roll in (0, 7):
            sub_state = W.slice_state(
                full.state_dict(), W.index_maps(spec, ratio, roll)
            )
            sub = get_workload(f"{name}@w{ratio:g}").make_model(0)
            sub.load_state_dict(sub_state)  # shapes match the slices exactly
            for mode in (sub.eval, sub.train):
                mode()
                with torch.no_grad():
                    assert sub(x).shape == want
    if name.startswith("gpt"):  # whole heads only
        h = models.GPT_PRESETS[name].num_heads
        assert all((h * r).is_integer() for r in W.levels(name))
        with pytest.raises(ValueError, match="attention heads"):
            W.width_model(name, W.LEVELS[len(W.levels(name))])


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn"])
@pytest.mark.parametrize("roll", [0, 5])
def test_sub_model_is_the_full_model_without_the_other_units(name, roll):
    """In evaluation (no scaler) a digits sub-model computes what the full model
    computes with every hidden unit outside the window zeroed."""
    wl = get_workload(name)
    full = wl.make_model(0)
    spec = W.width_spec(name)
    maps = W.index_maps(spec, 0.25, roll)
    state = full.state_dict()
    zeroed = {}
    for k, v in state.items():
        rows = maps[k][0]
        if rows is not None and spec.params[k][0] is not None:  # a layer's outputs
            keep = torch.zeros(v.shape[0], dtype=torch.bool)
            keep[rows] = True
            v = v * keep.reshape(-1, *[1] * (v.dim() - 1))
        zeroed[k] = v
    full.load_state_dict(zeroed)
    sub = get_workload(f"{name}@w0.25").make_model(0)
    sub.load_state_dict(W.slice_state(state, maps))
    x, _ = wl.example_batch()
    full.eval(), sub.eval()
    with torch.no_grad():
        torch.testing.assert_close(sub(x), full(x))


def test_scaler_divides_hidden_outputs_by_the_ratio_in_training_only():
    sub = get_workload("digits-mlp@w0.25").make_model(0)
    x = torch.randn(5, 1, 8, 8)
    first = sub[0][1]  # the first Linear
    seen = {}
    first.register_forward_hook(lambda m, i, o: seen.__setitem__(m.training, o))
    sub.eval()
    sub(x)
    sub.train()
    sub(x)
    torch.testing.assert_close(seen[True], seen[False] / 0.25)
    # the output layer is never scaled, the full model has no scaler
    assert not list(sub)[-1]._forward_hooks
    assert not get_workload("digits-mlp@w1").make_model(0)[0][1]._forward_hooks


# ---------------------------------------------------------------- sizing
def test_sizing_picks_the_widest_level_that_fits():
    wl = get_workload("digits-mlp")
    a = SubmodelAssigner(
        wl,
        strategy="heterofl",
        local_steps=3,
        runtime_reserve_bytes=1000,
        train_time_s=1e3,
    )
    need = {r: a.need_bytes(r) for r in a.levels}
    assert list(need.values()) == sorted(need.values(), reverse=True)
    for r in a.levels:
        assert a.level_for(need[r]) == r
        got = a.assign(NodeFacts(budget_bytes=need[r]), 3)
        assert (got.kind, got.width, got.roll) == ("full", r, 0)
        assert got.workload == ("digits-mlp" if r == 1 else f"digits-mlp@w{r:g}")
        assert got.plan is not None and got.predicted_peak_bytes == need[r]
    assert a.level_for(need[0.5] - 1) == 0.25
    assert a.level_for(need[1.0] * 10) == 1.0
    low = a.assign(NodeFacts(budget_bytes=need[0.0625] - 1), 1)
    assert low.kind == "none" and low.min_budget_bytes == need[0.0625]
    assert "smallest sub-model" in low.reason
    rolex = SubmodelAssigner(
        wl, strategy="fedrolex", local_steps=3, runtime_reserve_bytes=0, train_time_s=1
    )
    assert rolex.assign(NodeFacts(budget_bytes=need[0.5]), 3).roll == 2


def test_custom_workloads_have_no_sub_models():
    with pytest.raises(ValueError, match="built-in workloads"):
        SubmodelAssigner(
            get_workload("gpt-byte@0.5"),
            strategy="heterofl",
            local_steps=1,
            runtime_reserve_bytes=0,
            train_time_s=1,
        )


# ---------------------------------------------------------------- a federation
@pytest.mark.child
@pytest.mark.parametrize("strategy", ["heterofl", "fedrolex"])
def test_federation_trains_sub_models_and_keeps_uncovered_entries(tmp_path, strategy):
    """Two digits-mlp nodes at half width and one too small for any level, through
    the real ClientApp: the first layer's hidden units outside every node's window
    keep their initial values."""
    from safetensors.torch import load_file

    from server.config import FleetConfig
    from tests.server.grid import FakeGrid
    from tests.server.test_federation import config, federate, nodes

    wl = get_workload("digits-mlp")
    a = SubmodelAssigner(
        wl, strategy=strategy, local_steps=2, runtime_reserve_bytes=0, train_time_s=1e3
    )
    half, smallest = a.need_bytes(0.5), a.need_bytes(0.0625)
    cfg = config(
        tmp_path,
        workload="digits-mlp",
        local_steps=2,
        num_server_rounds=2,
        strategy=strategy,
        fleet=FleetConfig(memory_budgets=(half, half, smallest - 1), disk_budgets=(0,)),
    )
    summary = federate(cfg, FakeGrid(nodes(3)))
    for r in summary["rounds"]:
        got = {
            x["partition_id"]: (x["kind"], x["width"], x["status"])
            for x in r["assignments"]
        }
        assert got == {
            0: ("full", 0.5, "ok"),
            1: ("full", 0.5, "ok"),
            2: ("none", None, "none"),
        }
        assert r["num_clients"] == 2
    w0 = wl.make_model(0).state_dict()["0.1.weight"]
    w2 = load_file(str(tmp_path / "run" / "model.safetensors"))["0.1.weight"]
    changed = (w2 != w0).any(dim=1)
    covered = torch.zeros(128, dtype=torch.bool)
    for rnd in (1, 2):
        covered[
            a.maps(a.assign(NodeFacts(budget_bytes=half), rnd))["0.1.weight"][0]
        ] = True
    assert covered.sum() == (64 if strategy == "heterofl" else 65)  # rolled by one
    assert not changed[~covered].any()
    assert changed[covered].all()
