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
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from memory.sizes import parse_bytes

MEMORY_SHARE = 0.5
"""Share of the available memory a node without ``memory-budget`` uses for training."""

DISK_SHARE = 0.5
"""Share of the offload directory's free space a node without ``disk-budget`` uses."""

FLEET_MEMORY = "fleet-memory-budgets"
FLEET_DISK = "fleet-disk-budgets"
FLEET_SPEEDS = "fleet-speeds"


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
    """

    partition_id: int
    num_partitions: int
    budget_bytes: int = 0
    disk_budget_bytes: int = 0
    budget_source: str = "measured"
    offload_dir: str = ""
    speed_factor: float = 1.0

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
        fleet = fleet or {}
        offload_dir = str(node_config.get("offload-dir") or tempfile.gettempdir())
        source = "measured"
        if "memory-budget" in node_config:
            budget = parse_bytes(node_config["memory-budget"], what="memory-budget")
            source = "node-config"
        elif _entry(fleet.get(FLEET_MEMORY), pid) is not None:
            budget = parse_bytes(
                _entry(fleet.get(FLEET_MEMORY), pid) or "", what=FLEET_MEMORY
            )
            source = "fleet"
        else:
            budget = int(MEMORY_SHARE * available_memory_bytes())
        if "disk-budget" in node_config:
            disk = parse_bytes(
                node_config["disk-budget"], what="disk-budget", allow_zero=True
            )
        elif _entry(fleet.get(FLEET_DISK), pid) is not None:
            disk = parse_bytes(
                _entry(fleet.get(FLEET_DISK), pid) or "0",
                what=FLEET_DISK,
                allow_zero=True,
            )
        else:
            disk = int(DISK_SHARE * free_disk_bytes(offload_dir))
        speed = 1.0
        raw_speed = _entry(fleet.get(FLEET_SPEEDS), pid)
        if raw_speed is not None:
            try:
                speed = float(raw_speed)
            except ValueError:
                raise ValueError(
                    f"{FLEET_SPEEDS} entry {raw_speed!r} is not a number"
                ) from None
            if not speed > 0:
                raise ValueError(f"{FLEET_SPEEDS} entry {raw_speed!r} must be > 0")
        return cls(pid, num, budget, disk, source, offload_dir, speed)


def _entry(spec: Any, partition_id: int) -> str | None:
    """Entry ``partition_id`` (modulo the count) of a comma-separated fleet list."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    return items[partition_id % len(items)] if items else None


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


def total_memory_bytes() -> int:
    """Physical memory of this device, bytes."""
    return _meminfo("MemTotal")


def available_memory_bytes() -> int:
    """Memory available for new work now (``MemAvailable``), bytes."""
    return _meminfo("MemAvailable")


def free_disk_bytes(directory: str) -> int:
    """Free bytes in ``directory`` (or its nearest existing parent)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return int(shutil.disk_usage(path).free)
