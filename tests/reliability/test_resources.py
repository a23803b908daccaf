"""Resources: an offload directory that is full or not writable is reported before
training, naming the directory and the fix; a budget the device cannot honour is
reported with the measured figure.

Full and read-only directories are real small filesystems (``mount -t tmpfs``; the
tests run as root, and root writes through a directory's mode bits, so ``chmod``
alone cannot make a directory unwritable for it). Where mounting is not permitted,
those cases skip and say why.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from client import config as node_cfg
from client.app import app as client_app
from client.config import NodeConfig, free_disk_bytes, total_memory_bytes
from memory.blocks import as_blocks
from memory.spec import BlockPlan, MemoryPlan
from tests.server.grid import FakeGrid
from wire.instruction import TrainInstruction
from wire.shape import RunShape
from workloads import get_workload

BASE = {"partition-id": 0, "num-partitions": 2}


def _mount(mnt, options: str) -> None:
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root")


@pytest.fixture
def full_dir(tmp_path):
    """A real 1 MiB filesystem, filled up to its last byte."""
    mnt = tmp_path / "full"
    _mount(mnt, "size=1m")
    try:
        with open(mnt / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write in, root included (a read-only mount)."""
    ro = tmp_path / "ro"
    if os.geteuid() != 0:
        ro.mkdir()
        ro.chmod(0o500)
        yield ro
        ro.chmod(0o700)
        return
    _mount(ro, "ro,size=64k")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def _train_message(plan: MemoryPlan) -> Message:
    wl = get_workload("digits-cnn")
    ins = TrainInstruction(
        shape=RunShape(local_steps=2),
        kind="full",
        plan=json.dumps(plan.to_dict()),
        measure="inline",
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord(wl.make_model(0).state_dict()),
            "config": ConfigRecord(ins.to_config()),
        }
    )
    return Message(content, 7, MessageType.TRAIN, group_id="1")


def _offloading_plan() -> MemoryPlan:
    """digits-cnn with every block's activations offloaded to disk (the planner's
    prediction of the disk it needs: 1 MiB, more than the full directory has)."""
    n = len(as_blocks(get_workload("digits-cnn").make_model(0)))
    blocks = tuple(BlockPlan(str(i), "offload") for i in range(n))
    return MemoryPlan(blocks, predicted_disk_bytes=2**20)


def _ask(node_config: dict, message: Message) -> Message:
    grid = FakeGrid({7: (client_app, node_config)})
    reply = grid._deliver(message)
    assert reply is not None
    return reply


# ------------------------------------------------------------------- full directory
@pytest.mark.child
def test_full_offload_dir_measured_budget_is_zero_and_reported(full_dir, caplog):
    free = free_disk_bytes(str(full_dir))
    assert free < node_cfg.NEARLY_FULL_BYTES
    with caplog.at_level(logging.WARNING, logger="client.config"):
        node = NodeConfig.from_node_config({**BASE, "offload-dir": str(full_dir)})
    assert node.disk_budget_bytes == free // 2 < 2**19
    (note,) = node.warnings
    assert str(full_dir) in note and f"({free} bytes) free" in note
    assert "offload-dir" in note and "free space there" in note  # the fix
    assert note in caplog.text


@pytest.mark.child
def test_disk_budget_above_the_free_space_names_the_measured_figure(full_dir):
    free = free_disk_bytes(str(full_dir))
    node = NodeConfig.from_node_config(
        {**BASE, "offload-dir": str(full_dir), "disk-budget": "10MB"}
    )
    assert node.disk_budget_bytes == 10**7  # kept: the plan decides what it uses
    (note,) = node.warnings
    assert "disk-budget" in note and f"({free} bytes) free" in note
    assert str(full_dir) in note and "10000000 bytes" in note


@pytest.mark.child
def test_full_offload_dir_fails_the_round_before_training(full_dir):
    reply = _ask(
        {**BASE, "offload-dir": str(full_dir), "disk-budget": "10MB"},
        _train_message(_offloading_plan()),
    )
    assert reply.has_error()
    reason = reply.error.reason
    assert reason.startswith("OffloadDirError") and str(full_dir) in reason
    assert "free but the plan needs" in reason and "choose another directory" in reason
    assert sorted(p.name for p in full_dir.iterdir()) == ["filler"]  # nothing written


# --------------------------------------------------------------- read-only directory
def test_root_writes_through_mode_bits(tmp_path):
    """Why the unwritable cases use a read-only mount: a 0o500 directory is writable
    to root (os.access says so, and so does a probe)."""
    if os.geteuid() != 0:
        pytest.skip("only root writes through mode bits")
    d = tmp_path / "ro-by-mode"
    d.mkdir()
    d.chmod(0o500)
    assert os.access(d, os.W_OK)
    assert node_cfg.offload_dir_problem(str(d)) is None


