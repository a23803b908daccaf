"""``fleetfit simulate`` stops what it starts: Ray is gone after Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetfit.cli import _descendants

pytestmark = pytest.mark.simulation


def ray_pids() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        if stat.split()[2] == "Z":  # zombies hold no resources
            continue
        if (
            b"raylet" in cmd
            or b"gcs_server" in cmd
            or b"ray::" in cmd
            or b"ray/_private" in cmd
        ):
            pids.add(int(proc.name))
    return pids


def test_ctrl_c_stops_ray(tmp_path):
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetfit.cli",
            "simulate",
            "--clients",
            "4",
            "--rounds",
            "50",
            "--local-steps",
            "50",
            "--out",
            str(tmp_path / "run"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "run" / "summary.json").exists():  # round 1 done: Ray up
            assert p.poll() is None, p.stdout.read().decode() if p.stdout else ""
            assert time.monotonic() < deadline, "no round finished in 300 s"
            time.sleep(0.5)
        # Ray processes this command started (an in-process Ray of an earlier test in
        # the same pytest run may start workers of its own meanwhile: not ours to judge).
        started = ray_pids() & _descendants(p.pid)
        assert started, "Ray processes should be running mid-run"
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    deadline = time.monotonic() + 30
    while started & ray_pids() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not started & ray_pids(), f"left running: {started & ray_pids()}"
    assert p.returncode != 0
