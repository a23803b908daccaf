"""Bad paths, ports, keys and run-config keys given to the ``fleetfit`` command: one
line naming the flag, the value and the fix, exit 2, no traceback, no process started
(issue 14, item 6). In process, with Flower's processes replaced by failures."""

from __future__ import annotations

import os
import subprocess

import pytest

from fleetfit import cmd_federation
from fleetfit.cli import main
from tests.deployment.test_commands import make_tls


@pytest.fixture
def no_start(monkeypatch):
    """Fail the test if a SuperLink, SuperNode or other Flower process starts."""

    def started(*a, **k):
        pytest.fail(f"started a process: {a[0] if a else k}")

    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    monkeypatch.setattr(cmd_federation, "_start", started)
    monkeypatch.setattr(subprocess, "Popen", started)
    monkeypatch.setattr(subprocess, "run", started)


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run ``fleetfit argv``; it exits 2 with one error line holding ``needles``."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: an argument type refused the value
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    for needle in needles:
        assert needle in line, line
    return line


def server(tmp_path, *args: str) -> list[str]:
    return ["server", "--out", str(tmp_path / "run"), *args]


def client(*args: str) -> list[str]:
    head = ["client", "--superlink", "127.0.0.1:9"]
    return [*head, "--partition-id", "0", "--num-partitions", "1", *args]


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_server_port_out_of_range(tmp_path, capsys, no_start, port):
    refused(capsys, server(tmp_path, "--port", port), "--port", port)


def tls_args(tmp_path, **override: str) -> list[str]:
    tls = make_tls(tmp_path)
    files = {"certfile": tls["cert"], "keyfile": tls["key"], "ca-certfile": tls["ca"]}
    files.update(override)
    return [x for k, v in files.items() for x in (f"--ssl-{k}", str(v))]


def test_server_ssl_keyfile_not_a_key(tmp_path, capsys, no_start):
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    args = server(tmp_path, *tls_args(tmp_path, keyfile=str(bad)))
    refused(capsys, args, "--ssl-keyfile", str(bad), "private key")


def test_server_ssl_keyfile_of_another_certificate(tmp_path, capsys, no_start):
    (tmp_path / "other").mkdir()
    other = make_tls(tmp_path / "other")["key"]
    args = server(tmp_path, *tls_args(tmp_path, keyfile=str(other)))
    refused(capsys, args, "--ssl-keyfile", str(other), "--ssl-certfile")


def test_server_ssl_keyfile_a_folder(tmp_path, capsys, no_start):
    args = server(tmp_path, *tls_args(tmp_path, keyfile=str(tmp_path)))
    refused(capsys, args, "--ssl-keyfile", str(tmp_path), "is a folder")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_server_ssl_keyfile_unreadable(tmp_path, capsys, no_start):
    key = tmp_path / "locked.key"
    key.write_text("x")
    key.chmod(0)
    args = server(tmp_path, *tls_args(tmp_path, keyfile=str(key)))
    refused(capsys, args, "--ssl-keyfile", str(key), "cannot be read", "permissions")


def test_server_ssl_ca_not_a_certificate(tmp_path, capsys, no_start):
    empty = tmp_path / "ca.pem"
    empty.write_text("")
    args = server(tmp_path, *tls_args(tmp_path, **{"ca-certfile": str(empty)}))
    refused(capsys, args, "--ssl-ca-certfile", str(empty), "PEM certificate")


def test_server_register_missing(tmp_path, capsys, no_start):
    args = server(tmp_path, *tls_args(tmp_path), "--enable-supernode-auth")
    missing = str(tmp_path / "node0.pub")
    refused(capsys, [*args, "--register", missing], "--register", missing, "exist")


def test_server_register_not_a_key(tmp_path, capsys, no_start):
    bad = tmp_path / "node0.pub"
    bad.write_text("ssh-rsa AAAA nonsense\n")
    args = server(tmp_path, *tls_args(tmp_path), "--enable-supernode-auth")
    refused(
        capsys, [*args, "--register", str(bad)], "--register", str(bad), "ssh-keygen"
    )


