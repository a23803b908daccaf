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
from wire import keys
from wire.instruction import TrainInstruction
from wire.reply import EvalResult
from workloads import get_workload


def evaluate_only(content: Any, node: NodeConfig, ins: TrainInstruction) -> EvalResult:
    """Run the evaluation; return its result for the reply.

    A failed evaluation is reported (``EvalResult.error``), not raised: the node still
    answers its ``none`` assignment.
    """
    arrays = content.array_records.get(keys.ARRAYS)
    if arrays is None or keys.ONNX_MODEL not in arrays:
        return EvalResult(error="the instruction carried no ONNX model")
    shape = ins.shape
    workload = get_workload(
        shape.workload,
        batch_size=shape.batch_size or None,
        seq_len=shape.seq_len or None,
    )
    if workload.kind not in ("image", "lm"):
        return EvalResult(error=f"{workload.name}: not a classifier or an LM")
    items = workload.client_items(
        node.partition_id,
        node.num_partitions,
        shape.split,
        seed=shape.seed,
        alpha=shape.dirichlet_alpha,
        classes=ins.classes or None,
        public_share=shape.public_share,
    )
    x, y = workload.eval_arrays(items)
    with tempfile.TemporaryDirectory(prefix="fleetfit-eval-only-") as tmp:
        path = os.path.join(tmp, keys.ONNX_MODEL)
        with open(path, "wb") as f:
            f.write(arrays[keys.ONNX_MODEL].numpy().tobytes())
        try:
            m = evaluate_in_child(path, x, y, workload.kind)
        except OrtEvalError as e:
            return EvalResult(error=str(e)[-500:])
    return EvalResult(
        loss=float(m.metrics["loss"]),
        accuracy=float(m.metrics["accuracy"]),
        num_examples=int(m.metrics["num_examples"]),
        eval_s=m.wall_s,
        runtime="onnxruntime",
        peak_bytes=m.peak_bytes,
        baseline_bytes=m.baseline_bytes,
    )
