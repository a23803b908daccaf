"""Memory plans for GPT-2 small (124M parameters, AdamW, fp32) on this CPU.

Rows: plain torch; full activation recompute (every block recomputed, all state
resident); fleetfit's planner at budgets equal to plain's measured peak, 2 GiB, 1 GiB and
512 MiB. Each row trains the same batches from the same initial weights in a fresh,
measured child process (peak RSS above the import baseline; see docs/memory.md) and
reports predicted peak, measured peak, step time (median after the first step) and the
ratio to plain's step time, measured side by side in one run.

    python benchmarks/memory_gpt2.py                       # batch 4 x 512, 3 steps
    python benchmarks/memory_gpt2.py --workload gpt-byte --batch 8 --seq 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from memory.cost import predict
from memory.errors import BudgetError, MeasurementError
from memory.plan import plan_memory
from memory.profile import loading_from_file
from memory.sizes import format_bytes, parse_bytes
from memory.spec import BlockPlan, MemoryPlan
from partition.run import measured_run, profile_workload
from workloads import get_workload


def machine() -> str:
    load = os.getloadavg()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {load:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="gpt2-small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--budgets",
        default="plain,2GiB,1GiB,512MiB",
        help="comma-separated budgets; 'plain' = plain's measured peak",
    )
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)

    wl = get_workload(args.workload, batch_size=args.batch, seq_len=args.seq)
    print(
        f"{wl.name}: batch {wl.batch_size} x {wl.seq_len}, {args.steps} steps, "
        f"AdamW fp32",
        file=sys.stderr,
    )
    base = profile_workload(wl, offload_dir=args.offload_dir)
    profile = loading_from_file(base)
    names = [b.name for b in base.blocks]
    rows: list[dict] = []

    def measure(label: str, plan: MemoryPlan | None, predicted: int) -> dict:
        t0 = time.time()
        m, r = measured_run(
            wl.name,
            plan,
            steps=args.steps,
            batch_size=wl.batch_size,
            seq_len=wl.seq_len,
            offload_dir=args.offload_dir,
        )
        row = {
            "row": label,
            "predicted_peak_bytes": predicted,
            "measured_peak_bytes": m.peak_bytes,
            "baseline_bytes": m.baseline_bytes,
            "step_s": r["step_s"],
            "losses": r["losses"],
            "plan": None if plan is None else _code(plan),
        }
        rows.append(row)
        print(
            f"  {label}: measured {format_bytes(m.peak_bytes)}, step "
            f"{r['step_s']:.2f} s ({time.time() - t0:.0f} s)",
            file=sys.stderr,
        )
        return row

    plain = measure(
        "plain torch", None, predict(base, MemoryPlan.plain(names)).peak_bytes
    )
    full = MemoryPlan(tuple(BlockPlan(n, "recompute") for n in names))
    measure("full recompute", full, predict(profile, full).peak_bytes)
    for b in args.budgets.split(","):
        budget = plain["measured_peak_bytes"] if b == "plain" else parse_bytes(b)
        label = f"fleetfit @ {'plain peak' if b == 'plain' else b}"
        try:
            plan = plan_memory(profile, budget, batch_size=wl.batch_size)
        except BudgetError as e:
            rows.append(
                {
                    "row": label,
                    "budget_bytes": budget,
                    "error": str(e),
                    "min_budget_bytes": e.min_budget_bytes,
                }
            )
            print(f"  {label}: no plan ({e})", file=sys.stderr)
            continue
        try:
            row = measure(label, plan, plan.predicted_peak_bytes)
        except MeasurementError as e:
            reason = str(e).strip().splitlines()[-1]
            rows.append(
                {
                    "row": label,
                    "budget_bytes": budget,
                    "error": reason,
                    "plan": _code(plan),
                }
            )
            print(f"  {label}: run failed ({reason})", file=sys.stderr)
            continue
        row["budget_bytes"] = budget

    head = (
        f"{'row':<22}{'budget':>11}{'plan':>18}{'predicted':>12}{'measured':>12}"
        f"{'pred/meas':>10}{'step s':>9}{'x plain':>9}"
    )
    print(f"\nmachine: {machine()}")
    print(head)
    for r in rows:
        budget = format_bytes(r["budget_bytes"]) if r.get("budget_bytes") else "-"
        if "error" in r:
            print(
                f"{r['row']:<22}{budget:>11}  no plan fits; smallest "
                f"{format_bytes(r['min_budget_bytes'] or 0)}"
            )
            continue
        print(
            f"{r['row']:<22}{budget:>11}{(r['plan'] or 'plain'):>18}"
            f"{format_bytes(r['predicted_peak_bytes']):>12}"
            f"{format_bytes(r['measured_peak_bytes']):>12}"
            f"{r['predicted_peak_bytes'] / r['measured_peak_bytes']:>10.2f}"
            f"{r['step_s']:>9.2f}{r['step_s'] / plain['step_s']:>9.2f}"
        )
    print(
        f"import baseline (not counted above): {format_bytes(plain['baseline_bytes'])}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=2)
    return 0


def _code(plan: MemoryPlan) -> str:
    c = {
        ("keep", "resident"): "K",
        ("recompute", "resident"): "R",
        ("offload", "resident"): "O",
    }
    s = "".join(c.get((b.activations, b.state), "S") for b in plan.blocks)
    extra = []
    if plan.num_microbatches > 1:
        extra.append(f"m{plan.num_microbatches}")
    if plan.loss_chunks > 1:
        extra.append(f"c{plan.loss_chunks}")
    return s + ("/" + ",".join(extra) if extra else "")


if __name__ == "__main__":
    sys.exit(main())
