"""A CPU fleet on one Linux machine: hosts as network namespaces, links shaped by tc,
device speed limited by CPU quotas. Needs root (``ip netns``, ``tc``, cgroups).

Topology: a bridge ``ffbr0`` in the root namespace; each host is a namespace
``ff-<i>`` joined to the bridge by a veth pair, address ``10.77.0.<10+i>/24``. Both
ends of every veth carry a ``tbf`` qdisc at the host's link rate, so traffic between
two hosts is shaped in each direction (netem is not available on this kernel: latency
is only the real stack's). Speed: each rank's process is put in its own cgroup with a
CFS quota (``cpu.cfs_quota_us`` on cgroup v1, ``cpu.max`` on v2) of ``cpu_share`` of
one core per 10 ms period; ``torch`` runs one thread. Not taskset: with fewer cores
than ranks, pinning cannot give unequal fractions of a core.

``with Fleet(hosts) as fleet: fleet.run_ranks(...)`` sets it all up and always
tears it down (namespaces, bridge, cgroups), also after errors; ``cleanup()`` removes
leftovers of an earlier, killed run.

Example (as root)::

    with Fleet([HostSpec("fast0", 0.6, 20e6), HostSpec("slow0", 0.2, 20e6)]) as f:
        results = f.run_ranks(plan_file, "gpt-tiny", out_dir, steps=5)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BRIDGE = "ffbr0"
PREFIX = "ff-"
SUBNET = "10.77.0"
PERIOD_US = 10_000  # CFS period: short, so a small share is not one long stall


@dataclass(frozen=True)
class HostSpec:
    """One emulated host: a name, its share of one core, its link rate (bytes/s)."""

    name: str
    cpu_share: float
    bandwidth_bytes_per_s: float


def available() -> str | None:
    """None when a fleet can be made here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc and cgroups)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if _cgroup_root() is None:
        return "no writable cgroup cpu controller (v1 cpu or v2 cpu.max)"
    return None


def _cgroup_root() -> tuple[Path, str] | None:
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (
        v2 / "cgroup.controllers"
    ).read_text().split():
        return v2, "v2"
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, "v1"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


