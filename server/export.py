"""Export the global model to ONNX, check ONNX Runtime against torch, quantise.

- ``export_onnx``: torch's dynamo exporter (``torch.onnx.export(..., dynamo=True,
  optimize=False)``, so initializers keep their state-dict names), one input
  (``inputs``: images, or token ids) with a dynamic batch axis, one output
  (``logits``, without the loss). A model the exporter cannot handle fails with an
  ``ExportError`` naming the operator.
- ``verify``: ONNX Runtime against torch on fresh inputs of several batch sizes; they
  agree when ``max |ort - torch| <= 1e-4 * max(1, max |torch|)`` at every size.
- ``quantize_int8``: dynamic int8 quantisation (``onnxruntime.quantization``: int8
  weights of MatMul, Gemm and Conv, activations quantised at run time); the weight
  transposes the exporter leaves in front of MatMuls are folded first (ORT's
  ``quant_pre_process``), or the MatMuls would stay float.
- ``export_model``: all three plus the held-out metrics of torch, ORT and int8 ORT,
  written as a JSON report (``export.json`` in a run folder; see docs/onnx.md).

Example:
    >>> from server.export import export_model
    >>> report = export_model(model, workload, "runs/x/model.onnx", quantize=True)
    >>> report["verification"]["ok"], report["int8"]["accuracy_change"]
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from onnxrun.evaluate import evaluate_arrays, make_session, run_logits
from server.persist import atomic_write_bytes
from workloads import Workload

log = logging.getLogger(__name__)

ONNX_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
REPORT_FILE = "export.json"
INPUT_NAME = "inputs"
OUTPUT_NAME = "logits"
VERIFY_BATCH_SIZES = (1, 3, 8)  # examples per check; 1 and odd sizes catch baked shapes
RTOL = 1e-4  # agreement: max |diff| <= RTOL * max(1, max |torch output|)
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this, weights go to a side file (2 GB cap)


class ExportError(ValueError):
    """The model cannot be exported, or ONNX Runtime disagrees with torch."""


def export_input(workload: Workload, model: nn.Module | None = None) -> torch.Tensor:
    """The example input the exporter traces with (batch of at least 2).

    A batch of 1 would be specialised by ``torch.export``, which treats sizes 0 and 1
    as constants: the batch axis would not be dynamic.
    """
    x = workload.example_batch(0)[0]
    if workload.kind == "lm":
        x = x.long()
    if x.dim() == 0:
        raise ExportError(
            f"{workload.name}: its input is a scalar; export needs a batch axis"
        )
    if x.shape[0] < 2:
        x = torch.cat([x, x])
    return x[: max(2, min(int(x.shape[0]), 8))].contiguous()


def fresh_inputs(
    workload: Workload, like: torch.Tensor, batch_size: int, seed: int
) -> torch.Tensor:
    """New inputs of ``batch_size``, shaped and typed like ``like``: token ids over the
    vocabulary, images uniform in [0, 1) (the digits' range), other floats normal."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch_size, *like.shape[1:])
    if not like.is_floating_point():
        high = (
            workload.make_config().vocab_size
            if workload.kind == "lm"
            else int(like.max()) + 1
        )
        return torch.randint(high, shape, generator=g, dtype=like.dtype)
    if workload.kind == "image":
        return torch.rand(shape, generator=g, dtype=like.dtype)
    return torch.randn(shape, generator=g, dtype=like.dtype)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _quiet() -> contextlib.ExitStack:
    """Silence the exporter's progress prints and warnings (they go to the log)."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # ORT's own sessions: errors only
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript"):
        logger = logging.getLogger(name)
        stack.callback(logger.setLevel, logger.level)
        logger.setLevel(logging.ERROR)
    return stack


_OP_PATTERNS = (
    re.compile(r"OpOverload\(op='([^']+)'"),
    re.compile(r"target=torch\.ops\.([\w.]+?)(?:\.default)?\]"),
    re.compile(r"operator[: ]+'?([\w:.]+)'?", re.IGNORECASE),
)


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def unsupported_operator(e: BaseException) -> str | None:
    """The operator an export failure names, e.g. ``mylib.op`` or ``aten.foo``."""
    for cause in _causes(e):
        text = str(cause)
        for pattern in _OP_PATTERNS:
            m = pattern.search(text)
            if m:
                return m.group(1)
    return None


def _failure_message(e: BaseException, name: str) -> str:
    op = unsupported_operator(e)
    if op is not None:
        return (
            f"cannot export {name} to ONNX: operator {op} has no ONNX translation. "
            f"Replace it in the model with standard torch operations, or give "
            f"torch.onnx.export a custom_translation_table entry for it"
        )
    last = list(_causes(e))[-1]
    first_line = str(last).strip().splitlines()[0] if str(last).strip() else ""
    return f"cannot export {name} to ONNX: {type(last).__name__}: {first_line}"


def export_onnx(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
) -> Path:
    """Export ``model`` (eval mode) to ``path``: input ``inputs`` with a dynamic batch
    axis, output ``logits``.

    Args:
        external_data: weights in a side file ``<path>.data``; by default only above
            ``EXTERNAL_DATA_BYTES`` (protobuf files cannot exceed 2 GB).

    Raises:
        ExportError: the exporter failed; the message names the operator it could not
            translate when it said which.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x = export_input(workload, model)
    if external_data is None:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        external_data = size > EXTERNAL_DATA_BYTES
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    # A single file is written beside and then moved into place; with external data
    # the graph names its side file (``<path>.data``), so it is written in place.
    tmp = path if external_data else path.with_name(f".{path.name}.tmp")
    t0 = time.perf_counter()
    try:
        with _eval_mode(model), _quiet():
            torch.onnx.export(
                model,
                (x,),
                str(tmp),
                dynamo=True,
                optimize=False,
                verbose=False,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_shapes=({0: batch},),
                external_data=external_data,
            )
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise ExportError(_failure_message(e, workload.name)) from e
    if tmp != path:
        os.replace(tmp, path)
    log.info(
        "exported %s to %s in %.1f s", workload.name, path, time.perf_counter() - t0
    )
    return path


@torch.no_grad()
def verify(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    seed: int = 1234,
) -> dict[str, Any]:
    """ONNX Runtime against torch on fresh inputs, one check per batch size.

    Returns:
        ``ok``, ``tolerance`` (the rule), and per batch size ``max_abs_diff``,
        ``bound`` and ``max_abs_output``.
    """
    session = make_session(str(path), low_memory=False)
    like = export_input(workload, model)
    rows = []
    with _eval_mode(model):
        for i, b in enumerate(batch_sizes):
            x = fresh_inputs(workload, like, b, seed + i)
            ref = model(x)
            ref = ref[0] if isinstance(ref, tuple | list) else ref
            ref_np = ref.float().numpy()
            got = run_logits(session, x.numpy())
            if got.shape != ref_np.shape:
                raise ExportError(
                    f"{workload.name}: ONNX output shape {got.shape} differs from "
                    f"torch's {ref_np.shape} at batch size {b}"
                )
            diff = float(np.abs(got.astype(np.float64) - ref_np).max())
            top = float(np.abs(ref_np).max())
            rows.append(
                {
                    "batch_size": b,
                    "max_abs_diff": diff,
                    "max_abs_output": top,
                    "bound": RTOL * max(1.0, top),
                }
            )
    return {
        "ok": all(r["max_abs_diff"] <= r["bound"] for r in rows),
        "tolerance": f"max |ort - torch| <= {RTOL:g} * max(1, max |torch|)",
        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
        "batches": rows,
    }


def quantize_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Dynamic int8 quantisation of ``src`` into ``dst`` (weights int8, activations
    quantised per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    dst = Path(dst)
    large = os.path.getsize(src) > EXTERNAL_DATA_BYTES or Path(f"{src}.data").exists()
    with tempfile.TemporaryDirectory(prefix="fleetfit-quant-") as tmp:
        pre = os.path.join(tmp, "pre.onnx")
        # Folds Transpose(weight) -> MatMul into a constant weight, which dynamic
        # quantisation needs to see; no symbolic shape inference (not needed here).
        with _quiet():
            quant_pre_process(
                str(src), pre, skip_symbolic_shape=True, save_as_external_data=large
            )
            out = dst.with_name(f".{dst.name}.tmp")
            quantize_dynamic(
                pre,
                str(out),
                weight_type=QuantType.QInt8,
                use_external_data_format=large,
            )
    os.replace(out, dst)
    return dst


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
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Export, verify, optionally quantise, evaluate; write the report.

    Writes ``path`` (e.g. ``model.onnx``), with ``quantize`` also ``model.int8.onnx``
    beside it, and the JSON report at ``report_path`` (default: ``export.json`` beside
    ``path``). Held-out metrics (torch, ORT, int8 ORT) need a classifier or language
    model; other workloads get ``evaluation: null``.

    Raises:
        ExportError: export failed (naming the operator) or ORT disagrees with torch
            beyond the bound (the report is written first).
    """
    path = Path(path)
    report_path = Path(report_path) if report_path else path.with_name(REPORT_FILE)
    t0 = time.perf_counter()
    export_onnx(model, workload, path)
    export_s = time.perf_counter() - t0
    check = verify(model, workload, path, batch_sizes=batch_sizes)
    like = export_input(workload, model)
    report: dict[str, Any] = {
        "schema": 1,
        "workload": workload.name,
        **(extra or {}),
        "file": path.name,
        "bytes": _file_bytes(path),
        "input": {
            "name": INPUT_NAME,
            "shape": ["batch", *like.shape[1:]],
            "dtype": str(like.dtype).removeprefix("torch."),
        },
        "output": OUTPUT_NAME,
        "export_s": export_s,
        "verification": check,
        "evaluation": None,
        "int8": None,
    }
    if workload.kind in ("image", "lm"):
        x, y = workload.eval_arrays()
        report["evaluation"] = {
            "num_examples": int(y.size),
            "torch": _metrics(workload.evaluate(model)),
            "onnxruntime": _metrics(
                evaluate_arrays(make_session(str(path)), x, y, workload.kind)
            ),
        }
    if quantize:
        q = quantize_int8(
            path, path.with_name(path.name.removesuffix(".onnx") + ".int8.onnx")
        )
        int8: dict[str, Any] = {"file": q.name, "bytes": _file_bytes(q)}
        if report["evaluation"] is not None:
            m = _metrics(evaluate_arrays(make_session(str(q)), x, y, workload.kind))
            base = report["evaluation"]["onnxruntime"]
            report["evaluation"]["int8"] = m
            int8["accuracy_change"] = m["accuracy"] - base["accuracy"]
            int8["loss_change"] = m["loss"] - base["loss"]
        report["int8"] = int8
    atomic_write_bytes(report_path, json.dumps(report, indent=2).encode())
    if not check["ok"]:
        worst = max(check["batches"], key=lambda r: r["max_abs_diff"] / r["bound"])
        raise ExportError(
            f"{workload.name}: ONNX Runtime disagrees with torch at batch size "
            f"{worst['batch_size']}: max |diff| {worst['max_abs_diff']:.3g} > bound "
            f"{worst['bound']:.3g} (report: {report_path})"
        )
    return report


def _file_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def load_checkpoint(checkpoint: str | os.PathLike[str]) -> tuple[nn.Module, Workload]:
    """The model saved in a run folder's ``model.safetensors`` and its workload, from
    the file's own metadata (``workload``; ``settings`` for batch size and sequence
    length).

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
        int(settings.get("batch-size") or 0), int(settings.get("seq-len") or 0)
    except (ValueError, TypeError) as e:
        raise ExportError(
            f"{path}: its 'settings' metadata is not what a fleetfit run writes ({e})"
        ) from None
    try:
        workload = get_workload(
            meta["workload"],
            batch_size=int(settings.get("batch-size") or 0) or None,
            seq_len=int(settings.get("seq-len") or 0) or None,
        )
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
