"""A Ray address with no cluster behind it fails at once, naming it and the fix.

Given such an address, ``ray.init`` retried for minutes and the simulation went on
with rounds of 0/0 clients; these start no Ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simulations.run import check_ray_address

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.child
def test_bad_ray_address_fails_in_seconds_with_one_line(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), FLWR_TELEMETRY_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetfit.cli",
            "simulate",
            *("--workload", "digits-mlp", "--clients", "2", "--rounds", "1"),
            *("--ray-address", address, "--out", str(tmp_path / "run")),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed_s = time.monotonic() - t0
    assert out.returncode != 0
    assert elapsed_s < 30, f"took {elapsed_s:.1f} s to fail"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert address in lines[0] and "ray start --head" in lines[0], lines[0]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.child
def test_ray_address_from_the_environment_is_probed_too(monkeypatch):
    address = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    for given in ("", "auto"):  # ray.init reads RAY_ADDRESS for both
        with pytest.raises(ConnectionError, match="connection refused") as e:
            check_ray_address(given)
        assert address in str(e.value)
    with pytest.raises(ConnectionError, match=r"\(from RAY_ADDRESS\)"):
        check_ray_address("")


@pytest.mark.parametrize("address", ["nonsense", "10.0.0.5", "host:port", "h:70000"])
def test_malformed_ray_address_names_the_form(address, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        check_ray_address(address)


def test_no_ray_address_means_a_local_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    check_ray_address("")  # no probe, no error
    check_ray_address("local")
