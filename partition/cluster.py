"""A cluster as data: hosts of devices (memory, compute rate) and the links between them.

A cluster file is TOML::

    name = "unequal-4"

    [network]                      # default link between two hosts
    bandwidth = "12.5MB/s"         # bytes/s, or bits with "bit/s" / "bps": "100Mbit/s"
    latency = "0.2ms"              # one-way, per message

    [[hosts]]
    name = "fast0"
    devices = 1                    # devices on this host (GPUs, or 1 for a CPU host)
    memory = "600MB"               # per device: what a stage may use above the baseline
    compute = "20GFLOP/s"          # per device; "probe" measures this machine's matmul rate
    # peak = "989TFLOP/s"          # optional: the hardware peak, for MFU (GPUs)
    # cpu_limit = 0.5              # optional: a CPU quota (a container's CPU limit,
    # cpu_period = "100ms"         #   cgroup cpu.max) in cores per period; see below

    [[links]]                      # optional overrides for one pair of hosts
    hosts = ["fast0", "slow0"]
    bandwidth = "5MB/s"
    latency = "1ms"

A host under a CPU quota (``cpu_limit``, cores granted per ``cpu_period``, default
100 ms as in cgroups and Kubernetes) runs each action at full speed while its quota
lasts and then waits for the next period. ``compute`` stays the host's sustained rate
under the limit (what a probe running on it measures); the simulator paces actions
with the quota (``partition.simulate.CpuQuota``): a short action after a wait finishes
sooner than the sustained rate says, one that outlasts the quota waits out periods.

Devices on one host talk over ``[network] intra_bandwidth`` / ``intra_latency``
(default 10 GB/s, 5 us). The same structure can be built in Python::

    Cluster.from_dict({"hosts": [{"name": "a", "memory": "1GB", "compute": 1e10}]})

Bad input fails with ``ClusterError`` naming the field and the value.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memory.errors import MemoryPlanError
from memory.sizes import format_bytes, parse_bytes


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names field and value."""


_RATE = re.compile(
    r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z/]*)\s*$"
)
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def _number(text: str, what: str, fix: str) -> tuple[float, str]:
    m = _RATE.match(text)
    if not m:
        raise ClusterError(f"cannot parse {what} {text!r}; {fix}")
    # float() of the whole literal: 10 ** int(exponent) would build a huge integer
    # for an exponent such as "1e999999999"; float() gives inf at once.
    value = float(f"{m.group(1)}e{m.group(2) or 0}")
    return value, m.group(3)


def _plain(text: int | float, what: str, fix: str) -> float:
    try:
        return float(text)
    except OverflowError:
        raise ClusterError(f"{what} {text!r} is too large; {fix}") from None


def parse_bandwidth(text: str | int | float, what: str = "bandwidth") -> float:
    """Bytes per second in ``"100MB/s"``, ``"1Gbit/s"``, ``"800Mbps"`` or a number."""
    fix = 'e.g. "100MB/s", "1Gbit/s" or a number of bytes per second'
    if isinstance(text, bool):
        raise ClusterError(f"{what} {text!r} is not a bandwidth; {fix}")
    if isinstance(text, int | float):
        value = _plain(text, what, fix)
    else:
        value, unit = _number(str(text), what, fix)
        u = unit.lower().removesuffix("/s").removesuffix("ps")
        if unit.lower().endswith("bps") or u.endswith("bit"):
            prefix, scale = u.removesuffix("bit").removesuffix("b"), 1 / 8
        elif u.endswith("b"):
            prefix, scale = u.removesuffix("b"), 1.0
        elif u == "":
            prefix, scale = "", 1.0
        else:
            raise ClusterError(f"cannot parse {what} {text!r}; {fix}")
        if prefix not in _SI:
            raise ClusterError(f"cannot parse {what} {text!r}; {fix}")
        value *= _SI[prefix] * scale
    if not (value > 0 and math.isfinite(value)):
        raise ClusterError(f"{what} must be positive, got {text!r}; {fix}")
    return value


def parse_seconds(text: str | int | float, what: str = "latency") -> float:
    """Seconds in ``"0.5ms"``, ``"20us"``, ``"1s"`` or a number of seconds."""
    fix = 'e.g. "0.5ms", "20us" or a number of seconds'
    if isinstance(text, bool):
        raise ClusterError(f"{what} {text!r} is not a time; {fix}")
    if isinstance(text, int | float):
        value = _plain(text, what, fix)
    else:
        value, unit = _number(str(text), what, fix)
        scale = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}.get(
            unit.lower()
        )
        if scale is None:
            raise ClusterError(f"cannot parse {what} {text!r}; {fix}")
        value *= scale
    if not (value >= 0 and math.isfinite(value)):
        raise ClusterError(f"{what} must be >= 0 seconds, got {text!r}; {fix}")
    return value


