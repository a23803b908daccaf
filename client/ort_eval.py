"""Evaluation-only work: a node whose budget fits no training evaluates the round's
model (ONNX, sent by the server) on its own data in a torch-free process.

The ClientApp process draws the node's share of the data (``workloads``) as numpy
arrays and starts ``onnxrun.measure.evaluate_in_child``: a fresh process that imports
numpy and onnxruntime only, evaluates, and reports its peak RSS above its import
baseline (read from ``/proc/self/status``; see docs/onnx.md). That peak is the node's
``measured-peak-bytes``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from client.config import NodeConfig
from onnxrun.measure import OrtEvalError, evaluate_in_child
from server import protocol
from workloads import get_workload


def evaluate_only(
    content: Any, node: NodeConfig, ins: protocol.TrainInstruction
) -> tuple[dict[str, int | float], dict[str, str]]:
    """Run the evaluation; return the reply's metrics and report entries.

    A failed evaluation is reported (``eval-error``), not raised: the node still
    answers its ``none`` assignment.
    """
    arrays = content.array_records.get(protocol.ARRAYS)
    if arrays is None or protocol.ONNX_MODEL not in arrays:
        return {}, {"eval-error": "the instruction carried no ONNX model"}
    workload = get_workload(
        ins.workload, batch_size=ins.batch_size or None, seq_len=ins.seq_len or None
    )
    if workload.kind not in ("image", "lm"):
        return {}, {"eval-error": f"{workload.name}: not a classifier or an LM"}
    items = workload.client_items(
        node.partition_id,
        node.num_partitions,
        ins.split,
        seed=ins.seed,
        alpha=ins.dirichlet_alpha,
        classes=ins.class_list,
    )
    x, y = workload.eval_arrays(items)
    with tempfile.TemporaryDirectory(prefix="fleetfit-eval-only-") as tmp:
        path = os.path.join(tmp, protocol.ONNX_MODEL)
        with open(path, "wb") as f:
            f.write(arrays[protocol.ONNX_MODEL].numpy().tobytes())
        try:
            m = evaluate_in_child(path, x, y, workload.kind)
        except OrtEvalError as e:
            return {}, {"eval-error": str(e)[-500:]}
    metrics: dict[str, int | float] = {
        protocol.EVAL_LOSS: float(m.metrics["loss"]),
        protocol.EVAL_ACCURACY: float(m.metrics["accuracy"]),
        protocol.EVAL_NUM_EXAMPLES: int(m.metrics["num_examples"]),
        protocol.EVAL_S: m.wall_s,
        protocol.PEAK_BYTES: m.peak_bytes,
        protocol.BASELINE_BYTES: m.baseline_bytes,
    }
    return metrics, {"peak-method": "ort-child", "eval-runtime": "onnxruntime"}
