"""Export the global model to ONNX, check ONNX Runtime against torch, quantise; report.

- ``export_model``: the export, the check and (optionally) int8, plus the held-out
  metrics of torch, ORT and int8 ORT, written as a JSON report (``export.json`` in a
  run folder; schema in docs/run-folder.md, see docs/onnx.md).
- ``load_checkpoint``: a run folder's ``model.safetensors`` and its workload, for
  ``fleetfit export``.

The steps, each importable from here too:

- ``server.export_graph``: ``export_onnx``, torch's dynamo exporter: one input
  (``inputs``: images, or token ids) with a dynamic batch axis, one output
  (``logits``, without the loss); an ``any_model`` workload (dict or tuple inputs,
  ``server.export_inputs``) gets one input per tensor, named by its dict key.
- ``server.export_check``: ``verify`` (ONNX Runtime against torch at several batch
  sizes, within ``RTOL``) and ``quantize_int8`` (dynamic int8).
- ``server.export_base``: ``ExportError``, and ``unsupported_operator`` (the operator
  an exporter failure names).

An ``any_model`` workload is checked on its example batch (and on 1 and 3 examples
made from it), and evaluated on its held-out batches.

Example:
    >>> from server.export import export_model
    >>> report = export_model(model, workload, "runs/x/model.onnx", quantize=True)
    >>> report["verification"]["ok"], report["int8"]["accuracy_change"]
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from onnxrun.evaluate import evaluate_arrays, make_session
from server.export_base import (
    EXTERNAL_DATA_BYTES,
    OUTPUT_NAME,
    ExportError,
    eval_mode,
    model_name,
    one_line,
    unsupported_operator,
)
from server.export_check import (
    ANY_MODEL_BATCH_SIZES,
    RTOL,
    VERIFY_BATCH_SIZES,
    fresh_inputs,
    quantize_int8,
    verify,
)
from server.export_graph import any_example, export_graph, export_input, export_onnx
from server.export_inputs import LogitsMetrics, call_flags
from server.persist import atomic_write_bytes, json_bytes
from workloads import Workload

__all__ = [
    "ANY_MODEL_BATCH_SIZES",
    "EXTERNAL_DATA_BYTES",
    "INT8_FILE",
    "ONNX_FILE",
    "OUTPUT_NAME",
    "REPORT_FILE",
    "RTOL",
    "VERIFY_BATCH_SIZES",
    "ExportError",
    "export_input",
    "export_model",
    "export_onnx",
    "fresh_inputs",
    "load_checkpoint",
    "quantize_int8",
    "unsupported_operator",
    "verify",
]

log = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
REPORT_FILE = "export.json"


def _metrics(m: dict[str, float]) -> dict[str, float]:
    return {
        k: float(v) for k, v in m.items() if k in ("loss", "accuracy", "perplexity")
    }


def export_model(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    quantize: bool = False,
    report_path: str | os.PathLike[str] | None = None,
    batch_sizes: Sequence[int] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Export, verify, optionally quantise, evaluate; write the report.

    Writes ``path`` (e.g. ``model.onnx``), with ``quantize`` also ``model.int8.onnx``
    beside it, and the JSON report at ``report_path`` (default: ``export.json`` beside
    ``path``). Held-out metrics (torch, ORT, int8 ORT) need a classifier, a language
    model or an ``any_model`` workload (its ``eval_batches``; ORT's only where its
    loss follows from the logits, else ``onnxruntime_not_computed`` says why); other
    workloads get ``evaluation: null``. A quantisation that fails leaves
    ``int8: {"error": ...}``.

    The graphs are written in a temporary folder beside ``path`` and moved into
    place (``os.replace``, a side file before its graph) only when every step
    passed: a failure leaves no ``.onnx`` of its own, and an earlier export at
    ``path`` as it was.

    Raises:
        ExportError: export failed (naming the operator) or ORT disagrees with torch
            beyond the bound (the report is written first).
    """
    path = Path(path)
    report_path = Path(report_path) if report_path else path.with_name(REPORT_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        report = _export_staged(
            model,
            workload,
            stage / path.name,
            quantize,
            report_path,
            batch_sizes,
            extra,
        )
        # side files (external data) first: a graph never appears without its data
        files = [f for f in stage.iterdir() if f.is_file() and f.suffix != ".tmp"]
        for f in sorted(files, key=lambda f: f.suffix == ".onnx"):
            os.replace(f, path.parent / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return report


def _export_staged(
    model: nn.Module,
    workload: Workload,
    path: Path,
    quantize: bool,
    report_path: Path,
    batch_sizes: Sequence[int] | None,
    extra: dict[str, Any] | None,
) -> dict[str, Any]:
    """``export_model``'s steps, writing the graphs at ``path`` (in the stage)."""
    t0 = time.perf_counter()
    _, described = export_graph(model, workload, path, None)
    export_s = time.perf_counter() - t0
    check = verify(model, workload, path, batch_sizes=batch_sizes)
    report: dict[str, Any] = {
        "schema": 1,
        "workload": workload.name,
        **({"model_class": type(model).__name__} if workload.any_model else {}),
        **(extra or {}),
        "file": path.name,
        "bytes": _file_bytes(path),
        **described,
        "output": OUTPUT_NAME,
        "export_s": export_s,
        "verification": check,
        "evaluation": None,
        "int8": None,
    }
    evaluate: Callable[[Path], dict[str, float]] | None = None
    if workload.any_model:
        report["evaluation"], evaluate = _evaluate_any(model, workload, path)
    elif workload.kind in ("image", "lm"):
        x, y = workload.eval_arrays()

        def evaluate(p: Path) -> dict[str, float]:
            return _metrics(evaluate_arrays(make_session(str(p)), x, y, workload.kind))

        report["evaluation"] = {
            "num_examples": int(y.size),
            "torch": _metrics(workload.evaluate(model)),
            "onnxruntime": evaluate(path),
        }
    if quantize:
        report["int8"] = _int8(path, report["evaluation"], evaluate)
    atomic_write_bytes(report_path, json_bytes(report))
    if not check["ok"]:
        worst = max(check["batches"], key=lambda r: r["max_abs_diff"] / r["bound"])
        tokens = f", {worst['seq_len']} tokens" if "seq_len" in worst else ""
        raise ExportError(
            f"{model_name(model, workload)}: ONNX Runtime disagrees with torch at "
            f"batch size {worst['batch_size']}{tokens}: max |diff| "
            f"{worst['max_abs_diff']:.3g} > bound {worst['bound']:.3g} "
            f"(report: {report_path})"
        )
    return report


def _int8(
    path: Path,
    evaluation: dict[str, Any] | None,
    evaluate: Callable[[Path], dict[str, float]] | None,
) -> dict[str, Any]:
    """Quantise ``path``; the report's ``int8`` entry (and ``evaluation["int8"]``)."""
    dst = path.with_name(path.name.removesuffix(".onnx") + ".int8.onnx")
    try:
        q = quantize_int8(path, dst)
    except Exception as e:
        log.warning("int8 quantisation of %s failed: %s", path, one_line(e))
        return {"error": f"int8 quantisation failed: {one_line(e)}"}
    int8: dict[str, Any] = {"file": q.name, "bytes": _file_bytes(q)}
    base = evaluation.get("onnxruntime") if evaluation else None
    if evaluation is None or evaluate is None or base is None:
        return int8
    try:
        m = evaluate(q)
    except Exception as e:  # the float graph evaluated: worth a line, not a failure
        int8["error"] = f"evaluating the int8 model failed: {one_line(e)}"
        return int8
    evaluation["int8"] = m
    int8["accuracy_change"] = m["accuracy"] - base["accuracy"]
    int8["loss_change"] = m["loss"] - base["loss"]
    return int8


def _evaluate_any(
    model: nn.Module, workload: Workload, path: Path
) -> tuple[dict[str, Any], Callable[[Path], dict[str, float]] | None]:
    """The report's ``evaluation`` of an ``any_model`` workload on its held-out
    batches, and the ORT evaluation of a graph (None where it is not computed)."""
    ev: dict[str, Any] = {"metric": workload.metric_name}
    try:
        m = workload.evaluate(model)
        ev["num_examples"] = int(m["num_examples"])
        ev["torch"] = _metrics(m)
    except Exception as e:
        ev["torch"] = None
        ev["torch_error"] = one_line(e)

    def evaluate(p: Path) -> dict[str, float]:
        return _metrics(_ort_metrics_any(model, workload, p))

    try:
        ev["onnxruntime"] = evaluate(path)
    except Exception as e:
        # our ValueErrors are the reason itself; anything else is named
        why = str(e).strip().split("\n")[0] if type(e) is ValueError else one_line(e)
        log.info("%s: no ONNX Runtime metrics: %s", workload.name, why)
        ev["onnxruntime"] = None
        ev["onnxruntime_not_computed"] = why
        return ev, None
    return ev, evaluate


def _ort_metrics_any(
    model: nn.Module, workload: Workload, path: Path
) -> dict[str, float]:
    """ORT's metrics on ``eval_batches()`` (``server.export_inputs.LogitsMetrics``).

    Raises:
        ValueError: they are not defined from logits (the reason), or ORT failed.
    """
    assert workload.example is not None
    spec, _ = any_example(model, workload)
    batches = workload.eval_batches()
    if not batches:
        raise ValueError("the workload has no held-out batches")
    loss_fn = workload.example[2]
    output_is_logits = True
    if loss_fn is not None:  # can loss_fn take the graph's logits for the output?
        with eval_mode(model), torch.no_grad():
            out = spec.call(model, spec.tensors(batches[0][0]), **call_flags(model))
        output_is_logits = isinstance(out, torch.Tensor)
    metrics = LogitsMetrics(model, loss_fn, output_is_logits)
    session = make_session(str(path))
    wanted = {i.name for i in session.get_inputs()}
    for inputs, targets in batches:
        x = spec.tensors(inputs)
        feed = {n: t.numpy() for n, t in zip(spec.names, x, strict=True) if n in wanted}
        try:
            logits = np.asarray(session.run(None, feed)[0])
        except Exception as e:
            raise ValueError(
                f"ONNX Runtime failed on a held-out batch: {one_line(e)}"
            ) from e
        metrics.add(torch.from_numpy(logits), inputs, targets)
    return metrics.result()


def _file_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def load_checkpoint(checkpoint: str | os.PathLike[str]) -> tuple[nn.Module, Workload]:
    """The model saved in a run folder's ``model.safetensors`` and its workload, from
    the file's own metadata (``workload``; ``settings`` for a built-in's batch size
    and sequence length: a ``module:function`` workload's function fixes its batch).

    Raises:
        FileNotFoundError: no such file.
        ExportError: the file is not a fleetfit model (no ``workload`` metadata), or
            its tensors do not fit that workload's model.
    """
    from server.persist import load_model
    from workloads import WorkloadError, get_workload

    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        state, meta = load_model(path)
    except Exception as e:
        raise ExportError(f"{path} is not a safetensors file: {e}") from e
    if "workload" not in meta:
        raise ExportError(
            f"{path} has no 'workload' metadata: give a model.safetensors written by a "
            "fleetfit run"
        )
    try:
        settings = json.loads(meta.get("settings") or "{}")
        if not isinstance(settings, dict):
            raise ValueError("not a JSON object")
        batch_size = int(settings.get("batch-size") or 0) or None
        seq_len = int(settings.get("seq-len") or 0) or None
    except (ValueError, TypeError) as e:
        raise ExportError(
            f"{path}: its 'settings' metadata is not what a fleetfit run writes ({e})"
        ) from None
    try:
        workload = get_workload(meta["workload"])
        if workload.kind == "custom" and (batch_size or seq_len):
            log.warning(
                "%s: ignoring batch-size=%s seq-len=%s in its settings: the batch of "
                "%s is the one its function builds",
                path,
                batch_size,
                seq_len,
                workload.name,
            )
        elif batch_size or seq_len:
            workload = workload.with_shape(batch_size, seq_len)
    except WorkloadError as e:
        raise ExportError(f"{path}: {e}") from e
    model = workload.make_model(0)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ExportError(
            f"{path} does not hold a {workload.name} model: {str(e).splitlines()[0]}"
        ) from e
    return model, workload
