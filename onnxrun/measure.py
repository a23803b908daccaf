"""Evaluate an ONNX model in a fresh, torch-free process and measure its memory.

``memory.measure.measure_in_child`` imports torch in its child, so it cannot measure a
process that must not import torch. This starts ``python -m onnxrun.evaluate`` instead
(numpy and onnxruntime only) with the same glibc setting as every measuring child
(``MALLOC_MMAP_THRESHOLD_=65536``, so freed buffers leave the RSS) and reads the same
figures: the RSS after imports (``baseline_bytes``) and the peak RSS (``VmHWM``) minus
it (``peak_bytes``): model loading, session set-up and evaluation all count.

Example:
    >>> m = evaluate_in_child("model.onnx", x, y, "image")  # doctest: +SKIP
    >>> m.metrics["accuracy"], m.peak_bytes, m.baseline_bytes  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

MALLOC_MMAP_THRESHOLD = 65536  # bytes; the same as memory.measure's children


class OrtEvalError(RuntimeError):
    """The evaluation process failed, crashed or ran past its timeout."""


@dataclass(frozen=True)
class OrtEvalMeasurement:
    """What one torch-free evaluation process measured.

    Attributes:
        metrics: ``loss``, ``accuracy``, ``num_examples`` (and ``perplexity``).
        peak_bytes: peak RSS (``VmHWM``) minus ``baseline_bytes``.
        baseline_bytes: RSS right after importing numpy and onnxruntime.
        hwm_bytes: the raw ``VmHWM``.
        wall_s: seconds from after the imports to the end of the evaluation.
        modules: top-level modules the process had imported at the end.
    """

    metrics: dict[str, float]
    peak_bytes: int
    baseline_bytes: int
    hwm_bytes: int
    wall_s: float
    modules: list[str] = field(default_factory=list, repr=False)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MMAP_THRESHOLD)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = root + (os.pathsep + old if old else "")
    return env


def evaluate_in_child(
    model_path: str | os.PathLike[str],
    inputs: np.ndarray,
    targets: np.ndarray,
    kind: str,
    *,
    low_memory: bool = True,
    timeout_s: float = 600,
) -> OrtEvalMeasurement:
    """Evaluate ``model_path`` on the arrays in a torch-free child process.

    The arrays go to ``.npy`` files, which the child maps read-only.

    Raises:
        OrtEvalError: the child failed (its error is in the message), crashed or timed
            out.
    """
    with tempfile.TemporaryDirectory(prefix="fleetfit-ort-") as tmp:
        x_path = os.path.join(tmp, "inputs.npy")
        y_path = os.path.join(tmp, "targets.npy")
        answer_path = os.path.join(tmp, "answer.json")
        np.save(x_path, inputs)
        np.save(y_path, targets)
        cmd = [
            sys.executable,
            "-m",
            "onnxrun.evaluate",
            os.fspath(model_path),
            x_path,
            y_path,
            "--kind",
            kind,
            "--answer",
            answer_path,
        ]
        if not low_memory:
            cmd.append("--no-low-memory")
        try:
            proc = subprocess.run(
                cmd, env=_env(), capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as e:
            raise OrtEvalError(
                f"ONNX evaluation ran past its timeout of {timeout_s:g} s"
            ) from e
        if not os.path.exists(answer_path):
            raise OrtEvalError(
                f"the ONNX evaluation process exited with code {proc.returncode} "
                f"without an answer (killed, out of memory?); its stderr ends:\n"
                f"{(proc.stderr or '')[-2000:]}"
            )
        with open(answer_path) as f:
            answer = json.load(f)
    if not answer["ok"]:
        raise OrtEvalError(f"ONNX evaluation failed: {answer['error']}")
    return OrtEvalMeasurement(
        metrics=answer["metrics"],
        peak_bytes=int(answer["peak_bytes"]),
        baseline_bytes=int(answer["baseline_bytes"]),
        hwm_bytes=int(answer["hwm_bytes"]),
        wall_s=float(answer["wall_s"]),
        modules=list(answer["modules"]),
    )
