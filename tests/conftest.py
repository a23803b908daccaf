"""Shared test settings: no telemetry, a fixed thread count, Flower message helpers."""

from __future__ import annotations

import os

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Two test workers on two cores each start torch processes (measured children, Ray
# actors, ClientApps) with two OpenMP threads: libgomp's default spin-waiting then
# made a ViT step 19 s instead of 2.6 s in each of two concurrent children (the same
# peaks, 233 MiB). Passive waiting costs about 3% of a step alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault(
    "FLEETFIT_WARM_CHILDREN", "1"
)  # memory.warmstart: forked children
if "FLEETFIT_CACHE_DIR" not in os.environ:  # the machine cache of this test session
    import tempfile

    os.environ["FLEETFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fleetfit-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = [
    "tests.tiers",
    "pytester",
]  # tiers by what a test starts, and the reaper


@pytest.fixture
def tmp_out(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def no_start(monkeypatch):
    """Fail the test if ``fleetfit server`` starts anything (its supervisor, the
    SuperLink, nginx); SIGTERM keeps pytest's handler."""
    from fleetfit import cmd_federation, proxy, supervise

    def started(*a, **k):
        pytest.fail(f"started a process: {a[0] if a else k}")

    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    monkeypatch.setattr(cmd_federation, "_start", started)
    monkeypatch.setattr(supervise, "Supervisor", started)
    monkeypatch.setattr(proxy, "start_nginx", started)