def parse_rate(text: str | int | float, what: str = "compute") -> float:
    """FLOP per second in ``"20GFLOP/s"``, ``"312TFLOPS"`` or a number."""
    fix = 'e.g. "20GFLOP/s", "312TFLOP/s", a number of FLOP/s, or "probe"'
    if isinstance(text, bool):
        raise ClusterError(f"{what} {text!r} is not a rate; {fix}")
    if isinstance(text, int | float):
        value = _plain(text, what, fix)
    else:
        value, unit = _number(str(text), what, fix)
        u = unit.lower().removesuffix("/s").removesuffix("s")
        if u.endswith("flop"):
            u = u.removesuffix("flop")
        if u not in _SI:
            raise ClusterError(f"cannot parse {what} {text!r}; {fix}")
        value *= _SI[u]
    if not (value > 0 and math.isfinite(value)):
        raise ClusterError(f"{what} must be positive, got {text!r}; {fix}")
    return value


@dataclass(frozen=True)
class Device:
    """One device: a CPU host or one accelerator.

    Attributes:
        name: ``host`` for a one-device host, ``host:i`` otherwise.
        host: the host it sits on.
        memory_bytes: what a stage may use on it (above the runtime's baseline), bytes.
        flops_per_s: its sustained training rate, FLOP/s (fp32 on CPU).
        peak_flops_per_s: its hardware peak, FLOP/s, for MFU (defaults to flops_per_s).
        cpu_limit: cores granted per ``cpu_period_s`` by a CPU quota, or None.
        cpu_period_s: the quota's period, seconds.
    """

    name: str
    host: str
    memory_bytes: int
    flops_per_s: float
    peak_flops_per_s: float
    cpu_limit: float | None = None
    cpu_period_s: float = 0.1


