"""memory.guard: the run-time guard stops a step that crosses its memory budget."""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable

import pytest
import torch

from memory.errors import BudgetExceededError, MemoryPlanError
from memory.guard import MemoryGuard
from memory.measure import rss_bytes
from memory.sizes import format_bytes

MB = 10**6
BIG = 200 * MB  # resident once filled, far over the small budget
BUDGET = 50 * MB


def filled(num_bytes: int) -> torch.Tensor:
    """A float32 tensor of ``num_bytes`` whose pages are all resident and go back to
    the OS when it is freed: a fresh anonymous mapping, never reused heap pages (glibc
    raises its mmap threshold after large frees, so ``torch.ones`` could land on pages
    an earlier test left resident, and the RSS would not move)."""
    buf = mmap.mmap(-1, num_bytes)
    t = torch.frombuffer(buf, dtype=torch.float32)
    t.fill_(1.0)
    t._fleetfit_mapping = buf  # type: ignore[attr-defined]  # lives with the tensor
    return t


def wait_for(condition: Callable[[], bool], guard: MemoryGuard) -> None:
    """Sleep in steps of a few intervals until ``condition()``; fail after 10 s.

    On a loaded machine the sampling thread may be slow to run: no test asserts on
    timing, each waits for what it needs, far longer than a few intervals if need be.
    """
    deadline = time.monotonic() + 10.0
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting on {guard!r}"
        time.sleep(4 * guard.interval_s)


def test_check_raises_naming_the_unit_and_the_sizes():
    with pytest.raises(BudgetExceededError) as info:
        with MemoryGuard(BUDGET) as guard:
            guard.unit = "transformer.h.3"
            buf = filled(BIG)
            guard.check()
    err = info.value
    del buf
    assert err.unit == "transformer.h.3"
    assert err.budget_bytes == BUDGET
    assert err.measured_bytes >= 150 * MB
    msg = str(err)
    assert "\n" not in msg
    assert "unit 'transformer.h.3'" in msg
    assert format_bytes(BUDGET) in msg
    assert format_bytes(err.measured_bytes) in msg
    assert isinstance(err, MemoryPlanError)
    assert not guard.running


def test_message_with_a_given_baseline():
    # a baseline 100 MB below the RSS now: over a 50 MB budget without allocating
    baseline = rss_bytes() - 100 * MB
    guard = MemoryGuard(BUDGET, baseline_bytes=baseline, margin_bytes=MB)
    with pytest.raises(BudgetExceededError) as info:
        with guard:
            guard.unit = "lm_head"
            guard.check()
    err = info.value
    assert guard.baseline_bytes == baseline
    assert 90 * MB <= err.measured_bytes <= 200 * MB
    assert str(err) == (
        f"training used {format_bytes(err.measured_bytes)} above its baseline while "
        f"running unit 'lm_head', over the memory budget of {format_bytes(BUDGET)} "
        f"(plus a margin of {format_bytes(MB)}); plan for a smaller budget or free "
        "memory"
    )


def test_the_margin_is_slack_above_the_budget():
    baseline = rss_bytes() - 100 * MB
    with MemoryGuard(BUDGET, baseline_bytes=baseline, margin_bytes=500 * MB) as guard:
        guard.check()
        assert guard.peak_bytes >= 90 * MB
    assert not guard.crossed


def test_a_budget_not_crossed_does_not_raise_and_reports_a_plausible_peak():
    with MemoryGuard(1000 * MB) as guard:
        guard.unit = "block.0"
        buf = filled(40 * MB)
        wait_for(lambda: guard.peak_bytes >= 35 * MB, guard)
        guard.check()
        guard.unit = "block.1"
        guard.check()
    del buf
    assert 35 * MB <= guard.peak_bytes <= 500 * MB
    assert guard.peak_unit in {"block.0", "block.1"}
    assert not guard.crossed


def test_the_thread_records_a_spike_freed_before_the_check():
    guard = MemoryGuard(BUDGET)
    with pytest.raises(BudgetExceededError) as info:
        with guard:
            guard.unit = "spike"
            buf = filled(BIG)
            wait_for(lambda: guard.peak_bytes >= 150 * MB, guard)
            del buf
            # the memory went back to the OS: only the thread's record remains
            assert rss_bytes() - (guard.baseline_bytes or 0) < BUDGET
            guard.unit = "after"
            guard.check()
    err = info.value
    assert err.unit == "spike"
    assert err.measured_bytes > BUDGET
    assert guard.peak_bytes >= 150 * MB
    assert guard.peak_unit == "spike"


def test_exit_raises_a_crossing_no_check_reported():
    guard = MemoryGuard(BUDGET)
    with pytest.raises(BudgetExceededError) as info:
        with guard:
            guard.unit = "mlp"
            buf = filled(BIG)
            wait_for(lambda: guard.crossed, guard)
            del buf
    assert info.value.unit == "mlp"
    assert not guard.running


def test_exit_does_not_mask_an_exception_already_propagating():
    guard = MemoryGuard(BUDGET)
    with pytest.raises(KeyError):
        with guard:
            buf = filled(BIG)
            wait_for(lambda: guard.crossed, guard)
            del buf
            raise KeyError("the step's own error")
    assert guard.crossed
    assert not guard.running


def test_a_crossing_reported_by_check_is_not_raised_again_at_exit():
    with MemoryGuard(BUDGET) as guard:
        buf = filled(BIG)
        with pytest.raises(BudgetExceededError):
            guard.check()
        del buf
        guard.check()  # back under the budget, already reported: nothing
    assert guard.crossed


def test_no_threads_leak_over_many_starts_and_stops():
    before = threading.active_count()
    for _ in range(25):
        with MemoryGuard(1000 * MB, interval_s=0.001) as guard:
            assert threading.active_count() == before + 1
            guard.check()
    assert threading.active_count() == before
    reused = MemoryGuard(BUDGET, interval_s=0.001)
    for _ in range(5):
        with pytest.raises(BudgetExceededError):
            with reused:
                buf = filled(2 * BUDGET)
                reused.check()
        del buf
        assert threading.active_count() == before
    # each start resets the record
    with reused:
        assert not reused.crossed
    assert reused.peak_bytes < BUDGET
    assert threading.active_count() == before


def test_a_running_guard_cannot_start_twice():
    with MemoryGuard(1000 * MB) as guard:
        with pytest.raises(RuntimeError, match="already running"):
            guard.start()


@pytest.mark.parametrize("guard", [MemoryGuard.disabled(), MemoryGuard(None)])
def test_a_disabled_guard_watches_nothing(guard: MemoryGuard):
    before = threading.active_count()
    assert not guard.enabled
    with guard:
        assert threading.active_count() == before
        guard.unit = "transformer.h.0"
        buf = filled(BIG)
        guard.check()
        del buf
    assert guard.peak_bytes == 0
    assert not guard.crossed
    assert threading.active_count() == before


def test_check_outside_the_with_block_does_nothing():
    guard = MemoryGuard(BUDGET, baseline_bytes=rss_bytes() - 100 * MB)
    guard.check()  # not started
    assert guard.peak_bytes == 0


def test_bad_settings_are_refused():
    with pytest.raises(MemoryPlanError, match="negative"):
        MemoryGuard(-1)
    with pytest.raises(MemoryPlanError, match="negative"):
        MemoryGuard(BUDGET, margin_bytes=-1)
    with pytest.raises(ValueError, match="interval_s"):
        MemoryGuard(BUDGET, interval_s=0)
