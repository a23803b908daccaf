"""Peak memory of an evaluation process: ONNX Runtime without torch vs torch.

For each workload, the same held-out arrays (``Workload.eval_arrays``: the digits'
test images; 256 token windows for language models) are evaluated by

- ``ort``: ``onnxrun.measure.evaluate_in_child``, the process an evaluation-only node
  runs (imports numpy and onnxruntime only; pre-packing and the CPU arena off);
- ``ort (defaults)``: the same with ORT's default session options;
- ``torch``: a fresh process that imports torch and fleetfit's workloads, builds the
  model, loads its weights from safetensors and evaluates under ``no_grad``.

Every child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` and reads its own
``/proc/self/status``: ``baseline`` = VmRSS after imports, ``peak`` = VmHWM minus it
(model loading included), ``total`` = VmHWM, what the device must have.

    python benchmarks/onnx_eval_memory.py
    python benchmarks/onnx_eval_memory.py --workloads digits-cnn gpt-byte
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

from onnxrun.evaluate import EVAL_BATCH, LOGITS_BYTES
from onnxrun.measure import MALLOC_MMAP_THRESHOLD, evaluate_in_child
from server.export import export_onnx
from server.persist import save_model
from workloads import get_workload

SHAPES = {"gpt2-small": (4, 128), "gpt2-medium": (4, 128)}

TORCH_CHILD = r"""
import json, sys, time
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
import numpy as np, torch, torch.nn.functional as F
from safetensors.torch import load_file
from workloads import get_workload
name, batch, seq, weights, xp, yp, out, size = sys.argv[1:]
base = status("VmRSS")
t0 = time.perf_counter()
wl = get_workload(name, batch_size=int(batch) or None, seq_len=int(seq) or None)
model = wl.make_model(0)
model.load_state_dict(load_file(weights))
model.eval()
x, y = np.load(xp, mmap_mode="r"), np.load(yp, mmap_mode="r")
size = int(size)  # examples per call: the same as the ORT process
total = correct = count = 0.0
with torch.no_grad():
    for s in range(0, len(x), size):
        logits = model(torch.from_numpy(np.ascontiguousarray(x[s:s+size])))
        t = torch.from_numpy(np.ascontiguousarray(y[s:s+size]))
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == t).sum()); count += t.numel()
hwm = status("VmHWM")
json.dump({"baseline_bytes": base, "peak_bytes": hwm - base, "hwm_bytes": hwm,
           "wall_s": time.perf_counter() - t0, "accuracy": correct / count}, open(out, "w"))
"""


def torch_child(
    name: str, b: int, t: int, weights: str, xp: str, yp: str, size: int
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a.json")
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MALLOC_MMAP_THRESHOLD))
        env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [
            sys.executable,
            "-c",
            TORCH_CHILD,
            name,
            str(b),
            str(t),
            weights,
            xp,
            yp,
            out,
            str(size),
        ]
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            return json.load(f)


def mb(x: float) -> str:
    return f"{x / 2**20:.0f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--workloads", nargs="*", default=["digits-cnn", "gpt-byte", "gpt2-small"]
    )
    args = p.parse_args()
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs; MiB; eval on held-out arrays"
    )
    head = ["workload", "weights MiB", "examples", "runtime", "baseline", "peak", "total", "eval s", "accuracy"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in args.workloads:
        b, t = SHAPES.get(name, (0, 0))
        wl = get_workload(name, batch_size=b or None, seq_len=t or None)
        model = wl.make_model(0)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        x, y = wl.eval_arrays()
        with tempfile.TemporaryDirectory() as tmp:
            onnx_path = export_onnx(model, wl, os.path.join(tmp, "model.onnx"))
            st = os.path.join(tmp, "model.safetensors")
            save_model(st, model.state_dict(), {"workload": name})
            xp, yp = os.path.join(tmp, "x.npy"), os.path.join(tmp, "y.npy")
            np.save(xp, x)
            np.save(yp, y)
            del model
            rows = []
            for label, low in (("ort", True), ("ort (defaults)", False)):
                m = evaluate_in_child(onnx_path, x, y, wl.kind, low_memory=low)
                rows.append(
                    (
                        label,
                        m.baseline_bytes,
                        m.peak_bytes,
                        m.hwm_bytes,
                        m.wall_s,
                        m.metrics["accuracy"],
                    )
                )
            size = EVAL_BATCH[wl.kind]
            if wl.kind == "lm":  # the ORT process's cap on one call's logits
                vocab = wl.make_config().vocab_size
                size = max(1, min(size, LOGITS_BYTES // (4 * y.shape[1] * vocab)))
            tc = torch_child(name, b, t, st, xp, yp, size)
            rows.append(
                (
                    "torch",
                    tc["baseline_bytes"],
                    tc["peak_bytes"],
                    tc["hwm_bytes"],
                    tc["wall_s"],
                    tc["accuracy"],
                )
            )
        for label, base, peak, hwm, wall, acc in rows:
            row = [
                name,
                mb(weights),
                str(len(x)),
                label,
                mb(base),
                mb(peak),
                mb(hwm),
                f"{wall:.2f}",
                f"{acc:.4f}",
            ]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
