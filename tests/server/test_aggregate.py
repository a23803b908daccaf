import logging

import torch

from server.aggregate import Update, accept_updates, validate_update, weighted_average

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
