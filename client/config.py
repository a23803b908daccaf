"""The node's own settings (Flower node config), parsed once into a typed config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeConfig:
    """What a SuperNode knows about itself.

    Attributes:
        partition_id: which share of the data this node owns (``partition-id``).
        num_partitions: how many shares there are (``num-partitions``).
    """

    partition_id: int
    num_partitions: int

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> NodeConfig:
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
        return cls(pid, num)
