"""What every step of ONNX export shares: ``ExportError``, failures told in one line.

- ``ExportError``: the model cannot be exported, or ONNX Runtime disagrees with torch.
- ``unsupported_operator``: the operator an exporter failure names (``aten.foo``,
  ``mylib.op``) when the failure is a missing ONNX translation; ``failure_message``
  turns any exporter failure into one line that names it, or its root cause with a
  hint of what to change in the model.
- ``quiet``: the exporter's progress prints and warnings go to the debug log.

The steps themselves: ``server.export_graph`` (the exporter call),
``server.export_check`` (ONNX Runtime against torch, int8) and ``server.export`` (the
report).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Iterator

from torch import nn

from workloads import Workload

log = logging.getLogger(__name__)

OUTPUT_NAME = "logits"
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this, weights go to a side file (2 GB cap)


class ExportError(ValueError):
    """The model cannot be exported, or ONNX Runtime disagrees with torch."""


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block, then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def quiet() -> contextlib.ExitStack:
    """Silence the exporter's progress prints (to the debug log) and warnings.

    ``torch.export`` prints the partial graph of a failed export to stderr; the
    failure itself reaches the caller as an ``ExportError``.
    """
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # ORT's own sessions: errors only
    stack = contextlib.ExitStack()
    printed = io.StringIO()

    def to_log() -> None:
        if printed.getvalue():
            log.debug("the exporter printed:\n%s", printed.getvalue())

    stack.callback(to_log)
    stack.enter_context(contextlib.redirect_stdout(printed))
    stack.enter_context(contextlib.redirect_stderr(printed))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    for name in (
        "torch.onnx",
        "torch.export",
        "torch._dynamo",
        "torch.fx.experimental.symbolic_shapes",  # a failed guard: graph and code
        "onnxscript",
        "onnx_ir",
    ):
        logger = logging.getLogger(name)
        stack.callback(logger.setLevel, logger.level)
        logger.setLevel(logging.ERROR)
    return stack


_OP_PATTERNS = (
    re.compile(r"OpOverload\(op='([^']+)'"),
    re.compile(r"target=torch\.ops\.([\w.]+?)(?:\.default)?\]"),
    re.compile(r"operator[: ]+'?([\w:.]+)'?", re.IGNORECASE),
)


_HINTS = {  # a failure's exception type -> what to change in the model
    "GuardOnDataDependentSymNode": (
        ". The model branches in Python on a tensor's values; write the branch as "
        "torch.where or torch.cond"
    ),
}


def _causes(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


_TRANSLATION_FAILURES = (  # what the exporter says when an operator has no ONNX
    "No ONNX function found",  # function; other failures also name the node that
    "Error when translating node",  # failed (``target=torch.ops.aten.view...``)
    "Unsupported FX nodes",
    "has no ONNX translation",
)


def unsupported_operator(e: BaseException) -> str | None:
    """The operator an export failure names, e.g. ``mylib.op`` or ``aten.foo``, when
    the failure is a missing ONNX translation (None for other failures)."""
    if not any(m in str(c) for c in _causes(e) for m in _TRANSLATION_FAILURES):
        return None
    for cause in _causes(e):
        text = str(cause)
        for pattern in _OP_PATTERNS:
            m = pattern.search(text)
            if m:
                return m.group(1)
    return None


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (the type alone for an empty message)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def failure_message(e: BaseException, name: str) -> str:
    """``cannot export <name> to ONNX: ...``: the operator without a translation, or
    the root cause (with a hint where its type has one)."""
    op = unsupported_operator(e)
    if op is not None:
        return (
            f"cannot export {name} to ONNX: operator {op} has no ONNX translation. "
            f"Replace it in the model with standard torch operations, or give "
            f"torch.onnx.export a custom_translation_table entry for it"
        )
    causes = list(_causes(e))
    hint = next(
        (_HINTS[type(c).__name__] for c in causes if type(c).__name__ in _HINTS), ""
    )
    cause = one_line(causes[-1])
    if hint:
        cause = cause.rstrip(". ") + hint
    return f"cannot export {name} to ONNX: {cause}"


def model_name(model: nn.Module, workload: Workload) -> str:
    """The workload, with the model's class for a user's model."""
    if workload.any_model:
        return f"{workload.name} ({type(model).__name__})"
    return workload.name