@pytest.mark.child
def test_unwritable_offload_dir_with_a_disk_budget_is_an_error(read_only_dir):
    with pytest.raises(ValueError) as e:
        NodeConfig.from_node_config(
            {**BASE, "offload-dir": str(read_only_dir), "disk-budget": "1MB"}
        )
    msg = str(e.value)
    assert str(read_only_dir) in msg and "is not writable" in msg
    assert "disk-budget" in msg and "offload-dir" in msg and "disk-budget=0" in msg


@pytest.mark.child
def test_unwritable_offload_dir_measured_budget_is_zero(read_only_dir):
    node = NodeConfig.from_node_config({**BASE, "offload-dir": str(read_only_dir)})
    assert node.disk_budget_bytes == 0
    (note,) = node.warnings
    assert str(read_only_dir) in note and "offloads nothing" in note
    # a disk budget of 0 asks for no disk: nothing to check, nothing to report
    node = NodeConfig.from_node_config(
        {**BASE, "offload-dir": str(read_only_dir), "disk-budget": "0"}
    )
    assert node.disk_budget_bytes == 0 and node.warnings == ()


@pytest.mark.child
def test_unwritable_offload_dir_is_reported_at_the_query_and_the_train(
    read_only_dir,
):
    node_config = {**BASE, "offload-dir": str(read_only_dir), "disk-budget": "1MB"}
    query = Message(RecordDict({"config": ConfigRecord({})}), 7, MessageType.QUERY)
    for message in (query, _train_message(_offloading_plan())):
        reply = _ask(node_config, message)
        assert reply.has_error()
        assert str(read_only_dir) in reply.error.reason
        assert "not writable" in reply.error.reason


def test_offload_dir_under_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        NodeConfig.from_node_config(
            {**BASE, "offload-dir": str(f / "sub"), "disk-budget": "1MB"}
        )


# ------------------------------------------------------------ budgets vs the device
def test_memory_budget_above_total_memory_names_the_measured_total(tmp_path, caplog):
    total = total_memory_bytes()
    budget = 4 * total
    node_config = {
        **BASE,
        "memory-budget": str(budget),
        "offload-dir": str(tmp_path),
        "disk-budget": "0",
    }
    node_cfg._reported.clear()
    with caplog.at_level(logging.WARNING, logger="client.config"):
        node = NodeConfig.from_node_config(node_config)
        again = NodeConfig.from_node_config(node_config)
    assert node.budget_bytes == budget  # kept: reported, not second-guessed
    (note,) = node.warnings
    assert again.warnings == node.warnings
    assert f"({total} bytes, MemTotal)" in note and f"({budget} bytes)" in note
    assert "memory-budget" in note
    assert caplog.text.count("MemTotal") == 1  # logged once per process


def test_budgets_the_device_can_honour_are_not_reported(tmp_path):
    node = NodeConfig.from_node_config(
        {
            **BASE,
            "memory-budget": "64MB",
            "disk-budget": "1MB",
            "offload-dir": str(tmp_path),
        }
    )
    assert node.warnings == ()
    node = NodeConfig.from_node_config({**BASE, "offload-dir": str(tmp_path)})
    assert node.budget_source == "measured" and node.warnings == ()
    # a fleet description's memory budgets describe simulated devices: not this one
    node = NodeConfig.from_node_config(
        {**BASE, "offload-dir": str(tmp_path), "disk-budget": "0"},
        {node_cfg.FLEET_MEMORY: str(4 * total_memory_bytes())},
    )
    assert node.budget_source == "fleet" and node.warnings == ()


def test_fleet_disk_budget_above_the_free_space_is_reported(tmp_path):
    free = free_disk_bytes(str(tmp_path))
    node = NodeConfig.from_node_config(
        {**BASE, "offload-dir": str(tmp_path)},
        {node_cfg.FLEET_DISK: str(free + 2**40)},
    )
    (note,) = node.warnings
    assert node_cfg.FLEET_DISK in note and str(tmp_path) in note and "free" in note


@pytest.mark.child
def test_a_disk_that_fills_during_a_step_is_an_offload_dir_error(full_dir):
    """Checks before training trust the plan's disk figure; if the disk fills all the
    same, the write fails with the directory and the fix, not a bare OSError."""
    from torch import nn

    from memory.errors import OffloadDirError
    from memory.offload import ActivationOffload

    offload = ActivationOffload(full_dir)
    block = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x = torch.randn(512, 256, requires_grad=True)
    acts = offload.activations("0", keep=[x])
    with acts.hooks():
        out = block(x)
    with pytest.raises(OffloadDirError) as e:
        acts.commit(out)
    assert str(full_dir) in str(e.value) and "disk budget of 0" in str(e.value)
    assert e.value.directory == str(full_dir)
    # the partial file is closed and removed: the disk is given back, nothing held open
    assert sorted(p.name for p in full_dir.iterdir()) == ["filler"]
