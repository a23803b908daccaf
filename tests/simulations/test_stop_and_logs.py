"""``fleetfit simulate`` as a user of a base install (no extra) runs it: SIGTERM stops
it as Ctrl-C does, its stderr carries fleetfit's story, not its dependencies' debug
lines and warnings, and it trains."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetfit.cli import _descendants
from tests import base_install

pytestmark = pytest.mark.simulation

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--workload", "digits-mlp", "--clients", "2", "--no-progress"]
# A per-node line, sizes with units: "node 119... (budget 10.84 GiB) gets full"
NODE_LINE = re.compile(
    r"DEBUG server\.loop: round 1: node \d+ \(budget \d+\.\d\d [KMG]iB\)"
)


def fleetfit(args: list[str], stderr_path: Path) -> subprocess.Popen[bytes]:
    """``fleetfit`` as a base install runs it: what only an extra installs (peft,
    transformers, ...) cannot be imported (``tests/base_install.py``), in it and
    in what it starts (Ray's workers, the measuring children)."""
    log = stderr_path.with_name("blocker.log")
    env = base_install.env(dict(os.environ, FLWR_TELEMETRY_ENABLED="0"), log=log)
    env.pop("RAY_ADDRESS", None)
    with stderr_path.open("wb") as err:  # a file: a full pipe would stall the run
        return subprocess.Popen(
            [sys.executable, "-m", "fleetfit.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def test_sigterm_stops_a_simulation_and_what_it_started(tmp_path):
    out, err = tmp_path / "run", tmp_path / "stderr.txt"
    p = fleetfit(["-v", "simulate", *SMALL, "--rounds", "20", "--out", str(out)], err)
    try:
        deadline = time.monotonic() + 180
        while not (out / "summary.json").exists():  # round 1 done: Ray is up
            assert p.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no round finished in 180 s"
            time.sleep(0.2)
        started = _descendants(p.pid)
        assert started, "Ray's processes should be running mid-run"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        stop_s = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = err.read_text()
    assert not alive(started), f"left running: {alive(started)}"
    # 143, or 1 when Ray's core worker ends the process first (it was killed, too)
    assert p.returncode in (128 + signal.SIGTERM, 1), text[-2000:]
    assert stop_s < 30, f"took {stop_s:.1f} s to stop"
    assert "terminated: stopping what this command started" in text
    # -v: the per-node lines, sizes with units
    assert NODE_LINE.search(text), text[-3000:]


def test_simulate_without_v_prints_no_dependency_noise(tmp_path):
    out, err = tmp_path / "run", tmp_path / "stderr.txt"
    fleet = tmp_path / "fleet.toml"  # budgets: each device measured in a child
    fleet.write_text(
        'name = "two"\nclients = 2\nworkload = "digits-mlp"\nlocal-steps = 5\n'
        'split = "iid"\n[[classes]]\nname = "1GB"\nshare = 1.0\nmemory = "1GB"\n'
    )
    args = ["simulate", "--fleet", str(fleet), "--no-progress", "--rounds", "1"]
    p = fleetfit([*args, "--out", str(out)], err)
    try:
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = err.read_text()
    assert p.returncode == 0, text[-3000:]
    # a base install trains: every device measured in a child, with the extras
    # unimportable in Ray's workers and the children too (issue 32, item 1)
    summary = json.loads((out / "summary.json").read_text())
    for a in summary["rounds"][0]["assignments"]:
        assert (a["status"], a["peak_method"]) == ("ok", "child"), a
    started = base_install.reached(tmp_path / "blocker.log")
    assert any("default_worker.py" in c for c in started), started
    assert any("partition.measured:train_child" in c for c in started), started
    assert "INFO server.loop: round 1: accuracy" in text  # the round's summary stays
    assert "DEBUG" not in text, text  # Flower's debug lines, the per-node lines
    assert "deprecated" not in text.lower(), text  # Flower's run_simulation warning
    assert "FutureWarning" not in text, text  # Ray's tip about num_gpus=0
    assert not re.search(r"budget \d{6,}", text), text  # sizes carry units
