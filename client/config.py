"""The node's own settings (Flower node config), parsed once into a typed config.

Budgets, in order of precedence:

1. ``memory-budget`` / ``disk-budget`` in the node config (size strings such as
   ``"512MB"``; ``disk-budget = 0`` forbids offload and streaming);
2. the fleet description, by partition id: ``fleet-memory-budgets`` /
   ``fleet-disk-budgets`` (comma-separated sizes, entry ``partition-id`` modulo their
   count) from the run config or from the server's query (simulation gives virtual
   nodes nothing but ``partition-id`` and ``num-partitions``);
3. measured: ``MEMORY_SHARE`` of the memory available now (``MemAvailable``), and
   ``DISK_SHARE`` of the free space in the offload directory.

A budget this device cannot honour is reported with the measured figure (a logged
warning, kept in ``NodeConfig.warnings``): a ``memory-budget`` above the device's total
memory, a disk budget above the free space in the offload directory, a measured disk
budget in a (nearly) full offload directory. An offload directory that is not
writable fails a given disk budget (``ValueError`` naming the directory and the fix)
and turns a measured one into 0 (nothing is offloaded), before any training.

Workloads: a node imports only the built-in workloads and the ``module:function``
workloads its operator allows, so that a run config cannot make every device import
arbitrary code. The allow-list is ``allow-workloads`` in the node config
(``fleetfit client --allow-workloads``), or, when the node config has no such key, the
``FLEETFIT_ALLOW_WORKLOADS`` environment variable of the node's process (simulation
gives virtual nodes no node config of their own): comma-separated entries
``module:function``, ``module:*`` (any function of that module) or ``*`` (anything).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from memory.sizes import format_bytes, parse_bytes
from wire.facts import fleet_entry
from wire.keys import FLEET_DISK, FLEET_MEMORY, FLEET_SPEEDS

log = logging.getLogger(__name__)

MEMORY_SHARE = 0.5
"""Share of the available memory a node without ``memory-budget`` uses for training."""

DISK_SHARE = 0.5
"""Share of the offload directory's free space a node without ``disk-budget`` uses."""

ALLOW_WORKLOADS = "allow-workloads"
"""Node-config key: the ``module:function`` workloads this node may import."""
ALLOW_WORKLOADS_ENV = "FLEETFIT_ALLOW_WORKLOADS"
"""Environment variable read when the node config has no ``allow-workloads``."""

NEARLY_FULL_BYTES = 2**20
"""Free space below which a measured disk budget is reported (nothing to offload)."""

_OFFLOAD_FIX = (
    "choose another directory (node config offload-dir, fleetfit client "
    "--offload-dir), free space there, or set disk-budget=0 to train without disk"
)
_reported: set[str] = set()  # warnings logged once per process

_ALLOW_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:([A-Za-z_]\w*|\*)$")


