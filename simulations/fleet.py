"""Fleet descriptions: device classes with shares, memory, speed and availability.

A fleet file is TOML (see ``simulations/fleets/`` and docs/simulations.md). Its run
settings are the run config's own keys, names and defaults (``ServerConfig``, read by
the same parser, ``wire.flat``); the rest describes the devices::

    name = "phones"
    clients = 20            # virtual devices
    num-server-rounds = 4   # federated rounds (default 5)
    fraction-train = 0.5    # share of the online devices sampled per round (default 1)
    local-steps = 5         # optimizer steps per device per round (default 20)
    seed = 0
    workload = "gpt-byte"   # built-in or module:function (default digits-cnn)
    batch-size = 8          # optional: 0, the workload's default
    seq-len = 128           # optional, language models
    lr = 0.003              # optional
    split = "natural"       # iid (default) | dirichlet | natural (by device class)
    dirichlet-alpha = 0.5   # split = "dirichlet" only

    [[classes]]
    name = "3GB"
    share = 0.14            # of the devices; the shares sum to 1
    memory = "300MB"        # fixed, or {min = "250MB", max = "350MB"} (uniform per
                            # device), or {choices = ["1GB", "2GB"], weights = [3, 1]}
    disk = "0"              # optional: local storage for offload/streaming ("0": none)
    speed = 0.5             # relative compute speed (1: this machine)
    availability = 0.9      # probability that a device is online in a round
    downlink = "20Mbit/s"   # optional: server -> device (default DEFAULT_DOWNLINK)
    uplink = "5Mbit/s"      # optional: device -> server (default DEFAULT_UPLINK)

    [pretrain]              # optional: train centrally before round 1 on data held
    share = 0.2             #   out from every device (simulations/pretrain.py)
    steps = 200

The names fleet files had before (``rounds``, ``fraction``, ``local_steps``,
``eval_windows``, ``[workload] name/batch/seq/lr``, ``[split] kind/alpha``) are still
read, each with a one-line warning naming its run-config key (``RENAMED``); so is a
file that leaves ``local-steps`` or ``split`` unset, whose defaults were 5 and
``natural`` for fleet files before and are now the run config's.

``load_fleet`` validates everything before Ray starts; errors name the field and the
value. Devices are numbered class by class (partition ids ``0..n-1``); a class gets
``round(share * clients)`` devices (largest remainder, at least one each).
"""

from __future__ import annotations

import json
import logging
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from memory.errors import MemoryPlanError
from memory.sizes import parse_bytes
from server.config import AdapterConfig, FleetConfig, ServerConfig
from simulations.pretrain import Pretrain, parse_pretrain
from wire.flat import flat_keys, from_flat
from wire.shape import RunShape

log = logging.getLogger(__name__)

FLEETS_DIR = Path(__file__).parent / "fleets"
"""The shipped fleet files (``phones.toml``, ``sbc.toml``, ``edge.toml``)."""

_SERVER = ServerConfig()  # the run config's defaults, which a fleet file keeps

RUN_KEYS = (
    *(k for k in flat_keys(RunShape) if k != "public-share"),  # [pretrain] share
    "num-server-rounds",
    "fraction-train",
    "eval-windows",
    "round-deadline",
    *flat_keys(AdapterConfig),  # adapters, lora-rank, lora-alpha, lora-targets, ...
)
"""The run-config keys a fleet file may set (``ServerConfig``'s names and defaults)."""

DEFAULT_DOWNLINK = "20Mbit/s"
"""A class's link server -> device when its ``downlink`` is not given (a typical
mobile or home download rate)."""
DEFAULT_UPLINK = "5Mbit/s"
"""A class's link device -> server when its ``uplink`` is not given (upload rates are
a quarter of download rates on typical mobile and home links)."""

RENAMED = {
    "rounds": "num-server-rounds",
    "fraction": "fraction-train",
    "local_steps": "local-steps",
    "eval_windows": "eval-windows",
    "workload.name": "workload",
    "workload.batch": "batch-size",
    "workload.seq": "seq-len",
    "workload.lr": "lr",
    "split.kind": "split",
    "split.alpha": "dirichlet-alpha",
}
"""Fleet-file names before the run config's (deprecated) -> the run-config key."""

_OLD_DEFAULTS = {"local-steps": 5, "split": "natural"}
"""The fleet-file defaults that differed from the run config's (warned when relied on)."""

