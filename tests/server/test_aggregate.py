import logging
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from server.aggregate import (
    Update,
    accept_updates,
    clip_changes,
    clip_weights,
    validate_update,
    weighted_average,
)

REF = {"w": torch.zeros(2, 3), "n": torch.tensor(0)}


def upd(pid, w, num=10, n=1, **state):
    return Update(pid, 100 + pid, num, {"w": w, "n": torch.tensor(n), **state})


def test_weighted_average_by_examples_and_int_buffers_max():
    a = upd(0, torch.ones(2, 3), num=10, n=3)
    b = upd(1, torch.full((2, 3), 4.0), num=30, n=5)
    out = weighted_average([b, a], REF)
    assert torch.allclose(out["w"], torch.full((2, 3), 3.25))
    assert int(out["n"]) == 5 and out["w"].dtype == torch.float32


def test_order_does_not_change_bits():
    g = torch.Generator().manual_seed(0)
    ups = [upd(i, torch.randn(2, 3, generator=g), num=i + 1) for i in range(5)]
    x = weighted_average(ups, REF)["w"]
    y = weighted_average(list(reversed(ups)), REF)["w"]
    assert torch.equal(x, y)


def test_bad_updates_are_rejected_with_reasons(caplog):
    good = upd(0, torch.ones(2, 3))
    bad = [
        upd(1, torch.tensor([[float("nan")] * 3] * 2)),
        upd(2, torch.ones(3, 2)),
        upd(3, torch.ones(2, 3, dtype=torch.float64)),
        Update(4, 104, 10, {"w": torch.ones(2, 3)}),
        upd(5, torch.ones(2, 3), extra=torch.ones(1)),
        upd(6, torch.ones(2, 3), num=0),
    ]
    with caplog.at_level(logging.WARNING):
        accepted, rejected = accept_updates([good, *bad], REF)
    assert accepted == [good]
    reasons = [r for _, r in rejected]
    assert "NaN" in reasons[0] and "shape" in reasons[1] and "dtype" in reasons[2]
    assert "missing ['n']" in reasons[3] and "unexpected ['extra']" in reasons[4]
    assert "num-examples" in reasons[5]
    assert len(caplog.records) == 6


def test_no_updates_keeps_reference():
    out = weighted_average([], REF)
    assert torch.equal(out["w"], REF["w"])
    validate_update(upd(0, torch.ones(2, 3)), REF)


