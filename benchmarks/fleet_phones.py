"""The phone fleet: fleetfit against ``exclude`` and ``smallest-model``.

Same fleet (simulations/fleets/phones.toml), rounds, split and seed for the three;
one run of ``simulations.compare.compare`` on Flower's simulation engine. Prints the
comparison table, the final metric on the data of the classes that ``exclude`` leaves
out, the targets and whether each was reached, and the machine.

Targets (issue 5): fleetfit has 100% of sampled devices contributing and a better
final metric than both baselines, overall and on the data of the classes that
``exclude`` leaves out.

    python benchmarks/fleet_phones.py                    # the shipped defaults
    python benchmarks/fleet_phones.py --rounds 6 --out runs/phones-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from simulations.compare import compare  # noqa: E402
from simulations.fleet import load_fleet  # noqa: E402
from simulations.report import format_table  # noqa: E402


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
        f"RAM, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def better(metric: str, a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return a > b if metric == "accuracy" else a < b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", default="phones")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--local-steps", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    fleet = load_fleet(
        args.fleet,
        num_server_rounds=args.rounds,
        clients=args.clients,
        local_steps=args.local_steps,
    )
    out = Path(args.out or tempfile.mkdtemp(prefix="fleetfit-phones-"))
    t0 = time.monotonic()
    result = compare(fleet, ["fleetfit", "exclude", "smallest-model"], out)
    wall = time.monotonic() - t0
    s = result["strategies"]
    metric = result["metric_name"]
    left_out = [
        name
        for name, c in s["exclude"]["classes"].items()
        if c["participation"] is not None and c["participation"] == 0.0
    ]
    print(
        f"# fleet {fleet.name}: {fleet.clients} devices, {fleet.shape.workload}, "
        f"{fleet.num_server_rounds} rounds x {fleet.shape.local_steps} local steps, fraction "
        f"{fleet.fraction_train}, seed {fleet.shape.seed}"
    )
    print(f"# machine: {machine()}; compare wall time {wall:.0f} s\n")
    print(format_table(result))
    print(
        f"\n{metric} of the final model on the data of the classes exclude leaves out"
    )
    rows = []
    for cls in left_out:
        vals = {n: s[n]["classes"][cls]["metric"] for n in s}
        rows.append((cls, vals))
        print(
            f"  {cls:>8}: "
            + "  ".join(
                f"{n} {v:.3f}" if v is not None else f"{n} -" for n, v in vals.items()
            )
        )
    ff = s["fleetfit"]
    checks = [
        ("fleetfit: 100% of sampled devices contribute", ff["participation"] == 1.0),
        (
            f"fleetfit final {metric} better than exclude",
            better(metric, ff["final_metric"], s["exclude"]["final_metric"]),
        ),
        (
            f"fleetfit final {metric} better than smallest-model",
            better(metric, ff["final_metric"], s["smallest-model"]["final_metric"]),
        ),
    ]
    for cls, vals in rows:
        checks.append(
            (
                f"on class {cls}'s data, fleetfit better than both",
                better(metric, vals["fleetfit"], vals["exclude"])
                and better(metric, vals["fleetfit"], vals["smallest-model"]),
            )
        )
    print("\ntargets")
    for what, ok in checks:
        print(f"  {'met   ' if ok else 'MISSED'}  {what}")
    print(f"\nrun folders and report: {out}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "wall_s": wall,
                    "table": format_table(result),
                    "checks": dict(checks),
                    "left_out": {c: v for c, v in rows},
                    "summary": {
                        n: {k: v for k, v in e.items() if k != "rounds"}
                        for n, e in s.items()
                    },
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