_TOP = {"name", "description", "clients", "classes", "sources", "pretrain", *RUN_KEYS}
_CLASS = {
    "name",
    "share",
    "memory",
    "disk",
    "speed",
    "availability",
    "note",
    "uplink",
    "downlink",
}


class FleetError(ValueError):
    """A fleet file that cannot describe a fleet; the message names field and value."""


@dataclass(frozen=True)
class DeviceClass:
    """One kind of device in a fleet."""

    name: str
    share: float  # of the fleet's devices
    memory: tuple[int, ...]  # fixed: (bytes,); range: (min, max), uniform per
    #   device; choices: the sizes, drawn with ``weights``
    weights: tuple[float, ...] = ()  # choices only, summing to 1
    disk_bytes: int = 0
    speed: float = 1.0  # relative compute speed
    availability: float = 1.0  # probability of being online in a round
    memory_kind: str = "fixed"  # fixed | range | choices
    downlink_bytes_per_s: float = 2.5e6  # server -> device (DEFAULT_DOWNLINK)
    uplink_bytes_per_s: float = 6.25e5  # device -> server (DEFAULT_UPLINK)

    @property
    def budget_range(self) -> tuple[int, int]:
        return min(self.memory), max(self.memory)


@dataclass(frozen=True)
class Fleet:
    """A validated fleet description, with every device drawn."""

    name: str
    classes: tuple[DeviceClass, ...]
    clients: int
    shape: RunShape  # [workload] [local-steps] [lr] [seed] [split] [dirichlet-alpha]
    #   [batch-size] [seq-len] as the file sets them (the run config's defaults)
    num_server_rounds: int = _SERVER.num_server_rounds  # [num-server-rounds]
    fraction_train: float = _SERVER.fraction_train  # [fraction-train] share of the
    #   online devices sampled per round
    eval_windows: int = _SERVER.eval_windows  # [eval-windows] language models:
    #   held-out windows per round
    round_deadline_s: float = _SERVER.round_deadline_s  # [round-deadline] simulated
    #   seconds a device's round may take (server/simtime.py); 0: none
    pretrain: Pretrain | None = None  # [pretrain]: None trains from scratch
    adapters: AdapterConfig = field(default_factory=AdapterConfig)  # [adapters]
    #   [lora-rank] [lora-alpha] [lora-targets] [lora-base-dtype]: fleetfit's LoRA
    #   adapters (the variants of simulations.compare set the mode)
    description: str = ""
    file: str = ""
    partition_class: tuple[int, ...] = field(default=())  # class index per device
    budgets: tuple[int, ...] = field(default=())  # memory budget per device, bytes

    def fleet_config(self) -> FleetConfig:
        """Every device's memory, disk, speed and availability by partition id, and
        its class where the split is natural (the run config's ``fleet-*`` lists)."""
        per = [self.classes[k] for k in self.partition_class]
        return FleetConfig(
            memory_budgets=self.budgets,
            disk_budgets=tuple(c.disk_bytes for c in per),
            speeds=tuple(c.speed for c in per),
            availability=tuple(c.availability for c in per),
            downlinks=tuple(c.downlink_bytes_per_s for c in per),
            uplinks=tuple(c.uplink_bytes_per_s for c in per),
            classes=self.partition_class if self.shape.split == "natural" else (),
        )

    def class_counts(self) -> list[int]:
        return [self.partition_class.count(i) for i in range(len(self.classes))]

    def describe(self) -> dict[str, Any]:
        """The fleet as the comparison summary records it."""
        counts = self.class_counts()
        classes = []
        for i, c in enumerate(self.classes):
            mine = [b for b, k in zip(self.budgets, self.partition_class) if k == i]
            classes.append(
                {
                    "name": c.name,
                    "share": c.share,
                    "clients": counts[i],
                    "budget_min_bytes": min(mine),
                    "budget_max_bytes": max(mine),
                    "disk_bytes": c.disk_bytes,
                    "speed": c.speed,
                    "availability": c.availability,
                    "downlink_bytes_per_s": c.downlink_bytes_per_s,
                    "uplink_bytes_per_s": c.uplink_bytes_per_s,
                }
            )
        return {
            "name": self.name,
            "file": self.file,
            "workload": self.shape.workload,
            "clients": self.clients,
            "rounds": self.num_server_rounds,
            "fraction": self.fraction_train,
            "local_steps": self.shape.local_steps,
            "seed": self.shape.seed,
            "split": self.shape.split,
            "round_deadline_s": self.round_deadline_s,
            "pretrain": self.pretrain.describe() if self.pretrain else None,
            "classes": classes,
            "partition_class": [self.classes[k].name for k in self.partition_class],
        }