def test_per_parameter_average_over_the_clients_that_trained_it():
    ref = {"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.ones(2)}
    full = Update(0, 100, 10, {k: torch.full((2,), 1.0) for k in ref})
    part = Update(1, 101, 30, {"b": torch.full((2,), 5.0)}, frozenset({"b"}))
    out = weighted_average([full, part], ref)
    assert torch.equal(out["a"], torch.full((2,), 1.0))  # only the full client
    assert torch.equal(out["b"], torch.full((2,), 4.0))  # (10 * 1 + 30 * 5) / 40
    only_part = weighted_average([part], ref)
    assert torch.equal(only_part["a"], ref["a"]) and torch.equal(
        only_part["c"], ref["c"]
    )


def test_part_updates_must_carry_exactly_their_keys():
    ref = {"a": torch.zeros(2), "b": torch.zeros(2)}
    ok = Update(0, 100, 1, {"b": torch.ones(2)}, frozenset({"b"}))
    missing = Update(1, 101, 1, {}, frozenset({"b"}))
    extra = Update(
        2, 102, 1, {"a": torch.ones(2), "b": torch.ones(2)}, frozenset({"b"})
    )
    accepted, rejected = accept_updates([ok, missing, extra], ref)
    assert accepted == [ok]
    assert "missing ['b']" in rejected[0][1] and "unexpected ['a']" in rejected[1][1]


def test_huge_norm_is_rejected_relative_to_the_median(caplog):
    ref = {"w": torch.ones(4)}
    g = torch.Generator().manual_seed(0)
    normal = [
        Update(i, 100 + i, 5, {"w": torch.ones(4) + 0.01 * torch.randn(4, generator=g)})
        for i in range(4)
    ]
    huge = Update(9, 109, 5, {"w": torch.full((4,), 1e4)})
    with caplog.at_level(logging.WARNING):
        accepted, rejected = accept_updates([*normal, huge], ref, norm_factor=10.0)
    assert accepted == normal
    assert rejected[0][0] is huge and "norm" in rejected[0][1]
    assert "node 109" in caplog.text
    # disabled bound: accepted
    accepted, _ = accept_updates([*normal, huge], ref, norm_factor=0.0)
    assert huge in accepted


# ---------------------------------------------------------------- influence (issue 32)
# A model of three floating keys and an integer buffer; honest nodes train it whole.
MODEL = {
    "a": torch.zeros(4, 3),
    "b": torch.zeros(5),
    "c": torch.zeros(2, 2),
    "n": torch.tensor(0),
}


def _change(u: Update, key: str) -> torch.Tensor:
    return u.state[key].double() - MODEL[key].double()


def _spec_bounds(updates: list[Update]) -> list[float]:
    """Each update's clip norm as the module docstring states it: per key, the lower
    median over the updates that trained it of the squared change per trained entry;
    the bound is the root of the sum, over the entries it trained, of those medians."""
    per_entry: dict[str, list[float]] = {}
    trained: list[dict[str, int]] = []
    for u in updates:
        mine = {}
        for key in u.state:
            if not MODEL[key].is_floating_point():
                continue
            mask = (u.coverage or {}).get(key)
            diff = _change(u, key)
            if mask is not None:
                diff = diff[mask]
            mine[key] = diff.numel()
            per_entry.setdefault(key, []).append(float(diff.square().sum()) / mine[key])
        trained.append(mine)
    median = {k: sorted(v)[(len(v) - 1) // 2] for k, v in per_entry.items()}
    return [sum(n * median[k] for k, n in t.items()) ** 0.5 for t in trained]


def _contribution(weighted: list[Update], i: int) -> torch.Tensor:
    """Update ``i``'s share of the average's change: the real weighted average with
    every other update's change set to zero (same weights, keys and masks)."""
    quiet = [
        u if j == i else replace(u, state={k: MODEL[k] for k in u.state})
        for j, u in enumerate(weighted)
    ]
    out = weighted_average(quiet, MODEL)
    return torch.cat([(out[k].double() - MODEL[k]).flatten() for k in "abc"])


def _least_weight(weighted: list[Update], u: Update) -> float:
    """The least total weight on any entry ``u`` trained (the weighted average's
    divisor there): the whole round's weight where every update trained it."""
    least = float("inf")
    for key in u.state:
        if not MODEL[key].is_floating_point():
            continue
        on = torch.zeros(MODEL[key].shape, dtype=torch.float64)
        for v in weighted:
            if key in v.state:
                mask = (v.coverage or {}).get(key)
                on += v.num_examples * (1.0 if mask is None else mask.double())
        mine = (u.coverage or {}).get(key)
        least = min(least, float((on if mine is None else on[mine]).min()))
    return least


def _honest(num: int, seed: int) -> list[Update]:
    g = torch.Generator().manual_seed(seed)
    step = {k: torch.randn(v.shape, generator=g) for k, v in MODEL.items() if k != "n"}
    out = []
    for i in range(num):
        noise = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in step.items()}
        state = {k: step[k] + noise[k] for k in step}
        out.append(Update(i, 100 + i, 50 + 25 * i, {**state, "n": torch.tensor(3)}))
    return out


@settings(max_examples=60, deadline=None)
@given(
    num_honest=st.integers(2, 6),
    seed=st.integers(0, 2**16),
    how=st.sampled_from(["scaled", "reversed", "orthogonal"]),
    factor=st.floats(1e-3, 1e6),
    keys=st.sampled_from(["full", "part", "masked"]),
    claim=st.integers(1, 10**15),
)
def test_every_replys_contribution_is_bounded_by_its_weight_and_the_median(
    num_honest, seed, how, factor, keys, claim
):
    """Honest whole-model updates plus one adversary, scaled, reversed (global minus
    a multiple of the honest mean change) or orthogonal to the honest mean, over the
    whole model, one key (a part window) or half of a key's entries (a sub-model),
    claiming up to 10**15 examples. After the change clip and the weight cap, each
    reply's contribution to the average's change has an L2 norm of at most
    (its weight / the least weight on an entry it trained) x its clip norm: over a
    round of whole-model updates, (its weight / the total weight) x the median."""
    honest = _honest(num_honest, seed)
    mean = {k: sum(_change(u, k) for u in honest) / num_honest for k in "abc"}
    if how == "scaled":
        change = {k: factor * _change(honest[0], k) for k in "abc"}
    elif how == "reversed":
        change = {k: -factor * mean[k] for k in "abc"}
    else:  # orthogonal to the honest mean change, over the whole model
        g = torch.Generator().manual_seed(seed + 1)
        r = {k: torch.randn(MODEL[k].shape, generator=g).double() for k in "abc"}
        dot = sum(float((r[k] * mean[k]).sum()) for k in "abc")
        nn = sum(float(mean[k].square().sum()) for k in "abc")
        change = {k: factor * (r[k] - dot / nn * mean[k]) for k in "abc"}
    state = {k: (MODEL[k] + change[k]).float() for k in "abc"}
    coverage = None
    if keys == "part":
        state, expected = {"b": state["b"]}, frozenset({"b"})
    else:
        state, expected = {**state, "n": torch.tensor(9)}, None
    if keys == "masked":  # a sub-model: half of a's entries, the rest global
        mask = torch.zeros(4, 3, dtype=torch.bool)
        mask[:2] = True
        state["a"] = torch.where(mask, state["a"], MODEL["a"])
        coverage = {"a": mask}
    adversary = Update(99, 999, claim, state, expected, coverage)
    updates = [*honest, adversary]
    accepted, rejected = accept_updates(updates, MODEL)
    assert not rejected
    clipped, clips = clip_changes(accepted, MODEL)
    bounds = _spec_bounds(accepted)
    assert [c.bound for c in clips] == pytest.approx(bounds, rel=1e-9)
    weighted = clip_weights(clipped, 2.0)
    total = sum(u.num_examples for u in weighted)
    for i, u in enumerate(weighted):
        got = float(_contribution(weighted, i).norm())
        limit = u.num_examples / _least_weight(weighted, u) * bounds[i]
        assert got <= limit * (1 + 1e-6) + 1e-9, (i, got, limit)
        if u.expected is None and u.coverage is None and keys == "full":
            assert _least_weight(weighted, u) == total  # every key: all the weight


def test_one_key_clip_norm_is_the_lower_median_norm():
    """With whole-model updates of a one-key model, the clip norm is the lower
    median of the updates' norms: the larger ones are scaled down to it, direction
    kept; the others are returned as they are."""
    ref = {"w": torch.zeros(3)}
    ups = [
        Update(i, i, 10, {"w": torch.tensor([1.0, 2.0, 2.0]) * s})
        for i, s in enumerate([1.0, 2.0, -5.0, 0.5])
    ]
    clipped, clips = clip_changes(ups, ref)
    assert [c.bound for c in clips] == [3.0] * 4  # norms 3, 6, 15, 1.5: lower median 3
    assert clipped[0] is ups[0] and clipped[3] is ups[3]
    assert torch.allclose(clipped[1].state["w"], torch.tensor([1.0, 2.0, 2.0]))
    assert torch.allclose(clipped[2].state["w"], -torch.tensor([1.0, 2.0, 2.0]))
    assert [c.scale for c in clips] == pytest.approx([1.0, 0.5, 0.2, 1.0])


def test_a_sub_model_is_held_to_the_entries_it_trained():
    """A sub-model covering 2 of 8 entries of a key is held to 2/8 of the median's
    squared norm there; a part window to the median over the keys it trained."""
    ref = {"w": torch.zeros(8), "h": torch.zeros(2)}
    honest = [
        Update(i, i, 10, {"w": torch.full((8,), 1.0), "h": torch.full((2,), 3.0)})
        for i in range(3)
    ]
    mask = torch.tensor([True, True] + [False] * 6)
    sub = Update(
        7,
        7,
        10,
        {"w": torch.where(mask, 100.0, 0.0), "h": torch.zeros(2)},
        coverage={"w": mask},
    )
    part = Update(8, 8, 10, {"h": torch.full((2,), -30.0)}, frozenset({"h"}))
    clipped, clips = clip_changes([*honest, sub, part], ref)
    assert clips[3].bound == pytest.approx((2 * 1.0 + 2 * 9.0) ** 0.5)
    assert clips[4].bound == pytest.approx((2 * 9.0) ** 0.5)
    assert torch.allclose(clipped[4].state["h"], torch.full((2,), -3.0))
    w = clipped[3].state["w"]
    assert bool((w[~mask] == 0).all()) and float(w[mask].norm()) < 20**0.5 + 1e-6


def test_three_honest_nodes_and_a_reversal_claiming_1e15_move_forward():
    """Issue 32, case 4, on the aggregation alone: three honest nodes with change d,
    one reply ``global - 9.9 d`` claiming 10**15 examples. The norm bound (10 x the
    median) passes it; the weight cap gives it 2 x the median count. Without the
    change clip the average moves -3.36 d; with it, +0.2 d."""
    ref = {"w": torch.zeros(4)}
    d = torch.tensor([0.1, -0.2, 0.3, 0.05])
    honest = [Update(i, i, 100, {"w": ref["w"] + d}) for i in range(3)]
    bad = Update(9, 9, 10**15, {"w": ref["w"] - 9.9 * d})
    accepted, _ = accept_updates([*honest, bad], ref, norm_factor=10.0)
    assert bad in accepted

    def steps(ups: list[Update]) -> float:
        out = weighted_average(clip_weights(ups, 2.0), ref)["w"].double()
        return float(out @ d.double() / (d.double() @ d.double()))

    assert steps(accepted) == pytest.approx(-3.36, abs=1e-6)  # update-clip = off
    clipped, _ = clip_changes(accepted, ref)
    assert steps(clipped) == pytest.approx(0.2, abs=1e-6)


def test_long_key_names_are_cut_in_reasons():
    ref = {"w": torch.zeros(1)}
    name = "k" * 4_000_000
    u = Update(0, 0, 1, {"w": torch.zeros(1), name: torch.zeros(1)})
    _, rejected = accept_updates([u], ref)
    assert len(rejected[0][1]) < 200 and "kkk..." in rejected[0][1]