@dataclass(frozen=True)
class Link:
    """A link: bandwidth (bytes/s) and one-way latency (seconds) per message."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def transfer_s(self, nbytes: int | float) -> float:
        """Seconds to move ``nbytes`` in one message."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """Devices and the links between their hosts.

    Attributes:
        devices: every device, host by host.
        network: the default link between two hosts.
        intra: the link between two devices of one host.
        links: per host pair (sorted names) overrides.
        name: a label.
    """

    devices: tuple[Device, ...]
    network: Link = field(default_factory=lambda: Link(125e6, 2e-4))
    intra: Link = field(default_factory=lambda: Link(10e9, 5e-6))
    links: dict[tuple[str, str], Link] = field(default_factory=dict)
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not self.devices:
            raise ClusterError("a cluster needs at least one device (hosts = [])")
        names = [d.name for d in self.devices]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ClusterError(f"device names must be unique; repeated: {sorted(dup)}")

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(d.host for d in self.devices))

    def link(self, a: Device | int, b: Device | int) -> Link:
        """The link between two devices (by object or index)."""
        da = self.devices[a] if isinstance(a, int) else a
        db = self.devices[b] if isinstance(b, int) else b
        if da.host == db.host:
            return self.intra
        key = tuple(sorted((da.host, db.host)))
        return self.links.get(key, self.network)  # type: ignore[arg-type]

    def table(self) -> str:
        """One line per device, for people."""
        rows = [f"{'device':<14}{'host':<10}{'memory':>12}{'compute':>16}"]
        for d in self.devices:
            rows.append(
                f"{d.name:<14}{d.host:<10}{format_bytes(d.memory_bytes):>12}"
                f"{d.flops_per_s / 1e9:>11.1f} GF/s"
            )
        rows.append(
            f"network {self.network.bandwidth_bytes_per_s / 1e6:.1f} MB/s, "
            f"{self.network.latency_s * 1e3:.2f} ms"
            + (f"; {len(self.links)} link override(s)" if self.links else "")
        )
        return "\n".join(rows)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, probe: Any = None) -> Cluster:
        """A cluster from the TOML structure (see the module docstring).

        Args:
            d: the parsed file.
            probe: a function returning this machine's FLOP/s for ``compute =
                "probe"`` (default: ``memory.probes.measure_flops_per_s``).
        """
        if not isinstance(d, dict):
            raise ClusterError(f"a cluster is a table, got {type(d).__name__}")
        known = {"name", "network", "hosts", "links"}
        extra = sorted(set(d) - known)
        if extra:
            raise ClusterError(
                f"unknown cluster field(s) {extra}; known: {sorted(known)}"
            )
        net = d.get("network", {})
        if not isinstance(net, dict):
            raise ClusterError(f"network must be a table, got {net!r}")
        network = Link(
            parse_bandwidth(net.get("bandwidth", 125e6), "network.bandwidth"),
            parse_seconds(net.get("latency", 2e-4), "network.latency"),
        )
        intra = Link(
            parse_bandwidth(
                net.get("intra_bandwidth", 10e9), "network.intra_bandwidth"
            ),
            parse_seconds(net.get("intra_latency", 5e-6), "network.intra_latency"),
        )
        hosts = d.get("hosts")
        if not isinstance(hosts, list) or not hosts:
            raise ClusterError(
                "a cluster needs [[hosts]] entries, each with name, memory and compute"
            )
        devices: list[Device] = []
        seen: set[str] = set()
        probed: float | None = None
        for i, h in enumerate(hosts):
            where = f"hosts[{i}]"
            if not isinstance(h, dict):
                raise ClusterError(f"{where} must be a table, got {h!r}")
            bad = sorted(
                set(h)
                - {
                    "name",
                    "devices",
                    "memory",
                    "compute",
                    "peak",
                    "cpu_limit",
                    "cpu_period",
                }
            )
            if bad:
                raise ClusterError(f"{where}: unknown field(s) {bad}")
            name = h.get("name", f"host{i}")
            if not isinstance(name, str) or not name or name in seen:
                raise ClusterError(
                    f"{where}.name {name!r} must be a new, non-empty name"
                )
            seen.add(name)
            count = h.get("devices", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ClusterError(
                    f"{where}.devices must be an integer >= 1, got {count!r}"
                )
            if "memory" not in h:
                raise ClusterError(
                    f'{where} ({name}) needs memory, e.g. memory = "2GB"'
                )
            try:
                mem = parse_bytes(h["memory"], what=f"{where}.memory")
            except MemoryPlanError as e:
                raise ClusterError(str(e)) from None
            comp = h.get("compute")
            if comp is None:
                raise ClusterError(
                    f'{where} ({name}) needs compute, e.g. compute = "20GFLOP/s" or '
                    '"probe"'
                )
            if comp == "probe":
                if probed is None:
                    if probe is None:
                        from memory.probes import measure_flops_per_s

                        probe = measure_flops_per_s
                    probed = float(probe())
                rate = probed
            else:
                rate = parse_rate(comp, f"{where}.compute")
            peak = parse_rate(h["peak"], f"{where}.peak") if "peak" in h else rate
            limit = None
            if "cpu_limit" in h:
                v = h["cpu_limit"]
                if (
                    isinstance(v, bool)
                    or not isinstance(v, int | float)
                    or not (0 < v < math.inf)
                ):
                    raise ClusterError(
                        f"{where}.cpu_limit must be a positive number of cores, got "
                        f"{v!r}; e.g. cpu_limit = 0.5"
                    )
                limit = float(v)
            elif "cpu_period" in h:
                raise ClusterError(
                    f"{where} ({name}) has cpu_period but no cpu_limit; give both, "
                    'e.g. cpu_limit = 0.5, cpu_period = "100ms"'
                )
            period = parse_seconds(h.get("cpu_period", 0.1), f"{where}.cpu_period")
            if period <= 0:
                raise ClusterError(
                    f"{where}.cpu_period must be > 0, got {h['cpu_period']!r}; "
                    'e.g. cpu_period = "100ms"'
                )
            for j in range(count):
                dname = name if count == 1 else f"{name}:{j}"
                devices.append(Device(dname, name, mem, rate, peak, limit, period))
        links: dict[tuple[str, str], Link] = {}
        raw_links = d.get("links", [])
        if not isinstance(raw_links, list):
            raise ClusterError(
                f"links must be a list of [[links]] tables, got {raw_links!r}"
            )
        for i, lk in enumerate(raw_links):
            where = f"links[{i}]"
            pair = lk.get("hosts") if isinstance(lk, dict) else None
            if not isinstance(pair, list) or len(pair) != 2:
                raise ClusterError(f"{where}.hosts must name two hosts, got {pair!r}")
            for hname in pair:
                if not isinstance(hname, str) or hname not in seen:
                    raise ClusterError(
                        f"{where}.hosts names unknown host {hname!r}; hosts: {sorted(seen)}"
                    )
            key = (min(pair), max(pair))
            links[key] = Link(
                parse_bandwidth(
                    lk.get("bandwidth", network.bandwidth_bytes_per_s),
                    f"{where}.bandwidth",
                ),
                parse_seconds(lk.get("latency", network.latency_s), f"{where}.latency"),
            )
        return cls(tuple(devices), network, intra, links, str(d.get("name", "cluster")))

    @classmethod
    def uniform(
        cls,
        num_hosts: int,
        *,
        memory: str | int,
        compute: str | float,
        devices_per_host: int = 1,
        bandwidth: str | float = "125MB/s",
        latency: str | float = "0.2ms",
        intra_bandwidth: str | float = "10GB/s",
        peak: str | float | None = None,
        name: str = "uniform",
    ) -> Cluster:
        """``num_hosts`` equal hosts (e.g. 8 x 8 GPUs)."""
        host: dict[str, Any] = {
            "devices": devices_per_host,
            "memory": memory,
            "compute": compute,
        }
        if peak is not None:
            host["peak"] = peak
        return cls.from_dict(
            {
                "name": name,
                "network": {
                    "bandwidth": bandwidth,
                    "latency": latency,
                    "intra_bandwidth": intra_bandwidth,
                },
                "hosts": [dict(host, name=f"h{i}") for i in range(num_hosts)],
            }
        )


def load_cluster(path: str | Path, *, probe: Any = None) -> Cluster:
    """Read a cluster TOML file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cluster file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ClusterError(f"cluster file {str(p)!r} is not valid TOML: {e}") from None
    data.setdefault("name", p.stem)
    return Cluster.from_dict(data, probe=probe)
