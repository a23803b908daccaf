"""The architecture zoo (issue 34): every causal-LM, masked-LM, sequence-to-sequence
and image-classification model class of the installed transformers, trained plainly
and under plans, compared in process.

Each class (``tests/hf/zoo.py``: enumeration, shrunk configs, batches) is built from a
shrunk config with random weights and trained 2 steps under two plans made by the
public API (``memory.plan_training`` then ``TrainingPlan.trainer``): one at half of
plain training's predicted peak (``plain_peak_bytes // 2``), then the smallest plan
(budget None: micro-batches, loss chunks where offered, recompute, streaming). Every
step's loss must be plain torch's within 1e-5 relative and every parameter's gradient,
before the optimizer step, within ``||g_plan - g_plain|| / ||g_plain|| <= 1e-5``
(max abs <= 1e-7 where ``||g_plain|| < 1e-6``), plain's step taken from the same
weights. Outcomes: passed; refused (a ``MemoryPlanError`` or ``BudgetError``, its one
line); failed (anything else, or a mismatch: its first line); skipped (out of the
denominator, with the reason: a missing package, a multimodal or audio class, an
inference-only head).

Each class runs in a subprocess of its own with a timeout, so that a hang or a crash
costs that class only. Prints a table by class and a summary (counts, pass percentage
over the denominator, wall time); writes the results as JSON.

    python benchmarks/zoo.py                                # the whole zoo
    python benchmarks/zoo.py --only 'Llama*' --jobs 2
    python benchmarks/zoo.py --out benchmarks/results/zoo.json
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

_MARK = "ZOO-RESULT "


def _one(name: str) -> None:
    """The child: run one class, print its result as one marked JSON line."""
    import torch

    torch.set_num_threads(1)
    from tests.hf import zoo

    res = zoo.run(zoo.by_name(name))
    print(_MARK + json.dumps(dataclasses.asdict(res)), flush=True)


def _spawn(name: str, task: str, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.monotonic()
    base = {"name": name, "task": task, "status": "failed", "detail": None}
    try:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {
            **base,
            "reason": f"timeout after {timeout_s:.0f} s",
            "seconds": timeout_s,
        }
    seconds = round(time.monotonic() - t0, 2)
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            out = json.loads(line[len(_MARK) :])
            out["wall_s"] = seconds
            return out
    tail = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return {
        **base,
        "reason": f"crashed (exit {p.returncode}): {tail[-1][:200] if tail else ''}",
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help="class names matching this glob")
    ap.add_argument("--jobs", type=int, default=1, help="classes at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per class")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        _one(args.one)
        return 0
    from tests.hf import zoo

    todo = [
        e
        for e in zoo.entries()
        if args.only is None
        or fnmatch.fnmatchcase(e.name, args.only)
        or args.only in e.name
    ]
    if not todo:
        print(f"no class matches {args.only!r}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(_spawn, e.name, e.task, args.timeout) for e in todo]
        for f in futures:
            r = f.result()
            results.append(r)
            print(
                f"{r['status']:8s} {r['task']:8s} {r['name']:48s} "
                f"{r.get('seconds', 0):7.1f}s  {r.get('reason', '')}",
                flush=True,
            )
    wall = time.monotonic() - t0
    counts = {s: 0 for s in ("passed", "refused", "failed", "skipped")}
    for r in results:
        counts[r["status"]] += 1
    denominator = len(results) - counts["skipped"]
    pct = 100.0 * counts["passed"] / denominator if denominator else 0.0
    summary = (
        f"{len(results)} classes: {counts['passed']} passed, {counts['refused']} "
        f"refused, {counts['failed']} failed, {counts['skipped']} skipped; "
        f"{pct:.1f}% of {denominator} passed; wall {wall / 60:.1f} min"
    )
    print(summary)
    if args.out:
        import torch
        import transformers

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "command": "python benchmarks/zoo.py "
                    + " ".join(argv or sys.argv[1:]),
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "cpus": os.cpu_count(),
                    "wall_s": round(wall, 1),
                    "counts": counts,
                    "denominator": denominator,
                    "pass_percent": round(pct, 1),
                    "summary": summary,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