def test_server_run_config_key_is_named(tmp_path, capsys, no_start):
    line = refused(capsys, server(tmp_path, "--run-config", "bogus-key=1"), "bogus-key")
    assert "min-replies" in line and "num-server-rounds" in line, line  # valid keys
    assert not (tmp_path / "run").exists()


def test_a_key_the_app_does_not_declare_is_named(
    tmp_path, capsys, no_start, monkeypatch
):
    """Every ServerConfig key is declared in pyproject.toml (tests/test_cli.py); a
    user's edited app that drops one is refused before anything starts, not with
    Flower's bare "Invalid run configuration" after the SuperLink started."""
    from fleetfit import cmd_federation

    declared = cmd_federation.app_run_config_keys()
    monkeypatch.setattr(
        cmd_federation,
        "app_run_config_keys",
        lambda: [k for k in declared if k != "eval-windows"],
    )
    args = server(tmp_path, "--run-config", "eval-windows=2")
    line = refused(capsys, args, "eval-windows")
    assert "does not declare" in line, line
    assert not (tmp_path / "run").exists()


def test_server_out_cannot_be_made(tmp_path, capsys, no_start):
    refused(capsys, ["server", "--out", "/proc/x"], "--out", "/proc/x", "give a folder")


def test_client_auth_private_key_missing(tmp_path, capsys, no_start):
    missing = str(tmp_path / "node0")
    refused(
        capsys, client("--auth-private-key", missing), "--auth-private-key", missing
    )


def test_client_auth_private_key_not_a_key(tmp_path, capsys, no_start):
    bad = tmp_path / "node0"
    bad.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnope\n")
    args = client("--auth-private-key", str(bad))
    refused(capsys, args, "--auth-private-key", str(bad), "ssh-keygen")


def test_client_offload_dir_cannot_hold_files(capsys, no_start):
    args = client("--offload-dir", "/proc/x")
    refused(capsys, args, "--offload-dir", "/proc/x", "give a folder")


def test_client_root_certificates_not_pem(tmp_path, capsys, no_start):
    bad = tmp_path / "ca.pem"
    bad.write_text("nope")
    args = client("--root-certificates", str(bad))
    refused(capsys, args, "--root-certificates", str(bad))


def test_client_tiny_memory_budget_warns(capsys, monkeypatch, no_start):
    class Node:  # the SuperNode, ended at once
        def wait(self, timeout: float | None = None) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: Node())
    assert main(client("--memory-budget", "1")) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "--memory-budget" in x]
    assert "--memory-budget 1 (1 B)" in line and "runtime reserve 100.00 MiB" in line
    assert "Traceback" not in err


def test_memory_run_save_is_a_folder(tmp_path, capsys):
    args = ["memory", "run", "--workload", "digits-cnn", "--plain", "--steps", "1"]
    line = refused(capsys, [*args, "--save", str(tmp_path)], "--save", str(tmp_path))
    assert "is a folder" in line and "model.safetensors" in line


def test_memory_offload_dir_cannot_be_made(capsys):
    args = ["memory", "profile", "--workload", "digits-cnn", "--offload-dir", "/proc/x"]
    refused(capsys, args, "--offload-dir", "/proc/x", "give a folder")


def test_export_out_not_writable(tmp_path, capsys):
    args = ["export", "--checkpoint", str(tmp_path / "m.safetensors")]
    refused(capsys, [*args, "--out", "/proc/x.onnx"], "--out", "/proc/x.onnx")


@pytest.mark.parametrize("device", ["tpu", "cuda"])
def test_partition_run_device_refused(capsys, no_start, device):
    """An unknown device, and cuda where this torch has no GPU (the CPU build here):
    one line, before any planning or process."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cluster = "partition/clusters/unequal-4.toml"
    argv = ["partition", "run", "--cluster", cluster, "--device", device]
    refused(capsys, argv, "--device", device)
