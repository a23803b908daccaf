"""A real deployment on loopback: a SuperLink, two SuperNodes and ``flwr run .``.

Every process this test starts is stopped at the end, also when it fails.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from memory.sizes import parse_bytes
from server.persist import load_model
from workloads import get_workload

pytestmark = pytest.mark.deployment

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Child processes in their own process groups, reaped at the end."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []

    def start(
        self, name: str, args: list[str], env: dict[str, str]
    ) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115
        p = subprocess.Popen(
            args,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_healthy(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"SuperLink on port {port} not healthy after {timeout_s} s")


def flwr_run_loopback(
    tmp_path: Path, run_config: str, node_configs: Sequence[str], timeout_s: float = 420
) -> subprocess.CompletedProcess[str]:
    """A SuperLink and one SuperNode per entry of ``node_configs`` (its
    ``--node-config``) on loopback, then ``flwr run . loopback --stream`` with
    ``run_config`` to its end. Every process started is stopped before this returns;
    the run must succeed. Logs go to ``tmp_path``."""
    env = dict(
        os.environ,
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    port = free_port()
    procs = Processes(tmp_path)
    try:
        procs.start(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database",
                str(tmp_path / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
            dict(env, FLWR_HOME=str(tmp_path / "link")),
        )
        for i, node_config in enumerate(node_configs):
            procs.start(
                f"supernode{i}",
                [
                    str(BIN / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    node_config,
                ],
                dict(env, FLWR_HOME=str(tmp_path / f"node{i}")),
            )
        wait_healthy(port)
        home = tmp_path / "cli"
        home.mkdir()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        done = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                str(ROOT),
                "loopback",
                "--stream",
                "--run-config",
                run_config,
            ],
            env=dict(env, FLWR_HOME=str(home)),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        procs.stop()
    assert all(p.poll() is not None for p in procs.procs)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


HF = (
    "examples.transformers_gpt2:build"  # a transformers GPT-2 with each node's own data
)


@pytest.mark.parametrize("workload", ["digits-cnn", HF])
def test_superlink_two_supernodes_flwr_run(tmp_path, workload):
    if workload == HF:
        pytest.importorskip("transformers")
    # node 1 of the transformers run: too small for the whole model
    small = " memory-budget='113MiB' disk-budget='0'"
    nodes = [
        f"partition-id={i} num-partitions=2"
        + (f" allow-workloads='{HF}'" if workload == HF else "")
        + (small if i and workload == HF else "")
        for i in range(2)
    ]
    out = tmp_path / "run"
    steps = 20 if workload == "digits-cnn" else 4
    run_config = (
        f"num-server-rounds=2 local-steps={steps} min-nodes=2 out='{out}' "
        f"workload='{workload}'"
    )
    done = flwr_run_loopback(tmp_path, run_config, nodes)
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2], done.stdout
    assert all(r["num_clients"] == 2 for r in summary["rounds"])
    if workload == HF:  # random weights: perplexity ~256 on bytes
        kinds = {a["kind"] for r in summary["rounds"] for a in r["assignments"]}
        assert kinds == {"full", "part"}, kinds
        assert summary["rounds"][-1]["perplexity"] < 100, summary["rounds"]
    else:
        assert summary["rounds"][-1]["accuracy"] > 0.5
    assert (out / "model.safetensors").exists()


# gpt-tiny: embed, layers.0, layers.1, head; adapters on every layer's qkv and fc
ADAPTED = {f"layers.{i}.{m}.weight" for i in (0, 1) for m in ("qkv", "fc")}


def test_supernodes_train_adapters_inside_their_budgets(tmp_path):
    """``adapters = "all"`` deployed: both SuperNodes train LoRA adapters (rank 4) in
    a measured child, each peak inside the node's budget (one roomy, one near the
    smallest adapter budget); the server merges their factors into the plain model,
    so exactly the adapted weights move."""
    pytest.importorskip("peft")
    # the smallest adapter budget is 104.88 MiB (100 MiB of it the runtime reserve):
    # at 105 MiB the plan recomputes layers.0 in 4 microbatches
    budgets = ["300MiB", "105MiB"]
    nodes = [
        f"partition-id={i} num-partitions=2 memory-budget='{b}' disk-budget='0'"
        for i, b in enumerate(budgets)
    ]
    out = tmp_path / "run"
    run_config = (
        "num-server-rounds=1 local-steps=3 lr=0.01 min-nodes=2 workload='gpt-tiny' "
        "eval-windows=8 export-onnx='off' eval-only='off' adapters='all' "
        f"lora-rank=4 lora-alpha=8.0 lora-targets='qkv,fc' out='{out}'"
    )
    done = flwr_run_loopback(tmp_path, run_config, nodes)
    summary = json.loads((out / "summary.json").read_text())
    (r,) = summary["rounds"]
    assert r["round"] == 1 and r["num_clients"] == 2, done.stdout
    for a in r["assignments"]:
        assert a["status"] == "ok" and a["counted_examples"] > 0, a
        assert a["kind"] == "adapter" and a["lora_rank"] == 4, a
        assert a["adapter_start"] == 1, a  # layers.0: every layer adapted
        assert a["budget_bytes"] == parse_bytes(budgets[a["partition_id"]]), a
        assert a["peak_method"] == "child", a
        assert 0 < a["measured_peak_bytes"] <= a["budget_bytes"], a
    assert math.isfinite(r["loss"]) and math.isfinite(r["perplexity"]), r
    model, meta = load_model(out / "model.safetensors")
    assert meta["round"] == "1"
    init = get_workload("gpt-tiny").make_model(0).state_dict()  # round 0's model
    assert set(model) == set(init)  # a plain model: no adapter keys
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    changed = {k for k in init if not torch.equal(model[k], init[k])}
    assert changed == ADAPTED, changed


def test_flwr_run_local_simulation(tmp_path):
    """``flwr run .`` on Flower's managed local simulation SuperLink, then stop it."""
    http_port, control_port = free_port(), free_port()
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
    )
    env = dict(
        os.environ,
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_HOME=str(home),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port),
        FLWR_LOCAL_CONTROL_API_PORT=str(control_port),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    out = tmp_path / "run"
    try:
        done = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                str(ROOT),
                "local",
                "--stream",
                "--federation-config",
                "num-supernodes=3",
                "--run-config",
                f"num-server-rounds=2 local-steps=10 min-nodes=3 out='{out}'",
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=420,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert [r["num_clients"] for r in summary["rounds"]] == [3, 3], done.stdout
    finally:
        stop_local_superlink(str(home))
    assert not local_superlink_pids(str(home))


def local_superlink_pids(flwr_home: str) -> list[int]:
    """PIDs of superlink processes whose environment names this FLWR_HOME."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            envb = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"flower-superlink" in cmd and f"FLWR_HOME={flwr_home}".encode() in envb:
            pids.append(int(proc.name))
    return pids


def stop_local_superlink(flwr_home: str) -> None:
    for pid in local_superlink_pids(flwr_home):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    while local_superlink_pids(flwr_home) and time.monotonic() < deadline:
        time.sleep(0.3)
    for pid in local_superlink_pids(flwr_home):
        os.kill(pid, signal.SIGKILL)
