"""``fleetfit export``: a saved model to ONNX, checked against torch, optionally int8.

    fleetfit export --checkpoint runs/demo/model.safetensors --out model.onnx
    fleetfit export --checkpoint runs/demo/model.safetensors --out model.onnx --quantize

Everything comes from the checkpoint's metadata (workload, batch shape). Writes the ONNX
file, ``<name>.int8.onnx`` with ``--quantize``, and a JSON report
(``<name>.export.json`` unless ``--report``); prints a short summary, or the report
with ``--json``. See docs/onnx.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a saved model to ONNX (checked against torch; optional int8)",
        description="Export a fleetfit model.safetensors to ONNX with a dynamic batch "
        "axis, check ONNX Runtime against torch, optionally quantise to int8, and "
        "report held-out metrics.",
    )
    p.add_argument(
        "--checkpoint", required=True, help="a model.safetensors written by a run"
    )
    p.add_argument("--out", required=True, help="the ONNX file to write")
    p.add_argument(
        "--quantize",
        action="store_true",
        help="also write <name>.int8.onnx (dynamic int8) and its accuracy change",
    )
    p.add_argument(
        "--report", default=None, help="JSON report (default: <name>.export.json)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from server.export import export_model, load_checkpoint

    out = Path(args.out)
    if out.suffix != ".onnx":
        raise ValueError(f"--out {out} must name a .onnx file")
    report_path = args.report or out.with_name(out.stem + ".export.json")
    model, workload = load_checkpoint(args.checkpoint)
    report = export_model(
        model,
        workload,
        out,
        quantize=args.quantize,
        report_path=report_path,
        extra={"checkpoint": str(args.checkpoint)},
    )
    if args.json:
        print(json.dumps(report))
        return 0
    check = report["verification"]
    print(f"{out}: {report['bytes']:,} bytes, input {report['input']['shape']}")
    print(
        f"ONNX Runtime vs torch: max |diff| {check['max_abs_diff']:.2e} over batch "
        f"sizes {[r['batch_size'] for r in check['batches']]} ({check['tolerance']})"
    )
    ev = report["evaluation"]
    if ev is not None:
        line = (
            f"held-out accuracy: torch {ev['torch']['accuracy']:.4f}, "
            f"onnxruntime {ev['onnxruntime']['accuracy']:.4f}"
        )
        if "int8" in ev:
            line += (
                f", int8 {ev['int8']['accuracy']:.4f} "
                f"(change {report['int8']['accuracy_change']:+.4f})"
            )
        print(line)
    if report["int8"] is not None:
        print(
            f"{out.with_name(report['int8']['file'])}: {report['int8']['bytes']:,} bytes"
        )
    print(f"report: {report_path}")
    return 0
