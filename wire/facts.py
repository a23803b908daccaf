"""What a node says of itself (the query reply), and the fleet description.

The node writes its facts with ``NodeFacts.to_record``; the server reads any reply with
``NodeFacts.from_record``, which never raises: a fact that is missing or of the wrong
type or out of range (an old or a misbehaving node: a budget of inf, NaN, 0 or 10**30
bytes, a partition id of -1 or "abc") is ``None``, and the server treats the node as
it treats one that did not answer (plain training of the whole model).

``adapters`` says whether the node can train LoRA adapters (``memory.lora``: peft, which
only the ``hf`` extra installs). A node that cannot is never given an ``adapter``
assignment; one that did not say (an older node) may be, and if it then replies with
an error of code ``MISSING_EXTRA`` the server records ``adapters=False`` for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from wire import keys
from wire.flat import read_tuple
from wire.reply import MAX_BYTES

BUDGET_SOURCES = ("node-config", "fleet", "measured")
MISSING_EXTRA = 100
"""``Error.code`` of a train reply refusing work that needs a package this node's
install lacks (an extra of fleetfit); the reason names the extra in one line. Outside
Flower's ``ErrorCode`` values (0-8)."""

_KEY = {
    "partition_id": keys.PARTITION_ID,
    "num_partitions": keys.NUM_PARTITIONS,
    "budget_bytes": keys.BUDGET_BYTES,
    "disk_budget_bytes": keys.DISK_BUDGET_BYTES,
    "budget_source": keys.BUDGET_SOURCE,
    "total_memory_bytes": keys.TOTAL_MEMORY_BYTES,
    "available_memory_bytes": keys.AVAILABLE_MEMORY_BYTES,
    "free_disk_bytes": keys.FREE_DISK_BYTES,
    "flops_per_s": keys.FLOPS_PER_S,
    "num_cpus": keys.NUM_CPUS,
    "adapters": keys.ADAPTERS,
}


MAX_FLOPS_PER_S = 1e18
_RANGE = {  # name -> (lowest, highest) valid integer; others: (0, MAX_BYTES)
    "partition_id": (0, 2**31 - 1),
    "num_partitions": (1, 2**31),
    "budget_bytes": (1, MAX_BYTES),
    "num_cpus": (1, 2**20),
}


@dataclass(frozen=True)
class NodeFacts:
    """A node's facts; ``None`` where the node did not say (or said nonsense)."""

    partition_id: int | None = None  # its share of the data
    num_partitions: int | None = None
    budget_bytes: int | None = None  # memory its training may use, bytes
    disk_budget_bytes: int | None = None  # disk for offload and streaming, bytes
    budget_source: str | None = None  # node-config | fleet | measured
    total_memory_bytes: int | None = None
    available_memory_bytes: int | None = None
    free_disk_bytes: int | None = None
    flops_per_s: float | None = None  # measured fp32 matmul rate x fleet speed
    num_cpus: int | None = None
    adapters: bool | None = None  # can train adapters (peft: the hf extra)

    def to_record(self) -> dict[str, Any]:
        """The facts as ConfigRecord values (facts not known are left out)."""
        return {
            _KEY[f.name]: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> NodeFacts:
        """Read a query reply's ``node`` record; what is not valid is ``None``.

        Never raises: ``record`` may be anything a peer sent."""
        return cls.read(record)[0]

    @classmethod
    def read(cls, record: Any) -> tuple[NodeFacts, list[str]]:
        """The facts of a query reply's ``node`` record, and what was refused in it
        (``"budget-bytes=inf"``: present but of the wrong type or out of range).
        Never raises."""
        values: dict[str, Any] = {}
        refused: list[str] = []
        if not isinstance(record, Mapping):
            return cls(), [f"node record {str(record)[:40]!r}"]
        for name, key in _KEY.items():
            value: Any = record.get(key)
            if name == "adapters":
                ok = isinstance(value, bool)
                values[name] = value if ok else None
            elif name == "budget_source":
                ok = isinstance(value, str) and value in BUDGET_SOURCES
                values[name] = value if ok else None
            elif name == "flops_per_s":
                ok = _number(value) and 0 < value <= MAX_FLOPS_PER_S
                values[name] = float(value) if ok else None
            else:
                low, high = _RANGE.get(name, (0, MAX_BYTES))
                ok = _number(value) and value == int(value) and low <= value <= high
                values[name] = int(value) if ok else None
            if value is not None and not ok:
                refused.append(f"{key}={str(value)[:40]}")
        return cls(**values), refused


def _number(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == value  # not NaN
        and abs(value) != float("inf")
    )


def fleet_entry(fleet: Mapping[str, Any], key: str, partition_id: int) -> Any:
    """Entry ``partition_id`` (modulo the count) of the fleet list ``fleet[key]``
    (``fleet-memory-budgets`` and the like: a comma-separated string or a list, read
    as ``wire.flat`` reads ``FleetConfig``'s lists); None where the list is missing
    or empty. The entry is a stripped string or a number, for the caller to parse.

    Raises:
        ValueError: the list is neither a string nor a list of strings and numbers,
            naming the key and the value.
    """
    if fleet.get(key) is None:
        return None
    items = read_tuple(fleet[key], key, what="fleet", item=_entry)
    return items[partition_id % len(items)] if items else None


def _entry(x: Any) -> Any:
    if isinstance(x, str):
        return x.strip()
    if isinstance(x, int | float) and not isinstance(x, bool):
        return x
    raise ValueError(f"entry {x!r} is neither a string nor a number")
