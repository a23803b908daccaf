"""Faults on a loopback deployment (real SuperLink and SuperNodes, through
``fleetfit server`` and ``fleetfit client``): a node that hangs past the round's
deadline, a node that returns garbage (NaN) and a node whose every train reply
carries an extra 64 MiB array (a device running modified code) take part in every
round.

What must hold afterwards: every round completes, in order, with no gap or duplicate;
the healthy node's update is the only one accepted each round (a late reply never
counts in a later round); the hanging node is recorded as ``no reply``, the garbage
as ``malformed`` (its loss is NaN) or ``rejected`` (its arrays are), and the
oversize reply as ``malformed`` for its size, over ``max-reply-bytes`` and not
decoded (before that limit, its arrays were decoded and then ``rejected`` for the
extra key); the saved global model is finite, loadable, equal to the resume state's
model, and trained. The faulty nodes run ``tests/reliability/faulty.py``, which the
SuperNodes must allow (``--allow-workloads``). With ``-s`` the test prints the peak
RSS of the SuperLink and the ServerApp (docs/security.md quotes it).
"""

from __future__ import annotations

import json
import os
import re

import psutil
import pytest
import torch

from server.persist import load_model, load_state
from tests.deployment.test_commands import FLEETFIT, env, rounds_done, wait_for
from tests.deployment.test_loopback import Processes, free_port
from tests.reliability.faulty import OVERSIZE_BYTES, SPEC
from workloads import get_workload

pytestmark = pytest.mark.deployment

ROUNDS = 2  # the second round shows that a late reply never counts in a later one
# The healthy node must reply within the deadline also on a loaded machine: each
# message starts a fresh ClientApp process (about 3 s of imports when idle). At 20 s
# it gave "no reply" in round 1 while other test processes loaded the 2 cores.
ROUND_TIMEOUT_S = 45


class Peaks:
    """The peak RSS (``VmHWM``) of the server's Flower processes, read whenever
    ``wait_for`` polls anyway (once a second, no wait of its own): each figure is a
    process's last reading before it ended."""

    NAMES = ("flower-superlink", "flwr-serverapp")

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.bytes: dict[str, int] = {}

    def read(self) -> None:
        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                args = [os.path.basename(a) for a in p.cmdline()[:2]]
                name = next((n for n in self.NAMES if n in args), None)
                if name is None:
                    continue
                with open(f"/proc/{p.pid}/status") as f:
                    hwm = next(ln for ln in f if ln.startswith("VmHWM:"))
            except (psutil.Error, OSError, StopIteration):
                continue
            kib = int(hwm.split()[1])
            self.bytes[name] = max(self.bytes.get(name, 0), kib * 1024)

    def __str__(self) -> str:
        return ", ".join(f"{n} {b / 2**20:.0f} MiB" for n, b in self.bytes.items())


def client(port: int, pid: int, num: int) -> list[str]:
    return [
        *FLEETFIT,
        "client",
        "--superlink",
        f"127.0.0.1:{port}",
        "--memory-budget",
        "1GB",
        "--disk-budget",
        "0",
        "--partition-id",
        str(pid),
        "--num-partitions",
        str(num),
        "--allow-workloads",
        SPEC,
    ]


def test_hanging_garbage_and_oversize_nodes_do_not_stop_the_rounds(tmp_path):
    port = free_port()
    out = tmp_path / "run"
    procs = Processes(tmp_path)
    faults = {
        0: {},
        1: {"FLEETFIT_TEST_FAULT": "hang"},
        2: {"FLEETFIT_TEST_FAULT": "nan"},
        3: {"FLEETFIT_TEST_FAULT": "oversize"},
    }
    try:
        for pid, extra in faults.items():
            procs.start(
                f"client{pid}",
                client(port, pid, len(faults)),
                {**env(), **extra, "FLEETFIT_TEST_HANG_S": str(4 * ROUND_TIMEOUT_S)},
            )
        server = procs.start(
            "server",
            [
                *FLEETFIT,
                "server",
                "--port",
                str(port),
                "--workload",
                SPEC,
                "--rounds",
                str(ROUNDS),
                "--min-nodes",
                str(len(faults)),
                "--local-steps",
                "3",
                "--round-timeout",
                str(ROUND_TIMEOUT_S),
                "--out",
                str(out),
                "--run-config",
                "client-measure='inline' export-onnx='off' eval-only='off'",
            ],
            env(),
        )
        peaks = Peaks(server.pid)

        def finished() -> bool:
            peaks.read()
            return server.poll() is not None

        wait_for(
            finished,
            120 + ROUNDS * 3 * ROUND_TIMEOUT_S,
            f"the server did not finish; rounds done: {rounds_done(out)}",
        )
        assert server.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        procs.stop()
    print(f"peak RSS: {peaks}")  # pytest -s shows it
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == list(range(1, ROUNDS + 1))
    for r in summary["rounds"]:
        status = {a["partition_id"]: a["status"] for a in r["assignments"]}
        assert status[0] == "ok", r
        assert status[1] == "no reply", r
        # its loss is NaN too: refused when read (wire.reply), before its arrays
        # would be rejected for NaN (server.aggregate); either way it never counts
        assert status[2].startswith(("malformed", "rejected")), r
        assert "nan" in status[2].lower(), r
        # refused by its size as Flower handed it over, before any array of it was
        # decoded (the old reader decoded all, then "rejected: keys differ")
        size = re.fullmatch(
            r"malformed: the reply holds ([\d,]+) bytes, over max-reply-bytes "
            r"\(([\d,]+)\); its arrays were not decoded",
            status[3],
        )
        assert size, r
        held, limit = (int(g.replace(",", "")) for g in size.groups())
        assert held > OVERSIZE_BYTES > limit, r  # all of it reached the ServerApp
        assert r["num_clients"] == 1, r
    model, meta = load_model(out / "model.safetensors")
    assert meta["round"] == str(ROUNDS)
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    saved = load_state(out)
    assert saved is not None and saved[0] == ROUNDS
    assert all(torch.equal(model[k], saved[1][k]) for k in model)
    init = get_workload(SPEC).make_model(0).state_dict()  # the server's round-0 model
    assert set(model) == set(init)
    assert not torch.equal(model["1.weight"], init["1.weight"])  # node 0 trained it
    assert not list(out.glob("*.pt")) and not list(out.glob("*.pkl"))
