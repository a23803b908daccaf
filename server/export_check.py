"""ONNX Runtime against torch, and dynamic int8 quantisation of an exported graph.

- ``verify``: ONNX Runtime against torch on fresh inputs of several batch sizes (an
  ``any_model`` workload: its example batch, and 1 and 3 examples made from it); they
  agree when ``max |ort - torch| <= 1e-4 * max(1, max |torch|)`` at every size.
- ``quantize_int8``: dynamic int8 quantisation (``onnxruntime.quantization``: int8
  weights of MatMul, Gemm and Conv, activations quantised at run time); the weight
  transposes the exporter leaves in front of MatMuls are folded first (ORT's
  ``quant_pre_process``), or the MatMuls would stay float.

Example:
    >>> from server.export_check import verify
    >>> verify(model, workload, "runs/x/model.onnx")["ok"]
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from onnxrun.evaluate import make_session, run_logits
from server.export_base import (
    EXTERNAL_DATA_BYTES,
    ExportError,
    eval_mode,
    model_name,
    one_line,
    quiet,
)
from server.export_graph import any_example, export_input
from server.export_inputs import LogitsModel, batch_rows
from workloads import Workload
from workloads.node_data import batch_size_of

VERIFY_BATCH_SIZES = (1, 3, 8)  # examples per check; 1 and odd sizes catch baked shapes
ANY_MODEL_BATCH_SIZES = (1, 3)  # any_model: made from its example, checked beside it
RTOL = 1e-4  # agreement: max |diff| <= RTOL * max(1, max |torch output|)


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


def _compare(
    name: str, ref: torch.Tensor, got: np.ndarray, **row: Any
) -> dict[str, Any]:
    """One check's row: ``max |got - ref|`` against its bound."""
    ref_np = ref.float().numpy()
    if got.shape != ref_np.shape:
        where = f"batch size {row['batch_size']}"
        if "seq_len" in row:
            where += f", {row['seq_len']} tokens"
        raise ExportError(
            f"{name}: ONNX output shape {got.shape} differs from torch's "
            f"{ref_np.shape} at {where}"
        )
    top = float(np.abs(ref_np).max()) if ref_np.size else 0.0
    diff = float(np.abs(got.astype(np.float64) - ref_np).max()) if ref_np.size else 0.0
    return {
        **row,
        "max_abs_diff": diff,
        "max_abs_output": top,
        "bound": RTOL * max(1.0, top),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": all(r["max_abs_diff"] <= r["bound"] for r in rows),
        "tolerance": f"max |ort - torch| <= {RTOL:g} * max(1, max |torch|)",
        "max_abs_diff": max(r["max_abs_diff"] for r in rows),
        "batches": rows,
    }


@torch.no_grad()
def verify(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    batch_sizes: Sequence[int] | None = None,
    seed: int = 1234,
) -> dict[str, Any]:
    """ONNX Runtime against torch, one check per batch size: fresh inputs
    (``VERIFY_BATCH_SIZES``), or for an ``any_model`` workload its example batch and
    ``ANY_MODEL_BATCH_SIZES`` examples sliced or repeated from it (and, with a dynamic
    sequence axis, the example cut to half its length).

    Returns:
        ``ok``, ``tolerance`` (the rule), and per batch size ``max_abs_diff``,
        ``bound`` and ``max_abs_output``.

    Raises:
        ExportError: an output of another shape than torch's, or (``any_model``) a run
            that fails.
    """
    if workload.any_model:
        try:
            return _verify_any(model, workload, path, batch_sizes)
        except ExportError:
            raise
        except Exception as e:
            raise ExportError(
                f"{model_name(model, workload)}: checking ONNX Runtime against "
                f"torch failed: {one_line(e)}"
            ) from e
    session = make_session(str(path), low_memory=False)
    like = export_input(workload, model)
    rows = []
    with eval_mode(model):
        for i, b in enumerate(batch_sizes or VERIFY_BATCH_SIZES):
            x = fresh_inputs(workload, like, b, seed + i)
            ref = model(x)
            ref = ref[0] if isinstance(ref, tuple | list) else ref
            got = run_logits(session, x.numpy())
            rows.append(_compare(workload.name, ref, got, batch_size=b))
    return _summary(rows)


def _verify_any(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    batch_sizes: Sequence[int] | None,
) -> dict[str, Any]:
    name = model_name(model, workload)
    spec, inputs = any_example(model, workload)
    example = spec.tensors(inputs)
    batch = batch_size_of(example)
    session = make_session(str(path), low_memory=False)
    dynamic_seq = {
        i.name
        for i in session.get_inputs()
        if len(i.shape) == 2 and isinstance(i.shape[1], str)
    }
    cases: list[tuple[dict[str, Any], tuple[torch.Tensor, ...]]] = [
        ({"batch_size": b}, batch_rows(example, batch, b))
        for b in batch_sizes or ANY_MODEL_BATCH_SIZES
        if b != batch
    ]
    cases.append(({"batch_size": batch, "example": True}, example))
    lengths = [int(t.shape[1]) for n, t in zip(spec.names, example) if n in dynamic_seq]
    if lengths and min(lengths) >= 4:  # the token inputs cut to half their length
        cut = tuple(
            t[:, : t.shape[1] // 2].contiguous() if n in dynamic_seq else t
            for n, t in zip(spec.names, example, strict=True)
        )
        cases.append(({"batch_size": batch, "seq_len": lengths[0] // 2}, cut))
    wrapper = LogitsModel(model, spec)
    wanted = {i.name for i in session.get_inputs()}
    rows = []
    with eval_mode(model):
        for row, x in cases:
            feed = {
                n: t.numpy() for n, t in zip(spec.names, x, strict=True) if n in wanted
            }
            got = np.asarray(session.run(None, feed)[0])
            rows.append(_compare(name, wrapper(*x), got, **row))
    return _summary(rows)


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
        with quiet():
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
