"""The machine cache (memory.machine): figures measured once, the same plan from the
same command, also while other work loads the machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memory import machine

PROBE = textwrap.dedent(
    """
    import json
    from memory.probes import measure_flops_per_s
    print(json.dumps(measure_flops_per_s()))
    """
)


def _rate(env: dict[str, str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(out.stdout.strip().splitlines()[-1])


def test_cached_measures_once_and_keys_by_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLEETFIT_NO_CACHE", raising=False)
    calls = []
    assert machine.cached("x", lambda: calls.append(1) or 3.5) == 3.5
    assert machine.cached("x", lambda: calls.append(1) or 9.0) == 3.5
    assert calls == [1]
    data = json.loads((tmp_path / "machine.json").read_text())
    assert data == {machine.machine_key(): {"x": 3.5}}
    monkeypatch.setenv("FLEETFIT_NO_CACHE", "1")
    assert machine.cached("x", lambda: 9.0) == 9.0


def test_a_broken_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETFIT_CACHE_DIR", str(tmp_path))
    (tmp_path / "machine.json").write_text("{not json")
    assert machine.cached("y", lambda: 1.0) == 1.0  # measured, and the file rewritten
    assert json.loads((tmp_path / "machine.json").read_text())
    unwritable = tmp_path / "ro"
    unwritable.mkdir()
    os.chmod(unwritable, 0o500)
    monkeypatch.setenv("FLEETFIT_CACHE_DIR", str(unwritable / "sub"))
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    assert machine.cached("z", lambda: 2.0) == 2.0


@pytest.mark.heavy
def test_the_rate_is_the_same_under_load(tmp_path):
    """A fresh process reuses what the first measured, while two busy processes
    compete for the cores: the figures a plan is made from do not drift."""
    env = dict(os.environ, FLEETFIT_CACHE_DIR=str(tmp_path))
    env.pop("FLEETFIT_NO_CACHE", None)
    first = _rate(env)
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    try:
        again = _rate(env)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert again == first


@pytest.mark.heavy
def test_the_same_command_gives_the_same_plan_under_load(tmp_path):
    """A transformers model planned per unit: unit times come from FLOPs at the
    cached rate, so the plan is the same with the machine loaded. (Built-in chain
    workloads still time their blocks with real tensors when affordable, and those
    times move with the load: a known gap.)"""
    pytest.importorskip("transformers")
    (tmp_path / "hfwl.py").write_text(
        "from tests.hf.models import build\n\n\n"
        "def build_gpt2():\n"
        "    model, (inputs, _) = build('gpt2')\n"
        "    return model, (inputs, None), None\n"
    )
    env = dict(os.environ, FLEETFIT_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd()])
    env.pop("FLEETFIT_NO_CACHE", None)
    cmd = [
        sys.executable,
        "-m",
        "fleetfit.cli",
        "memory",
        "plan",
        "--workload",
        "hfwl:build_gpt2",
        "--memory-budget",
        "200MB",  # above the smallest plan also where the runtime probe reads 75 MiB
        "--disk-budget",  # the default, half the free space, moves with other files
        "1GB",
        "--offload-dir",
        str(tmp_path),
        "--json",
    ]

    def plan() -> dict:
        out = subprocess.run(
            cmd, env=env, capture_output=True, text=True, check=True, timeout=300
        )
        return json.loads(out.stdout.strip().splitlines()[-1])["plan"]

    first = plan()
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    try:
        again = plan()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert again == first
