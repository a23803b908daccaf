"""1,000 virtual clients on one machine: rounds per minute and peak memory.

Runs ``fleetfit simulate`` (Flower's simulation engine on Ray) as a child process with
``--clients 1000 --fraction 0.01`` and samples the resident memory of that process and
of everything it starts (Ray's GCS, raylet and worker processes) every 0.2 s; the table
gives the largest sum seen, the largest single process, and the rounds per minute
(from the run's own per-round times, discovery of the 1,000 nodes in round 1 apart).

    python benchmarks/fleet_scale.py                 # 1,000 clients, 5 rounds
    python benchmarks/fleet_scale.py --clients 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (empty when it is gone)."""
    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return set()


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` now (``VmRSS``), bytes; 0 when it is gone."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
        f"RAM, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--local-steps", type=int, default=5)
    ap.add_argument("--workload", default="digits-cnn")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    out = Path(tempfile.mkdtemp(prefix="fleetfit-scale-"))
    cmd = [
        sys.executable,
        "-m",
        "fleetfit.cli",
        "simulate",
        "--workload",
        args.workload,
        "--clients",
        str(args.clients),
        "--fraction",
        str(args.fraction),
        "--rounds",
        str(args.rounds),
        "--local-steps",
        str(args.local_steps),
        "--out",
        str(out / "run"),
    ]
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    log = open(out / "simulate.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
    peak_total = peak_single = 0
    most = 0
    while proc.poll() is None:
        pids = {proc.pid} | descendants(proc.pid)
        sizes = [rss_bytes(p) for p in pids]
        peak_total = max(peak_total, sum(sizes))
        peak_single = max(peak_single, max(sizes, default=0))
        most = max(most, len(pids))
        time.sleep(0.2)
    wall = time.monotonic() - t0
    log.close()
    if proc.returncode != 0:
        print((out / "simulate.log").read_text()[-3000:])
        print(f"simulate failed (exit {proc.returncode}); log: {out}/simulate.log")
        return 1
    summary = json.loads((out / "run" / "summary.json").read_text())
    rounds = summary["rounds"]
    later = [r["round_s"] for r in rounds[1:]] or [rounds[0]["round_s"]]
    per_min = 60.0 / (sum(later) / len(later))
    sampled = [r["num_sampled"] for r in rounds]
    rows = [
        ("virtual clients", f"{args.clients}"),
        ("sampled per round", f"{min(sampled)}-{max(sampled)}"),
        ("rounds", f"{len(rounds)}"),
        ("round 1 (discovery of every node), s", f"{rounds[0]['round_s']:.1f}"),
        ("rounds per minute after round 1", f"{per_min:.1f}"),
        ("wall time, s", f"{wall:.1f}"),
        ("final accuracy", f"{rounds[-1]['accuracy']:.4f}"),
        ("peak RSS, all processes together, MiB", f"{peak_total / 2**20:.0f}"),
        ("peak RSS, largest process, MiB", f"{peak_single / 2**20:.0f}"),
        ("processes at most", f"{most}"),
    ]
    print(f"# fleet scale: {args.workload}; machine: {machine()}")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
