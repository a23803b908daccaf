"""The exporter call: a model to an ONNX file (torch's dynamo exporter).

``torch.onnx.export(..., dynamo=True, optimize=False)``, so initializers keep their
state-dict names. A tensor-input workload gets one input (``inputs``: images, or token
ids) with a dynamic batch axis; an ``any_model`` workload (dict or tuple inputs, see
``server.export_inputs``) gets one input per tensor, named by its dict key (``labels``
left out), through ``LogitsModel``, with a dynamic batch axis and, where the exporter
allows it, a dynamic sequence axis. The output is ``logits``, without the loss. A
model the exporter cannot handle fails with an ``ExportError`` naming the operator.

Example:
    >>> from server.export_graph import export_onnx
    >>> export_onnx(model, workload, "runs/x/model.onnx")
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.export_base import (
    EXTERNAL_DATA_BYTES,
    OUTPUT_NAME,
    ExportError,
    eval_mode,
    failure_message,
    model_name,
    one_line,
    quiet,
)
from server.export_inputs import (
    INPUT_NAME,
    LogitsModel,
    ModelInputs,
    batch_rows,
    dynamic_shapes,
    is_tokens,
)
from workloads import Workload
from workloads.node_data import batch_size_of

log = logging.getLogger(__name__)


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


def any_example(model: nn.Module, workload: Workload) -> tuple[ModelInputs, Any]:
    """The input layout and the example inputs of an ``any_model`` workload."""
    assert workload.example is not None, "an any_model workload keeps its example"
    inputs = workload.example[0]
    try:
        return ModelInputs.of(inputs), inputs
    except ValueError as e:
        raise ExportError(
            f"cannot export {model_name(model, workload)} to ONNX: {e}"
        ) from None


def export_onnx(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    *,
    external_data: bool | None = None,
) -> Path:
    """Export ``model`` (eval mode) to ``path``: input ``inputs`` with a dynamic batch
    axis, output ``logits`` (an ``any_model`` workload: one input per tensor of its
    example inputs, see ``server.export_inputs``).

    Args:
        external_data: weights in a side file ``<path>.data``; by default only above
            ``EXTERNAL_DATA_BYTES`` (protobuf files cannot exceed 2 GB).

    Raises:
        ExportError: the exporter failed; the message names the operator it could not
            translate when it said which.
    """
    return export_graph(model, workload, path, external_data)[0]


def export_graph(
    model: nn.Module,
    workload: Workload,
    path: str | os.PathLike[str],
    external_data: bool | None,
) -> tuple[Path, dict[str, Any]]:
    """``export_onnx``, and the report's description of the graph's inputs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        external_data = size > EXTERNAL_DATA_BYTES
    # A single file is written beside and then moved into place; with external data
    # the graph names its side file (``<path>.data``), so it is written in place.
    tmp = path if external_data else path.with_name(f".{path.name}.tmp")
    t0 = time.perf_counter()
    try:
        if workload.any_model:
            info = _export_any(model, workload, tmp, external_data)
        else:
            info = _export_tensor(model, workload, tmp, external_data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if tmp != path:
        os.replace(tmp, path)
    log.info(
        "exported %s to %s in %.1f s", workload.name, path, time.perf_counter() - t0
    )
    return path, info


def _export_tensor(
    model: nn.Module, workload: Workload, tmp: Path, external_data: bool
) -> dict[str, Any]:
    x = export_input(workload, model)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    try:
        with eval_mode(model), quiet():
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
        raise ExportError(failure_message(e, workload.name)) from e
    return {
        "input": {
            "name": INPUT_NAME,
            "shape": ["batch", *x.shape[1:]],
            "dtype": str(x.dtype).removeprefix("torch."),
        }
    }


def _export_any(
    model: nn.Module, workload: Workload, tmp: Path, external_data: bool
) -> dict[str, Any]:
    """Export through ``LogitsModel``: a dynamic batch axis, and a dynamic sequence
    axis on token inputs unless the exporter refuses it (then a static one, noted)."""
    name = model_name(model, workload)
    spec, inputs = any_example(model, workload)
    example = spec.tensors(inputs)
    batch = batch_size_of(example)
    # 2 to 8 examples: torch.export would specialise a batch of 1
    x = batch_rows(example, batch, max(2, min(batch, 8)))
    batch = batch_size_of(x)
    wrapper = LogitsModel(model, spec)
    try:
        with eval_mode(model), torch.no_grad():
            wrapper(*x)
    except Exception as e:
        raise ExportError(
            f"cannot export {name} to ONNX: it fails on its example inputs "
            f"({', '.join(spec.names)}): {one_line(e)}"
        ) from e
    has_tokens = any(is_tokens(t) and t.shape[0] == batch for t in x)
    note = None
    program = None
    for seq in (True, False) if has_tokens else (False,):
        shapes = dynamic_shapes(x, batch, seq=seq)
        try:
            with eval_mode(model), quiet():
                program = torch.onnx.export(
                    wrapper,
                    x,
                    None,
                    dynamo=True,
                    optimize=False,
                    verbose=False,
                    input_names=list(spec.names),
                    output_names=[OUTPUT_NAME],
                    dynamic_shapes=(shapes,),  # forward(*tensors): one entry
                )
            break
        except Exception as e:
            if not seq:
                raise ExportError(failure_message(e, name)) from e
            cause = failure_message(e, name).split(" to ONNX: ", 1)[-1]
            note = f"the exporter refused a dynamic sequence axis ({cause})"
            log.warning("%s: static sequence axis: %s", name, note)
    assert program is not None
    try:
        for value in list(program.model.graph.initializers.values()):
            if value.name and value.name.startswith("model."):  # the wrapper's
                value.name = value.name.removeprefix("model.")  # prefix: state dict
        with quiet():
            program.save(str(tmp), external_data=external_data)
    except Exception as e:
        raise ExportError(failure_message(e, name)) from e
    # As exported: torch.onnx may fix an axis it was asked to keep dynamic.
    graph_shapes = {
        v.name: [d if isinstance(d, int) else str(d) for d in v.shape or ()]
        for v in program.model.graph.inputs
    }
    described: list[dict[str, Any]] = [
        {
            "name": n,
            "shape": graph_shapes.get(n, list(t.shape)),
            "dtype": str(t.dtype).removeprefix("torch."),
        }
        for n, t in zip(spec.names, x, strict=True)
    ]
    info: dict[str, Any] = {"input": described[0], "inputs": described}
    if has_tokens:
        fixed = [
            d["name"]
            for d, axes in zip(described, shapes, strict=True)
            if 1 in axes and isinstance(d["shape"][1], int)
        ]
        if fixed and note is None:
            note = (
                f"the exporter fixed the length of {', '.join(fixed)} at "
                f"{described[spec.names.index(fixed[0])]['shape'][1]} (the model "
                "needs that length)"
            )
        info["sequence_axis"] = "static" if note else "dynamic"
        if note:
            info["sequence_axis_note"] = note
    return info