class WorkloadNotAllowed(ValueError):
    """The instruction names a workload this node's operator has not allowed."""


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode knows about itself.

    Attributes:
        partition_id: which share of the data this node owns (``partition-id``).
        num_partitions: how many shares there are (``num-partitions``).
        budget_bytes: memory the node's training may use, bytes (peak above the
            import baseline).
        disk_budget_bytes: bytes of local disk for offload and streaming (0: none).
        budget_source: ``node-config``, ``fleet`` or ``measured``.
        offload_dir: where offloaded activations and streamed state go.
        speed_factor: multiplies the measured compute rate (a simulated slow device
            has < 1; ``fleet-speeds``), 1.0 otherwise.
        allowed_workloads: the ``module:function`` workloads (or ``module:*``, ``*``)
            this node may import besides the built-ins (``allow-workloads``).
        warnings: budgets this device cannot honour, with the measured figures.
    """

    partition_id: int
    num_partitions: int
    budget_bytes: int = 0
    disk_budget_bytes: int = 0
    budget_source: str = "measured"
    offload_dir: str = ""
    speed_factor: float = 1.0
    allowed_workloads: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_node_config(
        cls, node_config: dict[str, Any], fleet: dict[str, Any] | None = None
    ) -> NodeConfig:
        """Parse the node config; ``fleet`` holds the ``fleet-*`` keys, if any."""
        try:
            pid = node_config["partition-id"]
            num = node_config["num-partitions"]
        except KeyError as e:
            raise ValueError(
                f"node config lacks {e.args[0]!r}: start the SuperNode with "
                "--node-config 'partition-id=0 num-partitions=2'"
            ) from None
        if (
            isinstance(pid, bool)
            or isinstance(num, bool)
            or not isinstance(pid, int)
            or not isinstance(num, int)
        ):
            raise ValueError(
                f"partition-id={pid!r} and num-partitions={num!r} must be integers"
            )
        if num < 1 or not 0 <= pid < num:
            raise ValueError(
                f"partition-id={pid} must be in 0..num-partitions-1 (num-partitions={num})"
            )
        # This partition's entries of the fleet lists, each list read once.
        fleet_memory, fleet_disk, fleet_speed = (
            fleet_entry(fleet or {}, key, pid)
            for key in (FLEET_MEMORY, FLEET_DISK, FLEET_SPEEDS)
        )
        offload_dir = str(node_config.get("offload-dir") or tempfile.gettempdir())
        source = "measured"
        if "memory-budget" in node_config:
            budget = parse_bytes(node_config["memory-budget"], what="memory-budget")
            source = "node-config"
        elif fleet_memory is not None:
            budget = parse_bytes(fleet_memory, what=FLEET_MEMORY)
            source = "fleet"
        else:
            budget = int(MEMORY_SHARE * available_memory_bytes())
        disk_key = None
        if "disk-budget" in node_config:
            disk = parse_bytes(
                node_config["disk-budget"], what="disk-budget", allow_zero=True
            )
            disk_key = "disk-budget"
        elif fleet_disk is not None:
            disk = parse_bytes(fleet_disk, what=FLEET_DISK, allow_zero=True)
            disk_key = FLEET_DISK
        else:
            disk = int(DISK_SHARE * free_disk_bytes(offload_dir))
        notes = []
        if source == "node-config":
            total = total_memory_bytes()
            if budget > total:
                notes.append(
                    f"memory-budget {format_bytes(budget)} ({budget} bytes) is more "
                    f"than this device's total memory, {format_bytes(total)} ({total} "
                    "bytes, MemTotal): plans made for it can exhaust the device; give "
                    "a smaller memory-budget, or none to use "
                    f"{MEMORY_SHARE:.0%} of the available memory"
                )
        if disk > 0 or disk_key is None:
            problem = offload_dir_problem(offload_dir)
            if problem is not None and disk_key is not None:
                raise ValueError(
                    f"offload directory {offload_dir!r} is not writable ({problem}) "
                    f"but {disk_key} gives {format_bytes(disk)} of disk there; "
                    f"{_OFFLOAD_FIX}"
                )
            if problem is not None:
                notes.append(
                    f"offload directory {offload_dir!r} is not writable ({problem}): "
                    f"this node offloads nothing (disk budget 0); {_OFFLOAD_FIX}"
                )
                disk = 0
            else:
                free = free_disk_bytes(offload_dir)
                if disk_key is not None and disk > free:
                    notes.append(
                        f"{disk_key} {format_bytes(disk)} ({disk} bytes) is more than "
                        f"the {format_bytes(free)} ({free} bytes) free in offload "
                        f"directory {offload_dir!r}: a plan that uses more than that "
                        f"fails before training; {_OFFLOAD_FIX}"
                    )
                elif disk_key is None and free < NEARLY_FULL_BYTES:
                    notes.append(
                        f"offload directory {offload_dir!r} has {format_bytes(free)} "
                        f"({free} bytes) free: this node offloads nothing; "
                        f"{_OFFLOAD_FIX}"
                    )
        for note in notes:
            if note not in _reported:
                _reported.add(note)
                log.warning("%s", note)
        speed = 1.0
        if fleet_speed is not None:
            try:
                speed = float(fleet_speed)
            except ValueError:
                raise ValueError(
                    f"{FLEET_SPEEDS} entry {fleet_speed!r} is not a number"
                ) from None
            if not speed > 0:
                raise ValueError(f"{FLEET_SPEEDS} entry {fleet_speed!r} must be > 0")
        allowed = allowed_workloads(node_config)
        return cls(
            pid, num, budget, disk, source, offload_dir, speed, allowed, tuple(notes)
        )


def allowed_workloads(
    node_config: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[str, ...]:
    """The node's allow-list: ``allow-workloads``, else ``FLEETFIT_ALLOW_WORKLOADS``.

    Raises:
        ValueError: an entry that is not ``module:function``, ``module:*`` or ``*``.
    """
    env = os.environ if env is None else env
    if ALLOW_WORKLOADS in node_config:
        raw, where = node_config[ALLOW_WORKLOADS], f"node config {ALLOW_WORKLOADS}"
    else:
        raw, where = env.get(ALLOW_WORKLOADS_ENV, ""), ALLOW_WORKLOADS_ENV
    if not isinstance(raw, str):
        raise ValueError(
            f"{where}={raw!r} must be a string of comma-separated module:function "
            'entries, e.g. allow-workloads="mypkg.jobs:build"'
        )
    entries = tuple(e.strip() for e in raw.split(",") if e.strip())
    for e in entries:
        if e != "*" and not _ALLOW_ENTRY.match(e):
            raise ValueError(
                f"{where} entry {e!r} must be module:function, module:* or *, "
                'e.g. allow-workloads="mypkg.jobs:build"'
            )
    return entries


def workload_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether a node with allow-list ``allowed`` may load workload ``name``.

    ``get_workload`` imports code only for a ``module:function`` name; any other name
    is a built-in or an unknown name that it refuses by itself.
    """
    if ":" not in name or name in allowed or "*" in allowed:
        return True
    module = name.partition(":")[0]
    return bool(module) and f"{module}:*" in allowed


