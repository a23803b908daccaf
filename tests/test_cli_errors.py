"""Bad paths, ports, keys and run-config keys given to the ``fleetfit`` command: one
line naming the flag, the value and the fix, exit 2, no traceback, no process started
(issue 14, item 6). In process, with Flower's processes replaced by failures."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fleetfit import cmd_federation
from fleetfit.cli import main
from tests.deployment.test_commands import make_tls


@pytest.fixture
def no_start(no_start, monkeypatch):
    """Also fail the test if any other process starts (a SuperNode, ``flwr``)."""

    def started(*a, **k):
        pytest.fail(f"started a process: {a[0] if a else k}")

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


# ------------------------------------------------ issue 32, item 6: bad input, one line
@pytest.fixture
def no_simulation(monkeypatch):
    """Fail the test if a simulation (Ray) starts."""
    import simulations.compare
    import simulations.run

    def started(*a, **k):
        pytest.fail("started a simulation")

    for module, name in (
        (simulations.run, "simulate"),
        (simulations.compare, "run_strategy"),
        (simulations.compare, "compare"),
    ):
        monkeypatch.setattr(module, name, started)


FLEET = """name = "tiny"
clients = 2
workload = "{workload}"
split = "iid"
local-steps = 5

[[classes]]
name = "all"
share = 1
memory = "1GB"
speed = 1
availability = 1
"""


def not_a_workload_argv(tmp_path, command: str, spec: str) -> list[str]:
    """``command`` given the workload ``spec`` the way that command takes one."""
    if command == "memory plan":
        return ["memory", "plan", "--workload", spec]
    if command == "export":
        from server.persist import save_model
        from workloads import get_workload

        ckpt = tmp_path / "model.safetensors"
        state = get_workload("digits-mlp").make_model(0).state_dict()
        save_model(ckpt, state, {"workload": spec})
        return ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.onnx")]
    if command == "simulate --fleet":
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(FLEET.format(workload=spec))
        return ["simulate", "--fleet", str(fleet), "--out", str(tmp_path / "sim")]
    assert command == "server --run-config"
    return server(tmp_path, "--run-config", f'workload="{spec}"')


@pytest.mark.usefixtures("no_start", "no_simulation")
@pytest.mark.parametrize(
    "command", ["memory plan", "export", "simulate --fleet", "server --run-config"]
)
def test_a_function_that_is_not_a_workload_is_refused(tmp_path, capsys, command):
    """``os:system`` was called with no argument (a TypeError traceback); it is
    refused before it is called, in every command that takes a workload."""
    argv = not_a_workload_argv(tmp_path, command, "os:system")
    line = refused(capsys, argv, "'os:system'", "not a workload function")
    assert "standard library" in line and "mypkg.jobs:build" in line, line
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.usefixtures("no_simulation")
@pytest.mark.parametrize("fleet", [False, True])
def test_simulate_out_a_file(tmp_path, capsys, fleet):
    """A file as ``--out`` was a FileExistsError traceback after Ray started."""
    file = tmp_path / "notes.txt"
    file.write_text("keep me\n")
    head = ["simulate", "--fleet", "phones"] if fleet else ["simulate", "--rounds", "1"]
    refused(capsys, [*head, "--out", str(file)], "--out", str(file), "give a folder")
    assert file.read_text() == "keep me\n"


def test_simulate_fleet_file_not_utf8(tmp_path, capsys, no_simulation):
    fleet = tmp_path / "latin1.toml"
    fleet.write_bytes(FLEET.format(workload="digits-cnn").encode() + b"# caf\xe9\n")
    line = refused(capsys, ["simulate", "--fleet", str(fleet)], str(fleet), "UTF-8")
    assert "\\xe9" in line, line


def started_node(monkeypatch) -> list[list[str]]:
    """Replace the SuperNode by one that ends at once; the commands it was given."""
    commands: list[list[str]] = []

    class Node:
        def wait(self, timeout: float | None = None) -> int:
            return 0

        def poll(self) -> int:
            return 0

    def popen(cmd, *a, **k):
        commands.append(cmd)
        return Node()

    monkeypatch.setattr(subprocess, "Popen", popen)
    return commands


def test_client_offload_dir_with_a_quote_reaches_the_node(tmp_path, monkeypatch):
    """A ``"`` in ``--offload-dir`` broke the ``--node-config`` string (Flower's
    parser knows no escapes): the SuperNode failed; now the node reads it back."""
    from flwr.common.config import parse_config_args

    folder = tmp_path / 'my "fast" disk'
    commands = started_node(monkeypatch)
    assert main(client("--offload-dir", str(folder))) == 0
    (cmd,) = commands
    node_config = cmd[cmd.index("--node-config") + 1]
    assert parse_config_args([node_config])["offload-dir"] == str(folder)


def test_client_offload_dir_with_both_quotes(tmp_path, capsys, no_start):
    folder = str(tmp_path / 'it\'s "fast"')
    refused(capsys, client("--offload-dir", folder), "--offload-dir", "quote")


def test_a_failed_export_leaves_no_onnx(tmp_path, capsys, monkeypatch):
    """A check that fails after the graph is written (here ONNX Runtime cannot run
    it, made so; the exporter itself is replaced by a stub writing the graph) failed
    the export but left the new ``.onnx`` over the earlier one; now the earlier one
    stays as it was and nothing else is left."""
    import server.export
    from server.export import ExportError
    from server.persist import save_model
    from workloads import get_workload

    def graph(model, workload, path, external_data):
        Path(path).write_bytes(b"a new graph")
        return Path(path), {}

    def fails(model, workload, path, **k):
        assert Path(path).read_bytes() == b"a new graph"
        raise ExportError(f"ONNX Runtime cannot run {Path(path).name}: made to fail")

    monkeypatch.setattr(server.export, "export_graph", graph)
    monkeypatch.setattr(server.export, "verify", fails)
    ckpt = tmp_path / "run" / "model.safetensors"
    state = get_workload("digits-mlp").make_model(0).state_dict()
    save_model(ckpt, state, {"workload": "digits-mlp"})
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    out.write_bytes(b"the export of yesterday")
    argv = ["export", "--checkpoint", str(ckpt), "--out", str(out), "--quantize"]
    refused(capsys, argv, "ONNX Runtime cannot run m.onnx")
    assert out.read_bytes() == b"the export of yesterday"
    assert [p.name for p in out.parent.iterdir()] == ["m.onnx"]


def test_simulate_that_trained_nothing_exits_1_naming_why(
    tmp_path, capsys, monkeypatch
):
    """A simulation in which no round accepted an update ends with exit 1 and the
    reason (it used to print the table and exit 0, as if the model had trained)."""
    import simulations.run

    summary = {
        "rounds": [
            {
                "round": 1,
                "num_clients": 0,
                "num_sampled": 2,
                "accuracy": 0.1,
                "loss": 2.3,
                "train_loss": None,
                "round_s": 1.0,
                "errors": [],
                "assignments": [{"status": "error: ModuleNotFoundError: peft"}],
            }
        ]
    }
    monkeypatch.setattr(simulations.run, "simulate", lambda settings: summary)
    argv = ["simulate", "--rounds", "1", "--clients", "2", "--out", str(tmp_path / "r")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "no update was accepted in any of 1 round(s)" in err, err
    assert "ModuleNotFoundError: peft" in err, err