def shipped_fleet(name: str) -> Path:
    """The path of a shipped fleet by name (``phones``), or ``name`` itself."""
    path = Path(name)
    if path.suffix == ".toml" or path.exists():
        return path
    shipped = FLEETS_DIR / f"{name}.toml"
    if shipped.exists():
        return shipped
    names = sorted(p.stem for p in FLEETS_DIR.glob("*.toml"))
    raise FleetError(
        f"fleet {name!r} is neither a file nor a shipped fleet: give a path to a "
        f".toml file or one of {', '.join(names)}"
    )


def load_fleet(source: str | Path, **overrides: Any) -> Fleet:
    """Read and validate a fleet file (a path, or a shipped fleet's name).

    ``overrides`` replace settings after reading, by their run-config key in Python
    spelling (``clients=1000``, ``num_server_rounds=3``, ``fraction_train=0.01``,
    ``local_steps``, ``seed``, ``lr``, ...; ``None`` keeps the file's), and are
    validated the same way.

    Raises:
        FleetError: the file is missing or not TOML, or a field is unknown, missing or
            out of range (the message names it and its value).
    """
    path = shipped_fleet(str(source))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FleetError(f"fleet file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise FleetError(
            f"fleet file {str(path)!r} is not UTF-8 text (byte {e.start}: "
            f"{e.object[e.start : e.start + 1]!r}); save it as UTF-8 TOML"
        ) from None
    except OSError as e:  # a folder, no permission
        raise FleetError(
            f"fleet file {str(path)!r} cannot be read ({e.strerror or e}); give a "
            "readable .toml file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise FleetError(f"fleet file {str(path)!r} is not valid TOML: {e}") from None
    return parse_fleet(data, file=str(path), **overrides)


def parse_fleet(data: dict[str, Any], file: str = "", **overrides: Any) -> Fleet:
    """Validate a fleet given as a dict (the TOML's content); ``overrides`` as in
    ``load_fleet``."""
    where = f"fleet {file!r}: " if file else "fleet: "

    def fail(msg: str) -> FleetError:
        return FleetError(where + msg)

    data = _renamed(data, where, fail)
    data.update({k.replace("_", "-"): v for k, v in overrides.items() if v is not None})
    _unknown(data, _TOP, "", fail)
    for key, old in _OLD_DEFAULTS.items():
        if key not in data:
            log.warning(
                "%s%s is not set: it is the run config's default, %s (fleet files "
                "had %s before); write %s = %s to keep that",
                where,
                key,
                json.dumps(getattr(_SERVER.shape, key.replace("-", "_"))),
                json.dumps(old),
                key,
                json.dumps(old),
            )
    name = _text(data.get("name", Path(file).stem or "fleet"), "name", fail)
    clients = _int(data.get("clients"), "clients", 1, fail)
    # The run settings: ServerConfig's own parser and checks, its defaults.
    try:
        run = from_flat(
            ServerConfig,
            {k: data[k] for k in RUN_KEYS if k in data},
            what=where.rstrip(" "),
        )
        run.validate(what=where.rstrip(" "))
    except ValueError as e:
        raise FleetError(str(e)) from None
    shape = run.shape
    if shape.seed < 0:
        raise fail(f"seed = {shape.seed!r} must be an integer >= 0")
    pretrain = None
    if "pretrain" in data:
        pretrain = parse_pretrain(data["pretrain"], shape, fail)
        shape = replace(shape, public_share=pretrain.share)

    raw_classes = data.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise fail(
            "classes is missing: give at least one [[classes]] table with name, "
            "share and memory"
        )
    classes = tuple(_device_class(c, i, fail) for i, c in enumerate(raw_classes))
    names = [c.name for c in classes]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise fail(f"classes.name {sorted(dup)[0]!r} is used twice: names must differ")
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > 1e-6:
        raise fail(
            f"classes' shares sum to {total:.6g}, not 1: fix the share fields "
            f"({', '.join(f'{c.name}={c.share:g}' for c in classes)})"
        )
    if clients < len(classes):
        raise fail(
            f"clients = {clients} is fewer than the {len(classes)} classes: every "
            "class needs a device"
        )
    counts = _apportion([c.share for c in classes], clients)
    partition_class = tuple(i for i, n in enumerate(counts) for _ in range(n))
    rng = np.random.default_rng([shape.seed, 17])
    budgets = tuple(_draw(classes[k], rng) for k in partition_class)
    return Fleet(
        name=name,
        classes=classes,
        clients=clients,
        shape=shape,
        num_server_rounds=run.num_server_rounds,
        fraction_train=run.fraction_train,
        eval_windows=run.eval_windows,
        round_deadline_s=run.round_deadline_s,
        pretrain=pretrain,
        adapters=run.adapters,
        description=str(data.get("description", "")),
        file=file,
        partition_class=partition_class,
        budgets=budgets,
    )


def _renamed(data: dict[str, Any], where: str, fail: Any) -> dict[str, Any]:
    """``data`` with the deprecated names (``RENAMED``) as their run-config keys, a
    warning for each; the ``[workload]`` and ``[split]`` tables become top-level
    keys."""
    out = dict(data)
    old: dict[str, Any] = {}
    for table in ("workload", "split"):
        sub = out.get(table)
        if isinstance(sub, dict):  # a string is the run config's own form
            del out[table]
            known = {k.partition(".")[2] for k in RENAMED if k.startswith(table + ".")}
            _unknown(sub, known, f"{table}.", fail)
            old.update({f"{table}.{k}": v for k, v in sub.items()})
    old.update({k: out.pop(k) for k in list(out) if k in RENAMED})
    for name, value in old.items():
        key = RENAMED[name]
        if key in out:
            raise fail(
                f"{name} and {key} are the same setting: keep {key} only (the run "
                "config's name)"
            )
        out[key] = value
        log.warning(
            "%s%s is deprecated: write %s = %s at the top level (the run config's "
            "name)",
            where,
            name,
            key,
            json.dumps(value),
        )
    return out


def _device_class(raw: Any, i: int, fail: Any) -> DeviceClass:
    if not isinstance(raw, dict):
        raise fail(f"classes[{i}] = {raw!r} must be a table ([[classes]])")
    _unknown(raw, _CLASS, f"classes[{i}].", fail)
    name = _text(raw.get("name"), f"classes[{i}].name", fail)
    at = f"classes[{i}] ({name})."
    share = _float(raw.get("share"), at + "share", fail)
    if not 0 < share <= 1:
        raise fail(f"{at}share = {share!r} must be in (0, 1]")
    memory = raw.get("memory")
    weights: tuple[float, ...] = ()
    mem: tuple[int, ...]
    if isinstance(memory, str | int) and not isinstance(memory, bool):
        mem, mkind = (_size(memory, at + "memory", fail),), "fixed"
    elif isinstance(memory, dict) and set(memory) == {"min", "max"}:
        lo = _size(memory["min"], at + "memory.min", fail)
        hi = _size(memory["max"], at + "memory.max", fail)
        if lo > hi:
            raise fail(
                f"{at}memory: min {memory['min']!r} is above max {memory['max']!r}"
            )
        mem, mkind = (lo, hi), "range"
    elif isinstance(memory, dict) and set(memory) in (
        {"choices"},
        {"choices", "weights"},
    ):
        choices = memory["choices"]
        if not isinstance(choices, list) or not choices:
            raise fail(f"{at}memory.choices = {choices!r} must be a non-empty list")
        sizes = tuple(_size(c, at + "memory.choices", fail) for c in choices)
        weights = memory.get("weights", [1.0] * len(sizes))
        if (
            not isinstance(weights, list)
            or len(weights) != len(sizes)
            or any(
                isinstance(w, bool) or not isinstance(w, int | float) for w in weights
            )
            or any(not (w >= 0 and math.isfinite(w)) for w in weights)
            or not sum(weights) > 0
        ):
            raise fail(
                f"{at}memory.weights = {weights!r} must be {len(sizes)} numbers >= 0 "
                "with a positive sum"
            )
        total = float(sum(weights))
        weights = tuple(float(w) / total for w in weights)
        mem, mkind = sizes, "choices"
    else:
        raise fail(
            f"{at}memory = {memory!r} must be a size ('512MB'), {{min = ..., max = ...}} "
            "or {choices = [...], weights = [...]}"
        )
    disk = _size(raw.get("disk", "0"), at + "disk", fail, allow_zero=True)
    speed = _float(raw.get("speed", 1.0), at + "speed", fail)
    if not speed > 0:
        raise fail(f"{at}speed = {speed!r} must be > 0 (1: this machine's speed)")
    avail = _float(raw.get("availability", 1.0), at + "availability", fail)
    if not 0 < avail <= 1:
        raise fail(f"{at}availability = {avail!r} must be in (0, 1]")
    down = _rate(raw.get("downlink", DEFAULT_DOWNLINK), at + "downlink", fail)
    up = _rate(raw.get("uplink", DEFAULT_UPLINK), at + "uplink", fail)
    return DeviceClass(name, share, mem, weights, disk, speed, avail, mkind, down, up)


def _draw(c: DeviceClass, rng: np.random.Generator) -> int:
    if c.memory_kind == "choices":
        return c.memory[int(rng.choice(len(c.memory), p=np.asarray(c.weights)))]
    if c.memory_kind == "fixed":
        return c.memory[0]
    lo, hi = c.memory
    return int(rng.integers(lo, hi + 1))


def _apportion(shares: list[float], n: int) -> list[int]:
    """``n`` devices over the shares: largest remainder, at least one per class."""
    raw = [s * n for s in shares]
    counts = [max(1, math.floor(r)) for r in raw]
    while sum(counts) < n:  # the next device to the class furthest below its share
        counts[max(range(len(counts)), key=lambda i: (raw[i] - counts[i], -i))] += 1
    while sum(counts) > n:  # the at-least-one rule overshot: take from the largest
        big = max(
            (i for i in range(len(counts)) if counts[i] > 1),
            key=lambda i: (counts[i] - raw[i], counts[i]),
        )
        counts[big] -= 1
    return counts


def _unknown(table: dict[str, Any], known: set[str], prefix: str, fail: Any) -> None:
    extra = sorted(set(table) - known)
    if extra:
        raise fail(
            f"unknown field {prefix}{extra[0]} = {table[extra[0]]!r}: known fields "
            f"are {', '.join(prefix + k for k in sorted(known))}"
        )


def _text(value: Any, key: str, fail: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise fail(f"{key} = {value!r} must be a non-empty string")
    return value.strip()


def _int(value: Any, key: str, low: int, fail: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise fail(f"{key} = {value!r} must be an integer >= {low}")
    return value


def _float(value: Any, key: str, fail: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(f"{key} = {value!r} must be a number")
    if not math.isfinite(value):
        raise fail(f"{key} = {value!r} must be finite")
    return float(value)


_BITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def _rate(value: Any, key: str, fail: Any) -> float:
    """A link speed in bytes/s: a number (bytes/s), or a string with its unit,
    ``"5Mbit/s"`` (bits, decimal prefixes) or ``"1.5MB/s"``, ``"512KiB/s"``
    (bytes)."""
    fix = "give a rate such as '5Mbit/s' or '1MB/s' (or bytes/s as a number)"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise fail(f"{key} = {value!r} is not a rate: {fix}")
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if not text.lower().endswith("/s"):
            raise fail(f"{key} = {value!r} has no '/s': {fix}")
        amount = text[:-2]
        unit = amount.lstrip("0123456789.eE+-").lower()
        number = amount[: len(amount) - len(unit)]
        try:
            if unit in _BITS:
                rate = float(number) * _BITS[unit] / 8
            else:
                rate = float(parse_bytes(amount, what=key))
        except (ValueError, MemoryPlanError):
            raise fail(f"{key} = {value!r} is not a rate: {fix}") from None
    else:
        rate = float(value)
    if not (rate > 0 and math.isfinite(rate)):
        raise fail(f"{key} = {value!r} must be a rate > 0: {fix}")
    return rate


def _size(value: Any, key: str, fail: Any, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise fail(f"{key} = {value!r} must be a size such as '512MB'")
    if (
        isinstance(value, int)
        and value < 0
        or isinstance(value, str)
        and value.strip().startswith("-")
    ):
        raise fail(
            f"{key} = {value!r} is negative: budgets are sizes >= 0, e.g. '512MB'"
        )
    try:
        return parse_bytes(str(value), what=key, allow_zero=allow_zero)
    except MemoryPlanError as e:
        raise fail(str(e)) from None
