"""The runtime's first-step cost measured per workload (``memory.overhead``)."""

from __future__ import annotations

import pytest

from memory import overhead

pytest.importorskip("transformers")

FACTORY = "tests.hf.models:build_batch"


@pytest.mark.child
def test_workload_runtime_is_measured_once_and_kept(tmp_path, monkeypatch):
    """The probe child trains the workload plainly and under a plan that uses every
    mechanism; it reports the library code that paged in (at least the matmul and
    attention kernels: over a MiB), and the figure is kept in the machine cache."""
    monkeypatch.setenv("FLEETFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLEETFIT_NO_CACHE", raising=False)
    monkeypatch.delenv("FLEETFIT_RUNTIME_BYTES", raising=False)
    kwargs = {"name": "gpt2", "size": "test"}
    first = overhead.workload_runtime_bytes(FACTORY, kwargs, offload_dir=str(tmp_path))
    assert isinstance(first, int) and first > 2**20, first

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(overhead, "_workload_runtime", fail)
    assert overhead.workload_runtime_bytes(FACTORY, dict(kwargs)) == first
    with pytest.raises(AssertionError, match="measured again"):  # another workload
        overhead.workload_runtime_bytes(FACTORY, {"name": "bert", "size": "test"})


def test_runtime_override_skips_every_probe_and_is_not_kept(monkeypatch):
    """The override is read at every call: once unset, the measured figure is back
    (it was kept in the process once, and every later plan of the test session used
    12 MiB as torch's runtime: three budget-grid runs crossed their budgets)."""
    monkeypatch.setenv("FLEETFIT_RUNTIME_BYTES", "12MiB")
    monkeypatch.setattr(overhead, "_workload_runtime", None)  # a probe would fail
    monkeypatch.setattr(overhead, "_generic_runtime", None)
    assert overhead.workload_runtime_bytes(FACTORY, {"name": "gpt2"}) == 12 * 2**20
    assert overhead.runtime_overhead_bytes() == 12 * 2**20
    monkeypatch.delenv("FLEETFIT_RUNTIME_BYTES")
    monkeypatch.setattr(overhead, "_generic_runtime", lambda: 34 * 2**20)
    assert overhead.runtime_overhead_bytes() == 34 * 2**20
