"""memory.measure: the child process measures what a target allocates."""

from __future__ import annotations

import functools

import pytest
import torch

from memory.errors import MeasurementError
from memory.measure import (
    child_env,
    measure_in_child,
    peak_rss_bytes,
    reset_peak,
    rss_bytes,
    target_name,
)

MB = 10**6


@pytest.fixture(scope="module")
def big():
    """One child allocating 200 MB, its target given as a function object."""
    import memhelpers

    return measure_in_child(memhelpers.allocate, {"num_bytes": 200 * MB})


@pytest.fixture(scope="module")
def small():
    """One child allocating 20 MB, its target and warm-up given as function objects
    (a static method: imported by its qualified name)."""
    import memhelpers

    return measure_in_child(
        memhelpers.Targets.allocate,
        {"num_bytes": 20 * MB},
        warmup=(memhelpers.sleep, {"seconds": 0}),
    )


@pytest.mark.child
def test_child_measures_an_allocation_above_its_baseline(big):
    m = big
    # torch alone is ~250 MB resident: the baseline must include it
    assert m.baseline_bytes > 100 * MB
    # the allocation plus a few MB of interpreter noise, never the baseline
    assert 200 * MB <= m.peak_bytes <= 212 * MB
    assert m.hwm_bytes == m.baseline_bytes + m.peak_bytes
    assert m.result == {"sum": pytest.approx(200 * MB / 4 / 4096, rel=1e-3)}
    assert m.wall_s > 0
    assert m.cuda_peak_bytes is None


@pytest.mark.child
def test_peak_scales_with_the_allocation(big, small):
    assert big.peak_bytes - small.peak_bytes == pytest.approx(180 * MB, rel=0.03)


@pytest.mark.child
def test_child_errors_come_back_with_their_traceback():
    with pytest.raises(MeasurementError) as e:
        measure_in_child("memhelpers:fail", {"message": "boom 17"})
    assert "ZeroDivisionError: boom 17" in str(e.value)
    assert "memhelpers.py" in str(e.value)


@pytest.mark.child
def test_missing_target_and_bad_kwargs():
    with pytest.raises(MeasurementError, match="no_such_module"):
        measure_in_child("no_such_module:f", {})
    with pytest.raises(ValueError, match="package.module:function"):
        measure_in_child("memhelpers.allocate", {})
    with pytest.raises(ValueError, match="JSON"):
        measure_in_child("memhelpers:allocate", {"num_bytes": object()})


@pytest.mark.child
def test_a_function_object_runs_as_the_target(big, small):
    """``big``'s child ran a function object; ``small``'s a static method (imported
    by its qualified name) and a warm-up given as function objects."""
    import memhelpers

    assert target_name(memhelpers.allocate) == "memhelpers:allocate"
    assert target_name(memhelpers.Targets.allocate) == "memhelpers:Targets.allocate"
    assert big.result == {"sum": pytest.approx(200 * MB / 4 / 4096, rel=1e-3)}
    assert small.result == {"sum": pytest.approx(20 * MB / 4 / 4096, rel=1e-3)}


def _nested_target() -> None:
    def inner() -> dict:
        return {}

    return inner  # type: ignore[return-value]


class _Holder:
    def run(self) -> dict:
        return {}


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (lambda: {}, "is a lambda"),
        (_nested_target(), "is a nested function"),
        (functools.partial(abs, 1), "must be a function"),
        (_Holder().run, "bound method"),
    ],
)
def test_a_target_the_child_cannot_import_is_refused_in_one_line(target, needle):
    with pytest.raises(ValueError, match=needle) as e:
        measure_in_child(target, {})
    assert "\n" not in str(e.value)
    assert "module level" in str(e.value)


@pytest.mark.child
def test_timeout_kills_the_child():
    with pytest.raises(MeasurementError, match="timeout"):
        measure_in_child("memhelpers:sleep", {"seconds": 30}, timeout_s=3)


@pytest.mark.child
def test_env_reaches_the_child_and_the_allocator_settings_are_fixed():
    keys = ["MALLOC_MMAP_THRESHOLD_", "MKL_DISABLE_FAST_MM", "T_X"]
    # the allocators' settings unless the caller's env sets them; the caller's env
    # overrides them
    assert {k: child_env().get(k) for k in keys[:2]} == {
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MKL_DISABLE_FAST_MM": "1",
    }
    assert child_env({"MKL_DISABLE_FAST_MM": "0"})["MKL_DISABLE_FAST_MM"] == "0"
    # all of it reaches the child: a fixed setting, an overridden one, a new one
    m = measure_in_child(
        "memhelpers:getenv",
        {"keys": keys},
        env={"T_X": "x", "MKL_DISABLE_FAST_MM": "0"},
    )
    assert m.result == {
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "MKL_DISABLE_FAST_MM": "0",
        "T_X": "x",
    }
    # a target must answer a dict
    with pytest.raises(MeasurementError, match="returned str, not a dict"):
        measure_in_child("os:getenv", {"key": "HOME"})


@pytest.mark.child
def test_reset_peak_isolates_one_step():
    m = measure_in_child(
        "memhelpers:step_peak", {"first_bytes": 300 * MB, "second_bytes": 50 * MB}
    )
    assert 48 * MB <= m.result["step_peak"] <= 56 * MB  # the second step alone
    # the reset also hides the first, larger peak from the whole-run figure: that is
    # why reset_peak is for studying a step, never for checking a budget
    assert m.peak_bytes < 300 * MB


def test_in_process_helpers():
    assert 0 < rss_bytes() <= peak_rss_bytes()
    reset_peak()
    assert peak_rss_bytes() <= rss_bytes() + 4 * MB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak():
    m = measure_in_child("memhelpers:cuda_allocate", {"num_bytes": 64 * MB})
    assert m.cuda_peak_bytes is not None
    assert m.cuda_peak_bytes >= 64 * MB
