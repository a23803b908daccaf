"""A SuperNode imports only built-in workloads and those its operator allows.

The ClientApp is driven directly with built messages, and through the real
``FlowerTransport`` and ``Federation`` over the in-process ``FakeGrid``.
"""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from torch import nn

from client.app import app as client_app
from client.config import (
    ALLOW_WORKLOADS_ENV,
    NodeConfig,
    WorkloadNotAllowed,
    allowed_workloads,
    check_workload_allowed,
)
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, federate, nodes
from wire.instruction import TrainInstruction
from wire.shape import RunShape

JOB = textwrap.dedent(
    """
    import pathlib, torch
    from torch import nn

    pathlib.Path("imported.txt").write_text("fleetjob was imported")

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        x = torch.randn(8, 1, 8, 8)
        y = torch.randint(0, 10, (8,))
        return model, (x, y), nn.functional.cross_entropy
    """
)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A user module ``fleetjob`` in the current directory; importing it leaves a
    file behind."""
    (tmp_path / "fleetjob.py").write_text(JOB)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ALLOW_WORKLOADS_ENV, raising=False)
    sys.modules.pop("fleetjob", None)
    yield tmp_path
    sys.modules.pop("fleetjob", None)


def ctx(node_config):
    return Context(
        run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={}
    )


def train_msg(workload: str) -> Message:
    ins = TrainInstruction(
        server_round=1,
        shape=RunShape(workload=workload, local_steps=2, lr=0.01),
        measure="inline",
    )
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))  # fleetjob's, unimported
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "config": ins_config(ins)}
    )
    return Message(content, 5, MessageType.TRAIN)


def ins_config(ins: TrainInstruction) -> ConfigRecord:
    return ConfigRecord(ins.to_config())


NODE = {"partition-id": 0, "num-partitions": 2}


@pytest.mark.parametrize("kind", [MessageType.TRAIN, MessageType.EVALUATE])
def test_a_node_refuses_an_unlisted_workload_before_importing_it(job, kind):
    msg = train_msg("fleetjob:build")
    if kind == MessageType.EVALUATE:
        msg = Message(msg.content, 5, MessageType.EVALUATE)
    reply = client_app(msg, ctx(NODE))
    assert reply.has_error()
    reason = reply.error.reason
    assert "WorkloadNotAllowed" in reason and "'fleetjob:build'" in reason
    assert 'allow-workloads="fleetjob:build"' in reason
    assert "--allow-workloads fleetjob:build" in reason
    assert "fleetjob" not in sys.modules
    assert not (job / "imported.txt").exists()


def test_a_refused_none_assignment_imports_nothing_either(job):
    msg = train_msg("fleetjob:build")
    cfg = dict(msg.content.config_records["config"])
    cfg["kind"] = "none"
    msg.content.config_records["config"] = ConfigRecord(cfg)
    reply = client_app(msg, ctx(NODE))
    assert reply.has_error() and "not allowed" in reply.error.reason
    assert not (job / "imported.txt").exists()


@pytest.mark.parametrize(
    "allow", ["fleetjob:build", "other:x, fleetjob:build", "fleetjob:*", "*"]
)
def test_an_allowed_workload_trains(job, allow):
    reply = client_app(
        train_msg("fleetjob:build"), ctx({**NODE, "allow-workloads": allow})
    )
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    assert reply.content.metric_records["metrics"]["num-examples"] > 0
    assert (job / "imported.txt").exists()


def test_the_environment_allows_when_the_node_config_is_silent(job, monkeypatch):
    monkeypatch.setenv(ALLOW_WORKLOADS_ENV, "fleetjob:build")
    assert not client_app(train_msg("fleetjob:build"), ctx(NODE)).has_error()
    # the node config, when present, wins over the environment
    reply = client_app(
        train_msg("fleetjob:build"), ctx({**NODE, "allow-workloads": "x:y"})
    )
    assert reply.has_error() and "x:y" in reply.error.reason


@pytest.mark.parametrize(
    "name,allow",
    [
        ("fleetjob:build", "fleetjob:buil"),  # no prefix matching
        ("fleetjob:build", "fleetjo:*"),
        ("fleetjob.sub:build", "fleetjob:*"),  # a submodule is another module
        ("fleetjob:build", "fleetjob.sub:*"),
        ("os:system", "fleetjob:build"),
        ("fleetjob:build ", "fleetjob:build"),
    ],
)
def test_only_listed_names_pass(name, allow):
    with pytest.raises(WorkloadNotAllowed, match="allow-workloads"):
        check_workload_allowed(name, {"allow-workloads": allow})


@pytest.mark.parametrize("name", ["digits-cnn", "gpt-tiny", "no-such-builtin"])
def test_names_that_import_nothing_need_no_allow_list(name):
    check_workload_allowed(name, {})  # get_workload handles unknown names itself


@pytest.mark.parametrize(
    "allow", ["fleetjob", "fleetjob:", ":build", "a b:c", "fleetjob:build:x", "a:*x"]
)
def test_a_malformed_allow_list_is_refused_at_the_first_message(allow):
    with pytest.raises(ValueError, match=re.escape(f"entry {allow!r}")):
        allowed_workloads({"allow-workloads": allow})
    with pytest.raises(ValueError, match="must be module:function"):
        NodeConfig.from_node_config(
            {**NODE, "allow-workloads": allow, "memory-budget": "1GB"}
        )


def test_a_non_string_allow_list_is_refused():
    with pytest.raises(ValueError, match="allow-workloads=3 must be a string"):
        allowed_workloads({"allow-workloads": 3})


def test_over_the_federation_only_allowing_nodes_train(job, tmp_path):
    cfg = config(tmp_path, workload="fleetjob:build", num_server_rounds=1)
    fleet = nodes(3)
    fleet[2000][1]["allow-workloads"] = "fleetjob:build"
    summary = federate(cfg, FakeGrid(fleet))
    (r,) = summary["rounds"]
    status = {a["partition_id"]: a["status"] for a in r["assignments"]}
    assert status[0] == "ok"
    for pid in (1, 2):
        assert status[pid].startswith("error") and "not allowed" in status[pid]
        assert "allow-workloads" in status[pid]
    assert r["num_clients"] == 1 and r["num_failed"] == 2


CLIENT = ["client", "--superlink", "127.0.0.1:1", "--partition-id", "0"]


def test_fleetfit_client_passes_the_allow_list_to_its_supernode(monkeypatch):
    from fleetfit import cmd_federation
    from fleetfit.cli import main

    started: list[list[str]] = []

    class FakeSuperNode:
        def __init__(self, cmd, env):
            started.append(cmd)
            self.returncode = 0

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    monkeypatch.setattr(cmd_federation.subprocess, "Popen", FakeSuperNode)
    args = [*CLIENT, "--num-partitions", "1", "--allow-workloads", "fleetjob:build"]
    assert main(args) == 0
    (cmd,) = started
    node_config = cmd[cmd.index("--node-config") + 1]
    assert 'allow-workloads="fleetjob:build"' in node_config


def test_fleetfit_client_refuses_a_malformed_allow_list(monkeypatch, capsys):
    from fleetfit import cmd_federation
    from fleetfit.cli import main

    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    args = [*CLIENT, "--num-partitions", "1", "--allow-workloads", "os.system"]
    assert main(args) == 2
    assert "entry 'os.system' must be module:function" in capsys.readouterr().err
