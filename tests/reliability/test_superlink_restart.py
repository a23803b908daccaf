"""The SuperLink restarted with its database mid-run (loopback, Flower's own commands:
``fleetfit server`` starts its SuperLink as a child, with a fresh database each time).

What Flower 1.42 does: killing the SuperLink (SIGKILL) takes its SuperExec with it; the
ServerApp process survives, orphaned. The SuperLink restarted on the same database and
port marks the interrupted run finished (``Finished task ... of run ...``), the orphaned
ServerApp's next call ends it, and SuperNodes asking for that run's messages are told
``Run is finished``. The run cannot continue; it is not resumed by Flower.

What holds, and is checked here: the interrupted run stops after the round it was in
(no further round is written, no half-written round), its run folder is intact
(summary rounds 1..k, the model loads, is finite and equals the resume state), Flower
lists the run as finished; and a new run with ``resume=true`` against the restarted
SuperLink, with the *same* SuperNodes (not restarted: the database kept their ids),
completes the remaining rounds: summary rounds 1..N without gap or duplicate, every
round's updates from both nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from server.persist import load_model, load_state
from tests.deployment.test_commands import FLEETFIT, env, rounds_done, wait_for
from tests.deployment.test_loopback import BIN, ROOT, Processes, free_port, wait_healthy

pytestmark = pytest.mark.deployment

ROUNDS = 3


def test_superlink_restarted_with_its_database_mid_run(tmp_path):
    t0 = time.monotonic()
    e = dict(
        env(),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    port = free_port()
    out = tmp_path / "run"
    db = tmp_path / "state.db"
    home = tmp_path / "cli"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    cli = dict(e, FLWR_HOME=str(home))
    procs = Processes(tmp_path)

    def superlink(name):
        return procs.start(
            name,
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database",
                str(db),
                "--disable-runtime-dependency-installation",
            ],
            dict(e, FLWR_HOME=str(tmp_path / "link")),
        )

    def flwr_run(name, resume):
        rc = (
            f"num-server-rounds={ROUNDS} local-steps=10 min-nodes=2 "
            f"round-timeout=60.0 client-measure='inline' export-onnx='off' "
            f"eval-only='off' resume={'true' if resume else 'false'} out='{out}'"
        )
        return procs.start(
            name,
            [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--stream"]
            + ["--run-config", rc],
            cli,
        )

    def runs():
        done = subprocess.run(
            [str(BIN / "flwr"), "ls", "loopback", "--format", "json"],
            env=cli,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        text = done.stdout
        return json.loads(text[text.index("{") :])["runs"]

    try:
        link = superlink("superlink")
        nodes = [
            procs.start(
                f"client{i}",
                [*FLEETFIT, "client", "--superlink", f"127.0.0.1:{port}"]
                + ["--memory-budget", "1GB", "--disk-budget", "0"]
                + ["--partition-id", str(i), "--num-partitions", "2"],
                e,
            )
            for i in range(2)
        ]
        wait_healthy(port)
        first = flwr_run("flwr-run", resume=False)
        wait_for(lambda: rounds_done(out) >= 1, 240, "round 1 never completed")
        os.kill(link.pid, signal.SIGKILL)  # the SuperLink process, mid round 2
        link.wait(timeout=30)
        killed_after = rounds_done(out)
        t_kill = time.monotonic() - t0
        time.sleep(3)
        superlink("superlink-restarted")
        wait_healthy(port)
        first.wait(timeout=60)  # flwr run's stream ends with the connection
        assert first.returncode != 0
        # the interrupted run is over: listed as finished, and no round is added
        wait_for(
            lambda: all(r["status"].startswith("finished") for r in runs()),
            60,
            "the interrupted run is not listed as finished",
        )
        time.sleep(20)  # a surviving ServerApp would have written round 2 by now
        assert rounds_done(out) == killed_after
        model, meta = load_model(out / "model.safetensors")
        saved = load_state(out)
        assert saved is not None and saved[0] == killed_after == int(meta["round"])
        assert all(torch.equal(model[k], saved[1][k]) for k in model)
        assert all(bool(torch.isfinite(v).all()) for v in model.values())
        # resume against the restarted SuperLink; the SuperNodes were never restarted
        assert all(n.poll() is None for n in nodes)
        second = flwr_run("flwr-run-resumed", resume=True)
        # ~60 s on an idle 2-core machine; 300 s ran out once at load average 50
        assert second.wait(timeout=600) == 0, (
            tmp_path / "flwr-run-resumed.log"
        ).read_text()[-3000:]
        listed = runs()
    finally:
        procs.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == list(range(1, ROUNDS + 1))
    assert all(r["num_clients"] == 2 for r in summary["rounds"]), summary["rounds"]
    model, meta = load_model(out / "model.safetensors")
    assert meta["round"] == str(ROUNDS)
    assert all(bool(torch.isfinite(v).all()) for v in model.values())
    assert summary["rounds"][-1]["accuracy"] > summary["rounds"][0]["accuracy"]
    statuses = sorted(r["status"] for r in listed)
    print(
        f"SuperLink killed after round {killed_after} at {t_kill:.0f} s; run statuses "
        f"{statuses}; resumed to round {ROUNDS}; total {time.monotonic() - t0:.0f} s"
    )
    assert len(listed) == 2
