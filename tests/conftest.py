"""Shared test settings: no telemetry, a fixed thread count, Flower message helpers."""

from __future__ import annotations

import os

os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
if "FLEETFIT_CACHE_DIR" not in os.environ:  # the machine cache of this test session
    import tempfile

    os.environ["FLEETFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fleetfit-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tmp_out(tmp_path):
    return tmp_path / "run"
