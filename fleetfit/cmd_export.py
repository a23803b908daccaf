"""``fleetfit export``: a saved model to ONNX, checked against torch, optionally int8.

    fleetfit export --checkpoint runs/demo/model.safetensors --out model.onnx
    fleetfit export --checkpoint runs/demo/model.safetensors --out model.onnx --quantize

Everything comes from the checkpoint's metadata: the workload and, for a built-in, its
batch shape (a ``module:function`` workload's batch is the one its function builds).
Writes the ONNX file, ``<name>.int8.onnx`` with ``--quantize``, and a JSON report
(``<name>.export.json`` unless ``--report``); prints a short summary, or the report
with ``--json``. See docs/onnx.md.
"""

from __future__ import annotations

import argparse
import json
from math import nan
from pathlib import Path
from typing import Annotated, Any

import typer

from fleetfit import options as opt
from fleetfit.args import output_file


def register(app: typer.Typer) -> None:
    app.command(
        "export",
        help="Export a fleetfit model.safetensors to ONNX with a dynamic batch axis, "
        "check ONNX Runtime against torch, optionally quantise to int8, and report "
        "held-out metrics.",
        short_help="export a saved model to ONNX (checked against torch; optional int8)",
    )(export_command)


def export_command(
    checkpoint: Annotated[
        str,
        typer.Option(
            metavar="FILE",
            help="a model.safetensors written by a run",
            show_default=False,
        ),
    ],
    out: Annotated[
        str,
        typer.Option(
            metavar="FILE.onnx", help="the ONNX file to write", show_default=False
        ),
    ],
    quantize: Annotated[
        bool,
        typer.Option(
            "--quantize",
            help="also write <name>.int8.onnx (dynamic int8) and its accuracy change",
        ),
    ] = False,
    report: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="the JSON report (default: <name>.export.json beside --out)",
        ),
    ] = None,
    json: opt.Json = False,
) -> int:
    return run(argparse.Namespace(**locals()))


def run(args: argparse.Namespace) -> int:
    from server.export import export_model, load_checkpoint

    out = Path(args.out)
    if out.suffix != ".onnx":
        raise ValueError(f"--out {out} must name a .onnx file")
    output_file("--out", out, "model.onnx")
    if args.report:
        output_file("--report", args.report, "model.export.json")
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
    for line in summary_lines(report, out):
        print(line)
    print(f"report: {report_path}")
    return 0


def summary_lines(report: dict[str, Any], out: Path) -> list[str]:
    """The short summary of an export report (``server.export.export_model``): file,
    check, held-out metrics where computed, int8."""
    check = report["verification"]
    sizes = [
        f"{r['batch_size']} x {r['seq_len']} tokens"
        if "seq_len" in r
        else str(r["batch_size"])
        for r in check["batches"]
    ]
    inputs = report.get("inputs") or [report["input"]]
    lines = [
        f"{out}: {report['bytes']:,} bytes, input{'s' if len(inputs) > 1 else ''} "
        + ", ".join(f"{i['name']} {i['shape']}" for i in inputs),
        f"ONNX Runtime vs torch: max |diff| {check['max_abs_diff']:.2e} over batch "
        f"sizes [{', '.join(sizes)}] ({check['tolerance']})",
    ]
    int8 = report["int8"]
    ev = report["evaluation"]
    if ev is not None:
        lines.append(_held_out_line(ev))
    if int8 is not None:
        if "file" in int8:
            lines.append(f"{out.with_name(int8['file'])}: {int8['bytes']:,} bytes")
        if "error" in int8:
            lines.append(f"int8: {int8['error']}")
    return lines


def _held_out_line(ev: dict[str, Any]) -> str:
    """``held-out accuracy: torch ..., onnxruntime ..., int8 ...``; a runtime whose
    metrics were not computed says why."""
    metric = ev.get("metric", "accuracy")
    parts = []
    for runtime, why in (
        ("torch", ev.get("torch_error")),
        ("onnxruntime", ev.get("onnxruntime_not_computed")),
    ):
        m = ev.get(runtime)
        if m is None:
            parts.append(f"{runtime} not computed ({why})")
        else:
            parts.append(f"{runtime} {m.get(metric, nan):.4f}")
    if "int8" in ev:  # only beside ONNX Runtime's own metrics
        q, base = ev["int8"].get(metric, nan), ev["onnxruntime"].get(metric, nan)
        parts.append(f"int8 {q:.4f} (change {q - base:+.4f})")
    return f"held-out {metric}: " + ", ".join(parts)