def cleanup() -> None:
    """Remove every namespace, the bridge and the cgroups a fleet made."""
    r = _sh("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX):
            _sh("ip", "netns", "del", name, check=False)
    _sh("ip", "link", "del", BRIDGE, check=False)
    # a namespace's veth pair goes away asynchronously after `ip netns del`: remove
    # the outer ends and wait, or the next fleet's `ip link add ffv0` finds it there
    deadline = time.monotonic() + 10.0
    while True:
        r = _sh("ip", "-o", "link", "show", check=False)
        left = [
            line.split(":")[1].strip().split("@")[0]
            for line in r.stdout.splitlines()
            if line.count(":") >= 2 and line.split(":")[1].strip().startswith("ffv")
        ]
        if not left or time.monotonic() > deadline:
            break
        for dev in left:
            _sh("ip", "link", "del", dev, check=False)
        time.sleep(0.1)
    root = _cgroup_root()
    if root is not None:
        for d in root[0].glob(f"{PREFIX}*"):
            try:
                d.rmdir()
            except OSError:
                pass


def _tbf(dev: str, rate_bytes_per_s: float, ns: str | None = None) -> None:
    bits = int(rate_bytes_per_s * 8)
    # burst >= rate / HZ (250) and at least a few full frames
    burst = max(int(rate_bytes_per_s / 250), 32 * 1024)
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit"]
    cmd += ["burst", str(burst), "latency", "100ms"]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    _sh(*cmd)


class Fleet:
    """Namespaces, shaped veth links and CPU quotas for a list of hosts."""

    def __init__(self, hosts: list[HostSpec]) -> None:
        if not 1 <= len(hosts) <= 200:
            raise ValueError(f"a fleet has 1 to 200 hosts, got {len(hosts)}")
        self.hosts = hosts
        self.procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def namespace(self, i: int) -> str:
        return f"{PREFIX}{i}"

    def __enter__(self) -> Fleet:
        why = available()
        if why:
            raise RuntimeError(f"cannot build a namespace fleet here: {why}")
        cleanup()
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _up(self) -> None:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        root, kind = _cgroup_root() or (None, "")
        for i, h in enumerate(self.hosts):
            ns, outer = self.namespace(i), f"ffv{i}"
            _sh("ip", "netns", "add", ns)
            _sh(
                "ip",
                "link",
                "add",
                outer,
                "type",
                "veth",
                "peer",
                "name",
                "ffeth0",
                "netns",
                ns,
            )
            _sh("ip", "link", "set", outer, "master", BRIDGE)
            _sh("ip", "link", "set", outer, "up")
            x = ["ip", "netns", "exec", ns]
            _sh(*x, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "ffeth0")
            _sh(*x, "ip", "link", "set", "ffeth0", "up")
            _sh(*x, "ip", "link", "set", "lo", "up")
            _tbf(outer, h.bandwidth_bytes_per_s)
            _tbf("ffeth0", h.bandwidth_bytes_per_s, ns)
            assert root is not None
            cg = root / f"{PREFIX}{i}"
            cg.mkdir(exist_ok=True)
            quota = max(1000, int(h.cpu_share * PERIOD_US))
            if kind == "v2":
                (cg / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (cg / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (cg / "cpu.cfs_quota_us").write_text(str(quota))

    def close(self) -> None:
        """Kill the ranks this fleet started, then remove everything it made."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()
        cleanup()

    def _inside(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as a command that runs in host ``i``'s cgroup and namespace."""
        root, _ = _cgroup_root() or (None, "")
        assert root is not None
        cg = root / f"{PREFIX}{i}" / "cgroup.procs"
        script = 'echo $$ > "$0" && exec ip netns exec "$1" "${@:2}"'
        return ["bash", "-c", script, str(cg), self.namespace(i), *argv]

    def run_on_all(self, argv: list[str], *, timeout_s: float = 300.0) -> list[str]:
        """Run ``argv`` on every host at once (each in its namespace and CPU quota,
        as the ranks will run); each host's standard output, in host order.

        For probes: what a host really delivers under its quota, measured where and
        beside whom the ranks will run (a CFS quota gives less than its share).
        """
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(
                [
                    str(Path(__file__).resolve().parents[1]),
                    os.getcwd(),
                    env.get("PYTHONPATH", ""),
                ]
            ),
        )
        procs = [
            subprocess.Popen(
                self._inside(i, argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for i in range(len(self.hosts))
        ]
        self.procs = list(procs)  # killed by close() on an error
        outs = []
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{argv[:3]} on host {i} passed {timeout_s} s"
                ) from None
            if p.returncode != 0:
                raise RuntimeError(
                    f"{argv[:3]} on host {i} exited with {p.returncode}:\n{err[-2000:]}"
                )
            outs.append(out)
        return outs

    def run_ranks(
        self,
        plan_file: str | Path,
        workload: str,
        out: str | Path,
        *,
        steps: int = 5,
        port: int = 29611,
        timeout_s: float = 900.0,
        extra: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Start rank i in host i's namespace and cgroup; wait; read the results."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        repo = str(Path(__file__).resolve().parents[1])
        n = len(self.hosts)
        self.procs = []
        for i in range(n):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR=self.address(0),
                MASTER_PORT=str(port),
                RANK=str(i),
                WORLD_SIZE=str(n),
                LOCAL_RANK="0",
                GLOO_SOCKET_IFNAME="ffeth0",
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(
                    [repo, os.getcwd(), env.get("PYTHONPATH", "")]
                ),
            )
            worker = [
                sys.executable,
                "-m",
                "partition.runtime",
                "worker",
                f"--plan={plan_file}",
                f"--workload={workload}",
                f"--out={out}",
                f"--steps={steps}",
                "--threads=1",
                *(extra or []),
            ]
            cmd = self._inside(i, worker)
            log = open(out / f"rank{i}.log", "w")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(self.procs):
            left = max(1.0, deadline - time.monotonic())
            try:
                rc = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"rank {i} passed {timeout_s:.0f} s; see {out}"
                ) from None
            if rc != 0:
                tail = (out / f"rank{i}.log").read_text()[-2000:]
                raise RuntimeError(f"rank {i} exited with {rc}:\n{tail}")
        return [json.loads((out / f"rank{i}.json").read_text()) for i in range(n)]
