"""ONNX export of every built-in workload: ORT vs torch, and dynamic int8.

Each workload's model is first trained briefly (``--steps`` AdamW steps on its training
data, so that accuracy means something; 0 keeps the random weights), then exported by
``server.export.export_model`` with ``quantize=True``. Columns: parameters, export time,
ONNX size, the worst ``max |ort - torch|`` over batch sizes 1, 3, 8 against its bound
``1e-4 * max(1, max |torch|)``, held-out accuracy in torch, ORT and int8 ORT, the int8
accuracy and loss change, and the int8 file's size.

    python benchmarks/onnx_export.py                          # all built-ins
    python benchmarks/onnx_export.py --workloads digits-cnn gpt-tiny --steps 100
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import torch

from server.export import export_model
from workloads import BUILTIN_WORKLOADS, get_workload

SHAPES = {"gpt2-small": (2, 16), "gpt2-medium": (2, 16)}  # (batch, seq): CPU-sized
STEPS = {"gpt2-small": 0, "gpt2-medium": 0, "gpt-byte": 100}  # random-token data


def train(wl, model, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = wl.batches(wl.items(train=True), seed=0)
    for _ in range(steps):
        x, y = next(batches)
        loss = wl.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", nargs="*", default=list(BUILTIN_WORKLOADS))
    p.add_argument(
        "--steps", type=int, default=300, help="training steps (digits, gpt-tiny)"
    )
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    head = ["workload", "params", "steps", "export s", "onnx MB", "max diff", "bound",
            "torch acc", "ort acc", "int8 acc", "int8 d acc", "int8 d loss", "int8 MB"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in args.workloads:
        b, t = SHAPES.get(name, (None, None))
        wl = get_workload(name, batch_size=b, seq_len=t)
        model = wl.make_model(0)
        steps = STEPS.get(name, args.steps)
        train(wl, model, steps)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            r = export_model(model, wl, os.path.join(tmp, "model.onnx"), quantize=True)
            wall = time.perf_counter() - t0
        worst = max(
            r["verification"]["batches"], key=lambda x: x["max_abs_diff"] / x["bound"]
        )
        ev = r["evaluation"]
        params = sum(p.numel() for p in model.parameters())
        row = [name, f"{params / 1e6:.2f}M", str(steps), f"{r['export_s']:.1f} ({wall:.0f})",
               f"{r['bytes'] / 1e6:.1f}", f"{worst['max_abs_diff']:.1e}", f"{worst['bound']:.1e}",
               f"{ev['torch']['accuracy']:.4f}", f"{ev['onnxruntime']['accuracy']:.4f}",
               f"{ev['int8']['accuracy']:.4f}", f"{r['int8']['accuracy_change']:+.4f}",
               f"{r['int8']['loss_change']:+.4f}", f"{r['int8']['bytes'] / 1e6:.1f}"]  # fmt: skip
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
