"""``fleetfit server`` checks its run config (keys, values, the workload) and where it
listens (loopback, or ``--public`` with TLS and nginx) before it starts the SuperLink:
bad input is one line and exit 2, no process, no run folder."""

from __future__ import annotations

import socket
import subprocess

import pytest

from fleetfit import proxy
from fleetfit.cli import main
from tests.deployment.test_commands import FLEETFIT, env, make_tls
from tests.deployment.test_loopback import ROOT, free_port


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--workload", "nosuch"], ["unknown workload 'nosuch'", "digits-cnn"]),
        (["--workload", "nomodule_xyz:build"], ["nomodule_xyz"]),
        (["--run-config", "lr=-1"], ["lr=-1.0", "positive"]),
        (["--run-config", "colour=1"], ["unknown run-config key(s) colour"]),
        (["--run-config", "eval-windows=0"], ["eval-windows=0"]),
        (["--run-config", "lr=="], ["run config", "key=value", "--run-config"]),
        (
            ["--workload", "gpt-tiny", "--run-config", "seq-len=100000"],
            ["sequence length"],
        ),
    ],
)
def test_bad_run_config_is_refused_before_anything_starts(
    tmp_path, capsys, no_start, extra, needles
):
    out = tmp_path / "run"
    code = main(["server", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    line = next(x for x in err.splitlines() if x.startswith("fleetfit server: error:"))
    for needle in needles:
        assert needle in line, line
    assert "Traceback" not in err
    assert not out.exists()


def refused(tmp_path, capsys, args: list[str]) -> str:
    out = tmp_path / "run"
    code = main(["server", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("fleetfit server: error:")]
    assert "Traceback" not in err
    assert not out.exists()
    return line


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.7", "::"])
def test_superlink_off_loopback_is_refused(tmp_path, capsys, no_start, host):
    line = refused(tmp_path, capsys, ["--host", host])
    assert f"--host {host}" in line and "Control API" in line, line
    assert "--public" in line, line


def test_public_needs_tls(tmp_path, capsys, no_start):
    line = refused(tmp_path, capsys, ["--public", "0.0.0.0:9092"])
    assert "--public needs TLS" in line and "--ssl-certfile" in line, line


def ssl_args(tmp_path) -> list[str]:
    tls = make_tls(tmp_path)
    return [
        "--ssl-certfile",
        str(tls["cert"]),
        "--ssl-keyfile",
        str(tls["key"]),
        "--ssl-ca-certfile",
        str(tls["ca"]),
    ]


def test_public_without_nginx_names_the_package(
    tmp_path, capsys, no_start, monkeypatch
):
    monkeypatch.delenv("FLEETFIT_NGINX", raising=False)
    monkeypatch.setattr(proxy.shutil, "which", lambda *a, **k: None)
    line = refused(tmp_path, capsys, ["--public", "0.0.0.0:9092", *ssl_args(tmp_path)])
    assert "nginx is not installed" in line, line
    assert f"apt-get install {proxy.NGINX_PACKAGE}" in line, line


@pytest.mark.parametrize(
    "public, needle",
    [
        ("0.0.0.0:9091", "takes the SuperLink's own port 9091"),
        ("9092", "is not HOST:PORT"),
        ("0.0.0.0:99999", "is not HOST:PORT"),
    ],
)
def test_public_address_is_checked(tmp_path, capsys, no_start, public, needle):
    args = ["--port", "9091", "--public", public, *ssl_args(tmp_path)]
    line = refused(tmp_path, capsys, args)
    assert needle in line, line


@pytest.mark.child
def test_unknown_workload_is_one_line_and_no_superlink_starts(tmp_path):
    """The real command, in its own process: one line on stderr, exit 2, nothing
    listening on the SuperLink's port, no run folder."""
    port = free_port()
    out = tmp_path / "run"
    done = subprocess.run(
        [*FLEETFIT, "server", "--workload", "nosuch", "--port", str(port)]
        + ["--out", str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("fleetfit server: error: unknown workload 'nosuch'"), line
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not out.exists()
