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


def merge(base: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """``base``'s results with ``again``'s classes replaced (a re-run of some
    classes after a fix), counts recomputed, both commands and wall times kept."""
    by_name = {r["name"]: r for r in base["results"]}
    for r in again["results"]:
        by_name[r["name"]] = {**r, "rerun": True}
    results = [by_name[r["name"]] for r in base["results"]]
    out = dict(base, results=results)
    out.update(_counts(results))
    out["reruns"] = base.get("reruns", []) + [
        {
            "command": again["command"],
            "wall_s": again["wall_s"],
            "classes": len(again["results"]),
        }
    ]
    return out


def _counts(results: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {s: 0 for s in ("passed", "refused", "failed", "skipped")}
    for r in results:
        counts[r["status"]] += 1
    denominator = len(results) - counts["skipped"]
    pct = 100.0 * counts["passed"] / denominator if denominator else 0.0
    return {"counts": counts, "denominator": denominator, "pass_percent": round(pct, 1)}


def markdown(data: dict[str, Any]) -> str:
    """The census as a markdown table by class (docs/memory.md)."""
    lines = ["| class | task | result | reason / plans |", "|---|---|---|---|"]
    for r in data["results"]:
        d = r.get("detail") or {}
        why = r.get("reason") or ""
        if r["status"] == "passed":
            why = "; ".join(
                f"{k}: {d[k]['plan']}" for k in ("half", "smallest") if k in d
            )
        why = why.replace("|", "\\|")
        lines.append(f"| {r['name']} | {r['task']} | {r['status']} | {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--only",
        default=None,
        help="class names matching this glob (or any of several, comma-separated)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="classes at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per class")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument(
        "--merge",
        nargs=2,
        metavar=("BASE", "AGAIN"),
        help="merge a re-run of some classes (AGAIN) into a census (BASE), to --out",
    )
    ap.add_argument("--markdown", metavar="JSON", help="print a census as a table")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        _one(args.one)
        return 0
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    if args.merge:
        with open(args.merge[0]) as f, open(args.merge[1]) as g:
            merged = merge(json.load(f), json.load(g))
        with open(args.out or args.merge[0], "w") as f:
            json.dump(merged, f, indent=1)
        c = merged["counts"]
        print(
            f"{len(merged['results'])} classes: {c['passed']} passed, {c['refused']} "
            f"refused, {c['failed']} failed, {c['skipped']} skipped; "
            f"{merged['pass_percent']}% of {merged['denominator']} passed"
        )
        return 0
    from tests.hf import zoo

    patterns = args.only.split(",") if args.only else None
    todo = [
        e
        for e in zoo.entries()
        if patterns is None
        or any(fnmatch.fnmatchcase(e.name, p) or p in e.name for p in patterns)
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
    tally = _counts(results)
    counts, denominator, pct = (
        tally["counts"],
        tally["denominator"],
        tally["pass_percent"],
    )
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