def check_workload_allowed(name: Any, node_config: Mapping[str, Any]) -> None:
    """Refuse, before anything is imported, a workload the operator has not allowed.

    Raises:
        WorkloadNotAllowed: naming the workload and the node-config key to set.
    """
    allowed = allowed_workloads(node_config)
    if not isinstance(name, str) or workload_allowed(name, allowed):
        return  # get_workload refuses a name that is not a string
    shown = ", ".join(allowed) if allowed else "none"
    raise WorkloadNotAllowed(
        f"workload {name!r} is not allowed on this node (built-in workloads and "
        f"{ALLOW_WORKLOADS}: {shown}); if you trust its code, allow it with "
        f"--node-config '{ALLOW_WORKLOADS}=\"{name}\"' (fleetfit client "
        f"--allow-workloads {name}) or {ALLOW_WORKLOADS_ENV}={name}"
    )


def total_memory_bytes() -> int:
    """Physical memory of this device (``MemTotal``), bytes."""
    return int(psutil.virtual_memory().total)


def available_memory_bytes() -> int:
    """Memory available for new work now (``MemAvailable``), bytes."""
    return int(psutil.virtual_memory().available)


def offload_dir_problem(directory: str) -> str | None:
    """Why files cannot be written in ``directory`` (or, when it does not exist yet,
    its nearest existing parent, where it would be created); None when they can.

    A probe file is created and removed: what writing there does for whoever runs
    the node (root writes through mode bits; a read-only mount or a full inode
    table refuses).
    """
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"{path!r} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".fleetfit-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def free_disk_bytes(directory: str) -> int:
    """Free bytes in ``directory`` (or its nearest existing parent)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return int(shutil.disk_usage(path).free)
