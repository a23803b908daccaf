"""One ``fleetfit server`` per address and per run folder, checked before anything
starts (issue 32, items 2 and 3), and the health check that accepts only the
SuperLink the command started. In process, no process started: the port's holder is
a socket this test opens, the earlier server a lock file naming this process. The
same with real servers and real signals: ``test_commands.py::
test_one_server_per_port_and_nothing_outlives_it``."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from fleetfit import cmd_federation, ports, proxy, supervise
from fleetfit.cli import main
from tests.deployment.test_commands import make_tls

NO_SUCH_PID = 4_194_305  # above Linux's largest pid_max: no process has it


@pytest.fixture
def listening():
    """A socket of this process listening on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def refused(capsys, tmp_path: Path, args: list[str]) -> str:
    out = tmp_path / "run"
    code = main(["server", "--workload", "digits-mlp", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("fleetfit server: error:")]
    assert "Traceback" not in err
    assert not (out / "superlink.log").exists()
    return line


def test_a_busy_port_names_its_holder(listening):
    me = os.getpid()
    held = ports.holder("127.0.0.1", listening)
    assert held is not None and held.startswith(f"pid {me} ("), held
    assert ports.in_use("127.0.0.1", listening)
    # every local address takes the port from a server that binds a wildcard
    assert ports.in_use("0.0.0.0", listening)
    assert ports.not_owned("127.0.0.1", listening, [me]) is None
    problem = ports.not_owned("127.0.0.1", listening, [NO_SUCH_PID])
    assert problem is not None and f"pid {me} (" in problem, problem
    nearby = ports.free_port_near("127.0.0.1", listening)
    assert nearby != listening and ports.holder("127.0.0.1", nearby) is None
    assert ports.not_owned("127.0.0.1", nearby, [me]) == "nothing listens there"


def test_describe_names_the_program_and_its_arguments():
    me = psutil.Process()
    said = ports.describe(me.pid)
    assert said.startswith(f"pid {me.pid} (") and len(said) < 200, said
    # the program: the first argument after the interpreter's options (pytest, or an
    # xdist worker's "-c" code)
    program = next((w for w in me.cmdline()[1:] if not w.startswith("-")), me.name())
    assert os.path.basename(program)[:20] in said, said
    assert ports.describe(NO_SUCH_PID) == f"pid {NO_SUCH_PID}"
    assert "another user" in ports.describe(None)


def test_server_on_a_busy_port_is_refused_before_anything_starts(
    tmp_path, capsys, no_start, listening
):
    out = tmp_path / "run"
    line = refused(capsys, tmp_path, ["--port", str(listening), "--out", str(out)])
    assert f"--port {listening}: 127.0.0.1:{listening} is in use by pid " in line
    assert f"pid {os.getpid()} (" in line and "--port " in line.split("e.g.")[1]
    assert not out.exists()


def test_server_on_a_busy_public_port_is_refused(
    tmp_path, capsys, no_start, listening, monkeypatch
):
    monkeypatch.setattr(proxy, "find_nginx", lambda: "/usr/sbin/nginx")
    tls = make_tls(tmp_path)
    args = ["--port", str(ports.free_port_near("127.0.0.1", listening))]
    args += ["--public", f"127.0.0.1:{listening}", "--out", str(tmp_path / "run")]
    args += ["--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"])]
    args += ["--ssl-ca-certfile", str(tls["ca"])]
    line = refused(capsys, tmp_path, args)
    assert f"--public 127.0.0.1:{listening}: port {listening} is in use by" in line
    assert f"pid {os.getpid()} (" in line and "--public 127.0.0.1:" in line


def lock_naming(folder: Path, pid: int, create_time: float, role: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / supervise.LOCK_NAME
    record = {"pid": pid, "role": role, "create_time": create_time, "program": "x"}
    lock.write_text(json.dumps({"work": "/nowhere", "processes": [record]}))
    return lock


@pytest.mark.parametrize("resume", [True, False])
def test_a_run_folder_whose_server_still_runs_is_refused(
    tmp_path, capsys, no_start, resume
):
    me = psutil.Process()
    out = tmp_path / "run"
    lock_naming(out, me.pid, me.create_time(), "command")
    extra = ["--resume"] if resume else []
    line = refused(capsys, tmp_path, ["--out", str(out), *extra])
    flag = "--resume --out" if resume else "--out"
    assert f"{flag} {out}: an earlier fleetfit server of this run folder" in line
    assert f"pid {me.pid} (fleetfit server)" in line, line
    assert f"kill {me.pid}" in line, line


def test_a_lock_of_processes_gone_is_no_obstacle(tmp_path):
    me = psutil.Process()
    reused = lock_naming(tmp_path / "a", me.pid, me.create_time() - 100, "supervisor")
    assert supervise.survivors(reused) == []  # the pid was reused since
    gone = lock_naming(tmp_path / "b", NO_SUCH_PID, 0.0, "process")
    assert supervise.survivors(gone) == []
    damaged = tmp_path / "c" / supervise.LOCK_NAME
    damaged.parent.mkdir()
    damaged.write_text("{not json")
    assert supervise.survivors(damaged) == []
    alive = lock_naming(tmp_path / "d", me.pid, me.create_time(), "process")
    ((pid, role, program),) = supervise.survivors(alive)
    assert (pid, role) == (me.pid, "process") and program


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_the_health_check_accepts_only_the_superlink_it_started():
    """Another SuperLink answering on the port (here: a health endpoint of this
    process) is not the one the command started: refused, naming it."""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = int(httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        ours = SimpleNamespace(pid=NO_SUCH_PID, returncode=None, poll=lambda: None)
        with pytest.raises(ConnectionError) as e:
            cmd_federation.wait_healthy("127.0.0.1", port, None, 10.0, ours)  # type: ignore[arg-type]
        said = str(e.value)
        assert f"could not serve 127.0.0.1:{port}" in said, said
        assert f"pid {os.getpid()} (" in said and "nothing was sent to it" in said
        # the SuperLink that does own the port passes
        mine = SimpleNamespace(pid=os.getpid(), returncode=None, poll=lambda: None)
        cmd_federation.wait_healthy("127.0.0.1", port, None, 10.0, mine)  # type: ignore[arg-type]
    finally:
        httpd.shutdown()
        httpd.server_close()
