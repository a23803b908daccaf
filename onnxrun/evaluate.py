"""Evaluate an ONNX model on arrays with ONNX Runtime, in numpy; no torch anywhere.

The metrics are the ones ``workloads.Workload.evaluate`` reports: mean cross-entropy
``loss`` (per example for classifiers, per token for language models), ``accuracy``
(argmax of the logits equal to the target) and, for language models, ``perplexity``.

As a program it is the measured evaluation process of an evaluation-only device:

    python -m onnxrun.evaluate MODEL.onnx INPUTS.npy TARGETS.npy --kind image \
        --answer out.json

It records its RSS after its imports (numpy, onnxruntime: the baseline), loads the
model, evaluates, then reads its peak RSS (``VmHWM``) from ``/proc/self/status``; the
answer holds the metrics, both figures and the list of imported top-level modules
(so a test can check that torch is not among them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import numpy as np
import onnxruntime as ort

KINDS = ("image", "lm")
# Examples per ORT call. Language models: 8, not Workload.evaluate's 64: ORT keeps
# every intermediate of a call alive longer than torch does; gpt-byte's evaluation
# peaked at 542 MiB above imports with 64 and 158 MiB with 8 (74 MiB of weights),
# at nearly the same speed.
EVAL_BATCH = {"image": 256, "lm": 8}
LOGITS_BYTES = 64 * 2**20  # at most this much fp32 logits per call (LM vocabularies)
CE_ROWS = 1024  # rows of logits per float64 cross-entropy chunk


def make_session(path: str, *, low_memory: bool = True) -> ort.InferenceSession:
    """A CPU inference session for ``path``, quiet (errors only).

    ``low_memory`` turns off weight pre-packing (prepacked copies of MatMul/Gemm
    weights double their memory) and the CPU memory arena, so the process holds little
    more than the weights and one batch's activations.
    """
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if low_memory:
        so.enable_cpu_mem_arena = False
        so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def run_logits(session: ort.InferenceSession, inputs: np.ndarray) -> np.ndarray:
    """The model's first output for ``inputs`` (one call)."""
    name = session.get_inputs()[0].name
    out = session.run(None, {name: inputs})[0]
    return np.asarray(out)


def cross_entropy_sum(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    """Sum of the cross-entropy of ``logits`` (..., classes) against ``targets`` (...),
    and the number of correct argmax predictions (float64 log-sum-exp)."""
    flat = logits.reshape(-1, logits.shape[-1])
    tgt = targets.reshape(-1).astype(np.int64)
    total, correct = 0.0, 0
    for s in range(0, len(tgt), CE_ROWS):  # chunks: a float64 copy of a few MB only
        z = flat[s : s + CE_ROWS].astype(np.float64)
        t = tgt[s : s + CE_ROWS]
        zmax = z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z - zmax).sum(axis=1)) + zmax[:, 0]
        total += float((lse - z[np.arange(len(t)), t]).sum())
        correct += int((z.argmax(axis=1) == t).sum())
    return total, correct


def evaluate_arrays(
    session: ort.InferenceSession,
    inputs: np.ndarray,
    targets: np.ndarray,
    kind: str,
    batch_size: int | None = None,
) -> dict[str, float]:
    """Loss and accuracy (and perplexity for ``lm``) of the session on the arrays.

    Args:
        inputs: images (N, ...) float32, or token ids (N, T) int64.
        targets: classes (N,), or next tokens (N, T).
        kind: ``image`` (a classifier) or ``lm`` (next-token logits).
        batch_size: examples per call; the default follows ``Workload.evaluate``,
            capped so that one call's logits stay within ``LOGITS_BYTES``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: ONNX evaluation knows {', '.join(KINDS)}")
    if len(inputs) != len(targets):
        raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
    size = batch_size or EVAL_BATCH[kind]
    if batch_size is None:
        per_example = 4 * int(np.prod(targets.shape[1:], dtype=np.int64))
        vocab = session.get_outputs()[0].shape[-1]
        if isinstance(vocab, int):
            size = max(1, min(size, LOGITS_BYTES // max(1, per_example * vocab)))
    total, correct, count = 0.0, 0, 0
    for s in range(0, len(inputs), size):
        logits = run_logits(session, np.ascontiguousarray(inputs[s : s + size]))
        y = targets[s : s + size]
        nll, ok = cross_entropy_sum(logits, y)
        total += nll
        correct += ok
        count += int(y.size)
    loss = total / max(count, 1)
    metrics = {"loss": loss, "accuracy": correct / max(count, 1), "num_examples": count}
    if kind == "lm":
        metrics["perplexity"] = math.exp(min(loss, 50.0))
    return metrics


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m onnxrun.evaluate")
    p.add_argument("model")
    p.add_argument("inputs")
    p.add_argument("targets")
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--answer", required=True, help="JSON file for the result")
    p.add_argument("--no-low-memory", action="store_true")
    args = p.parse_args(argv)
    answer: dict[str, Any]
    try:
        baseline = _status_bytes("VmRSS")
        t0 = time.perf_counter()
        # mmap_mode: the arrays stay file-backed; only the batch being run is copied.
        inputs = np.load(args.inputs, mmap_mode="r")
        targets = np.load(args.targets, mmap_mode="r")
        session = make_session(args.model, low_memory=not args.no_low_memory)
        metrics = evaluate_arrays(session, inputs, targets, args.kind)
        wall = time.perf_counter() - t0
        hwm = _status_bytes("VmHWM")
        answer = {
            "ok": True,
            "metrics": metrics,
            "baseline_bytes": baseline,
            "hwm_bytes": hwm,
            "peak_bytes": hwm - baseline,
            "wall_s": wall,
            "modules": sorted({m.split(".")[0] for m in sys.modules}),
        }
    except Exception as e:  # the parent reports it; the traceback is on stderr
        import traceback

        traceback.print_exc()
        answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with open(args.answer, "w") as f:
        json.dump(answer, f)
    return 0 if answer["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
