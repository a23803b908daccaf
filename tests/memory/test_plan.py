"""memory.plan: the cost model, exactness against brute force, budgets and errors."""

from __future__ import annotations

import itertools
import time

import pytest
from synthetic import gpt_like_profile, random_profile

from memory import cost as C
from memory import plan as P
from memory.errors import BudgetError, MemoryPlanError
from memory.spec import MemoryPlan

BIG_DISK = 10**13


def tied_ok(profile, choices):
    """The executor's rule: a streamed owner of a tied parameter streams its users."""
    names = [b.name for b in profile.blocks]
    for k, b in enumerate(profile.blocks):
        for owner in b.shared_with:
            if owner in names and choices[names.index(owner)] == C.STREAM:
                if choices[k] != C.STREAM:
                    return False
    return True


def brute_force(profile, raw_budget, disk_budget, microbatching=True):
    """(time, raw peak) of the fastest plan by enumerating every plan."""
    best = None
    n = len(profile.blocks)
    for m in profile.microbatch_options if microbatching else (1,):
        cs = [1] + sorted(c for (mm, c) in profile.blocks[-1].chunk_costs if mm == m)
        for c in cs:
            model = C.CostModel(profile, m, c)
            for choices in itertools.product(*(model.options(k) for k in range(n))):
                if not tied_ok(profile, choices):
                    continue
                raw = max(e[1] for e in C.events(model, choices))
                disk = sum(model.disk(k, ch) for k, ch in enumerate(choices))
                if raw_budget is not None and raw > raw_budget or disk > disk_budget:
                    continue
                t = sum(model.time(k, ch) for k, ch in enumerate(choices))
                key = (t, raw) if raw_budget is not None else (raw, t)
                if best is None or key < best:
                    best = key
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [4, 5])
def test_exact_search_equals_brute_force(n, seed):
    prof = random_profile(n, seed, chunks=(2,) if seed % 2 else (), tied=seed % 3 == 0)
    smallest = brute_force(prof, None, BIG_DISK)
    assert P.min_budget_bytes(prof, disk_budget_bytes=BIG_DISK) == C.slack(smallest[0])
    plain = C.predict_choices(C.CostModel(prof, 1, 1), ["K"] * n)
    lo = C.slack(smallest[0])
    for budget in [
        plain.peak_bytes,
        lo,
        (lo + plain.peak_bytes) // 2,
        lo + (plain.peak_bytes - lo) // 5,
    ]:
        raw = C.unslack(budget)
        want = brute_force(prof, raw, BIG_DISK)
        plan = P.plan_memory(prof, budget, disk_budget_bytes=BIG_DISK, batch_size=4)
        pred = C.predict(prof, plan)
        assert pred.peak_bytes <= budget
        assert plan.predicted_peak_bytes == pred.peak_bytes
        assert plan.predicted_step_s == pytest.approx(want[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_disk_budget_is_respected_exactly(seed):
    prof = random_profile(5, seed + 10)
    plain = C.predict_choices(C.CostModel(prof, 1, 1), ["K"] * 5)
    for disk in [0, 20 * 2**20, 200 * 2**20]:
        smallest = brute_force(prof, None, disk)
        lo = C.slack(smallest[0])
        assert P.min_budget_bytes(prof, disk_budget_bytes=disk) == lo
        budget = (lo + plain.peak_bytes) // 2
        want = brute_force(prof, C.unslack(budget), disk)
        plan = P.plan_memory(prof, budget, disk_budget_bytes=disk, batch_size=4)
        assert plan.predicted_disk_bytes <= disk
        assert plan.predicted_step_s == pytest.approx(want[0], rel=1e-12)
        if disk == 0:
            assert all(
                b.activations != "offload" and b.state == "resident"
                for b in plan.blocks
            )


def test_plain_budget_gives_plain_or_faster_plan_and_none_gives_smallest():
    prof = random_profile(6, 3)
    plain = C.predict_choices(C.CostModel(prof, 1, 1), ["K"] * 6)
    plan = P.plan_memory(
        prof, plain.peak_bytes, disk_budget_bytes=BIG_DISK, batch_size=4
    )
    assert plan.predicted_step_s <= plain.step_s
    smallest = P.plan_memory(prof, None, disk_budget_bytes=BIG_DISK, batch_size=4)
    assert smallest.predicted_peak_bytes == P.min_budget_bytes(
        prof, disk_budget_bytes=BIG_DISK
    )
    assert MemoryPlan.from_dict(smallest.to_dict()) == smallest


def test_budget_error_names_the_smallest_budget_and_what_dominates():
    prof = gpt_like_profile(4)
    lo = P.min_budget_bytes(prof, disk_budget_bytes=0)
    with pytest.raises(BudgetError) as e:
        P.plan_memory(prof, lo - 1, disk_budget_bytes=0, batch_size=4)
    assert e.value.min_budget_bytes == lo
    assert str(lo) in str(e.value)
    assert "resident" in e.value.dominant or "head" in e.value.dominant
    P.plan_memory(prof, lo, disk_budget_bytes=0, batch_size=4)  # fits exactly


def test_bad_inputs():
    prof = random_profile(3, 0)
    for bad in [0, -5, 1.5, True]:
        with pytest.raises(MemoryPlanError, match="positive"):
            P.plan_memory(prof, bad, batch_size=4)
    with pytest.raises(MemoryPlanError, match="batch size"):
        P.plan_memory(prof, 10**9, batch_size=8)


def test_no_microbatching_for_batch_dependent_models_unless_allowed():
    prof = gpt_like_profile(6)
    lo_any = P.min_budget_bytes(prof, disk_budget_bytes=0)
    lo_dep = P.min_budget_bytes(prof, disk_budget_bytes=0, batch_dependent=True)
    assert lo_dep >= lo_any
    plan = P.plan_memory(
        prof, lo_dep, disk_budget_bytes=0, batch_size=4, batch_dependent=True
    )
    assert plan.num_microbatches == 1
    plan = P.plan_memory(
        prof,
        lo_any,
        disk_budget_bytes=0,
        batch_size=4,
        batch_dependent=True,
        allow_microbatching=True,
    )
    assert plan.predicted_peak_bytes <= lo_any


def every_plan(profile):
    """(raw peak, time, disk) of every plan, enumerated once."""
    n = len(profile.blocks)
    out = []
    for m in profile.microbatch_options:
        cs = [1] + sorted(c for (mm, c) in profile.blocks[-1].chunk_costs if mm == m)
        for c in cs:
            model = C.CostModel(profile, m, c)
            for choices in itertools.product(*(model.options(k) for k in range(n))):
                if not tied_ok(profile, choices):
                    continue
                raw = max(e[1] for e in C.events(model, choices))
                disk = sum(model.disk(k, ch) for k, ch in enumerate(choices))
                t = sum(model.time(k, ch) for k, ch in enumerate(choices))
                out.append((raw, t, disk))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_search_equals_brute_force_on_six_blocks_and_a_budget_grid(seed):
    # loss chunks merged into one search, branch and bound: budgets from the
    # smallest to plain's, with and without a disk budget that binds
    prof = random_profile(6, 40 + seed, chunks=(2, 4), tied=seed % 2 == 0)
    plain = C.predict_choices(C.CostModel(prof, 1, 1), ["K"] * 6)
    plans = every_plan(prof)
    for disk in [BIG_DISK, 60 * 2**20]:
        lo = C.slack(min(raw for raw, _t, d in plans if d <= disk))
        assert P.min_budget_bytes(prof, disk_budget_bytes=disk) == lo
        for i in range(7):
            budget = lo + (plain.peak_bytes - lo) * i // 6
            raw_budget = C.unslack(budget)
            want = min(t for raw, t, d in plans if raw <= raw_budget and d <= disk)
            plan = P.plan_memory(prof, budget, disk_budget_bytes=disk, batch_size=4)
            assert C.predict(prof, plan).peak_bytes <= budget
            assert plan.predicted_disk_bytes <= disk
            assert plan.predicted_step_s == pytest.approx(want, rel=1e-12)


def test_128_blocks_plan_fast_at_every_budget():
    """Issue 3: 100+ blocks in under a second. The bound here is 2 s of this process's
    CPU time per call (not wall time: other work on the machine does not count); the
    timings are printed (``-s``), see docs/memory.md."""
    prof = gpt_like_profile(126)
    t0 = time.process_time()
    lo = P.min_budget_bytes(prof, disk_budget_bytes=BIG_DISK)
    timings = {"min_budget_bytes": time.process_time() - t0}
    plain = C.predict_choices(C.CostModel(prof, 1, 1), ["K"] * 128)
    budgets = {
        "minimum": lo,
        "1.5 x minimum": int(lo * 1.5),
        "8.8 x minimum": int(lo * 8.8),
        "half-way to plain": (lo + plain.peak_bytes) // 2,
        "plain's peak": plain.peak_bytes,
        "None": None,
    }
    for name, budget in budgets.items():
        t0 = time.process_time()
        plan = P.plan_memory(prof, budget, disk_budget_bytes=BIG_DISK, batch_size=4)
        timings[name] = time.process_time() - t0
        if budget is not None:
            assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes == lo  # None: the smallest plan
    print({name: round(s, 3) for name, s in timings.items()})
    assert max(timings.values()) < 2.0, timings


def test_a_search_too_large_for_an_exact_plan_takes_a_wide_beam(
    monkeypatch, caplog
) -> None:
    """Where the exact search's partial plans outgrow ``MAX_EXACT_STATES`` (a
    ResNet's 54 small units), the plan comes from a wider beam: still within the
    budget, no slower than the quick dive's."""
    prof = gpt_like_profile(12)

    def plan(budget: int | None) -> MemoryPlan:
        return P.plan_memory(
            prof, budget, batch_size=prof.batch_size, disk_budget_bytes=0
        )

    budget = plan(None).predicted_peak_bytes * 3 // 2
    exact = plan(budget)
    monkeypatch.setattr(P, "MAX_EXACT_STATES", 1)
    with caplog.at_level("INFO", logger="memory.plan"):
        wide = plan(budget)
    assert "too large" in caplog.text
    assert wide.predicted_peak_bytes <= budget
    assert wide.predicted_step_s >= exact.predicted_step_s * (1 - 1e-9)
