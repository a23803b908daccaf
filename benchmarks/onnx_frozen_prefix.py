"""Frozen blocks in ONNX Runtime? A client training a later window of a GPT runs the
blocks before it forward only (``no_grad``). Could ORT run that prefix better?

Measured, each in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``; VmHWM from
/proc/self/status):

- time: the prefix (embedding + ``--prefix`` layers) forward on the workload's batch,
  torch eager under ``no_grad`` vs an ORT session of the same prefix (median of 10);
- memory: peak RSS above the post-import baseline of running the prefix once, torch
  vs ORT, and the RSS that importing onnxruntime adds to a process that has torch.

    python benchmarks/onnx_frozen_prefix.py --workload gpt-byte --prefix 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
mode, name, k, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import numpy as np, torch
from torch import nn
from workloads import get_workload
before_ort = status("VmRSS")
if mode == "ort":
    import onnxruntime as ort
after_imports = status("VmRSS")
wl = get_workload(name)
x = wl.example_batch(0)[0].long()
if mode == "torch":
    torch.manual_seed(0)
    model = wl.make_model(0)
    prefix = nn.Sequential(model.embed, *model.layers[:k]).eval()
    del model
    def run():
        with torch.no_grad():
            return prefix(x)
else:
    so = ort.SessionOptions(); so.log_severity_level = 3
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.enable_cpu_mem_arena = False
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    xn = x.numpy()
    def run():
        return sess.run(None, {"inputs": xn})[0]
run()
times = []
for _ in range(10):
    t0 = time.perf_counter(); run(); times.append(time.perf_counter() - t0)
print(json.dumps({"mode": mode, "import_ort_bytes": after_imports - before_ort,
                  "peak_bytes": status("VmHWM") - after_imports,
                  "median_s": statistics.median(times)}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="gpt-byte")
    p.add_argument(
        "--prefix", type=int, default=3, help="frozen layers before the window"
    )
    args = p.parse_args()
    from torch import nn

    from server.export import export_onnx
    from workloads import get_workload

    wl = get_workload(args.workload)
    model = wl.make_model(0)
    prefix = nn.Sequential(model.embed, *model.layers[: args.prefix])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prefix.onnx")
        export_onnx(prefix, wl, path)
        del model, prefix
        rows = []
        for mode in ("torch", "ort"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, mode, args.workload, str(args.prefix), path],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    x = wl.example_batch(0)[0]
    print(f"{args.workload}: embedding + {args.prefix} layers, batch {tuple(x.shape)}")
    print(
        "| runtime | forward ms (median of 10) | peak above imports MiB | onnxruntime import MiB |"
    )
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['median_s'] * 1e3:.1f} | {r['peak_bytes'] / 2**20:.0f} | "
              f"{r['import_ort_bytes'] / 2**20:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
