"""What a client answers: written by ``client`` and read by ``server``, here only.

A train reply holds ``arrays`` (the trained state: every key for ``full``, the window
and head for ``part``, none for ``none``), ``metrics`` (``num-examples`` and what the
node measured) and ``report`` (the assignment that ran, how the peak was measured).

``read_train_reply`` reads a reply from any node, a stock client or a misbehaving
one, arrays included: it raises ``MalformedReply`` (a ``ValueError``) naming what is
wrong where the server cannot use the reply, whatever the fault, and otherwise keeps
what it can (an optional figure of the wrong type, not finite or out of range is
``None``; an evaluation without a loss or with an accuracy outside [0, 1] is an
error, not a result).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from wire import keys

MAX_BYTES = 2**60  # 1 EiB: a larger memory or message figure is nonsense
MAX_EXAMPLES = 2**53  # a claimed example count above this is malformed; the server
#   caps what it believes far lower (run config ``max-examples``)
MAX_PARTITION = 2**31 - 1
MAX_TEXT = 300  # characters kept of a reply's texts (reasons, errors)
PEAK_METHODS = ("child", "inline", "inline-unreset", "ort-child")
EVAL_RUNTIMES = ("onnxruntime", "torch")


class MalformedReply(ValueError):
    """A reply the server cannot use (the round goes on without it)."""


@dataclass(frozen=True)
class EvalResult:
    """An evaluation-only node's result on its own data (``none`` assignments)."""

    loss: float | None = None
    accuracy: float | None = None
    num_examples: int | None = None
    eval_s: float | None = None
    runtime: str = ""  # onnxruntime
    error: str = ""  # why the evaluation failed ("" where it ran)
    peak_bytes: int | None = None
    baseline_bytes: int | None = None

    @property
    def ran(self) -> bool:
        return self.num_examples is not None


@dataclass(frozen=True)
class TrainReply:
    """A train reply's figures and report (its arrays travel beside it)."""

    kind: str  # full | part | none: the assignment that ran
    num_examples: int | None = None  # items in the node's share (0 for none)
    partition_id: int | None = None
    train_loss: float | None = None  # mean loss over the local steps
    train_s: float | None = None  # wall time of the local steps
    peak_bytes: int | None = None  # measured peak above the baseline
    baseline_bytes: int | None = None
    message_bytes: int | None = None  # bytes of the instruction the node received
    steps_done: int | None = None
    min_budget_bytes: int | None = None  # none: the budget that would get a part
    peak_method: str | None = None  # child | inline | inline-unreset | ort-child
    window: tuple[int, int] | None = None  # part: the trained window
    reason: str = ""  # none: why nothing fits
    eval: EvalResult | None = None  # none: the evaluation on the node's data

    def to_content(self, arrays: ArrayRecord | None = None) -> RecordDict:
        """The reply's records (``arrays`` for full and part)."""
        figures: tuple[tuple[str, Any], ...] = (
            (keys.NUM_EXAMPLES, self.num_examples),
            (keys.TRAIN_LOSS, self.train_loss),
            (keys.TRAIN_S, self.train_s),
            (keys.PARTITION_ID, self.partition_id),
            (keys.PEAK_BYTES, self.peak_bytes),
            (keys.BASELINE_BYTES, self.baseline_bytes),
            (keys.MESSAGE_BYTES, self.message_bytes),
            (keys.STEPS_DONE, self.steps_done),
            (keys.MIN_BUDGET_BYTES, self.min_budget_bytes),
        )
        report: dict[str, Any] = {keys.KIND: self.kind}
        if self.peak_method is not None:
            report[keys.PEAK_METHOD] = self.peak_method
        if self.window is not None:
            report[keys.WINDOW] = list(self.window)
        if self.reason:
            report[keys.REASON] = self.reason
        if self.eval is not None:
            e = self.eval
            figures += (
                (keys.EVAL_LOSS, e.loss),
                (keys.EVAL_ACCURACY, e.accuracy),
                (keys.EVAL_NUM_EXAMPLES, e.num_examples),
                (keys.EVAL_S, e.eval_s),
            )
            if e.peak_bytes is not None:  # the evaluation's peak is the node's
                figures += (
                    (keys.PEAK_BYTES, e.peak_bytes),
                    (keys.BASELINE_BYTES, e.baseline_bytes),
                )
            if e.runtime:
                report[keys.EVAL_RUNTIME] = e.runtime
            if e.error:
                report[keys.EVAL_ERROR] = e.error
        metrics: dict[str, int | float | list[int] | list[float]] = {
            k: v for k, v in figures if v is not None
        }
        records: dict[str, Any] = {
            keys.METRICS: MetricRecord(metrics),
            keys.REPORT: ConfigRecord(report),
        }
        if arrays is not None:
            records = {keys.ARRAYS: arrays, **records}
        return RecordDict(records)

    @classmethod
    def from_content(cls, content: RecordDict, *, kind: str) -> TrainReply:
        """Read a reply to an assignment of ``kind`` (``read_train_reply`` reads its
        arrays too, and turns any fault into ``MalformedReply``).

        Optional figures that are missing, of the wrong type, not finite or out of
        range are ``None``; texts are cut to ``MAX_TEXT`` characters.

        Raises:
            MalformedReply: no metrics; for ``full`` and ``part``, no arrays, a
                ``num-examples`` that is not an integer in 1..``MAX_EXAMPLES``, a
                ``train-loss`` that is not a number, a ``partition-id`` that is not an
                integer in 0..2**31-1.
        """
        record = content.config_records.get(keys.REPORT)
        report: dict[str, Any] = dict(record) if record is not None else {}
        metrics = _one(content.metric_records, keys.METRICS, "MetricRecord")
        common: dict[str, Any] = {
            "peak_bytes": _opt_int(metrics.get(keys.PEAK_BYTES)),
            "baseline_bytes": _opt_int(metrics.get(keys.BASELINE_BYTES)),
            "message_bytes": _opt_int(metrics.get(keys.MESSAGE_BYTES)),
            "train_s": _opt_float(metrics.get(keys.TRAIN_S)),
            "num_examples": _opt_int(metrics.get(keys.NUM_EXAMPLES)),
            "peak_method": _opt_text(report.get(keys.PEAK_METHOD), PEAK_METHODS),
            "steps_done": _opt_int(metrics.get(keys.STEPS_DONE)),
        }
        if kind == "none":
            return cls(
                "none",
                **common,
                partition_id=_opt_int(metrics.get(keys.PARTITION_ID), MAX_PARTITION),
                min_budget_bytes=_opt_int(metrics.get(keys.MIN_BUDGET_BYTES)),
                reason=_opt_text(report.get(keys.REASON)) or "",
                eval=_eval_result(metrics, report, common),
            )
        _one(content.array_records, keys.ARRAYS, "ArrayRecord")
        if keys.NUM_EXAMPLES not in metrics:
            raise MalformedReply(f"no metric {keys.NUM_EXAMPLES!r} in the reply")
        common["num_examples"] = _as_int(
            metrics[keys.NUM_EXAMPLES], keys.NUM_EXAMPLES, 1, MAX_EXAMPLES
        )
        loss = metrics.get(keys.TRAIN_LOSS)
        if loss is not None and (
            isinstance(loss, bool) or not isinstance(loss, int | float)
        ):
            raise MalformedReply(f"{keys.TRAIN_LOSS} {str(loss)[:40]} is not a number")
        pid = metrics.get(keys.PARTITION_ID)
        return cls(
            kind,
            **common,
            # a NaN or infinite loss is not averaged (the arrays are checked apart)
            train_loss=_opt_float(loss, low=-math.inf),
            partition_id=(
                None
                if pid is None
                else _as_int(pid, keys.PARTITION_ID, 0, MAX_PARTITION)
            ),
        )

    @staticmethod
    def arrays(content: RecordDict) -> ArrayRecord:
        """The reply's trained arrays (``arrays``, or its only ArrayRecord)."""
        return _one(content.array_records, keys.ARRAYS, "ArrayRecord")


@dataclass(frozen=True)
class EvalReply:
    """An evaluate reply: the model's loss and accuracy on the node's held-out data."""

    loss: float
    accuracy: float
    num_examples: int

    def to_content(self) -> RecordDict:
        return RecordDict(
            {
                keys.METRICS: MetricRecord(
                    {
                        keys.EVAL_LOSS: self.loss,
                        keys.EVAL_ACCURACY: self.accuracy,
                        keys.NUM_EXAMPLES: self.num_examples,
                    }
                )
            }
        )

    @classmethod
    def from_content(cls, content: RecordDict) -> EvalReply:
        """Read an evaluate reply (``MalformedReply`` naming what is wrong)."""
        metrics = _one(content.metric_records, keys.METRICS, "MetricRecord")
        loss = _opt_float(metrics.get(keys.EVAL_LOSS))
        accuracy = _opt_float(metrics.get(keys.EVAL_ACCURACY), high=1.0)
        for key, v in ((keys.EVAL_LOSS, loss), (keys.EVAL_ACCURACY, accuracy)):
            if v is None:
                raise MalformedReply(
                    f"{key} {_show(metrics.get(key))} is not a number in range"
                )
        assert loss is not None and accuracy is not None
        num = _as_int(
            metrics.get(keys.NUM_EXAMPLES), keys.NUM_EXAMPLES, 1, MAX_EXAMPLES
        )
        return cls(loss, accuracy, num)


def _eval_result(
    metrics: Any, report: dict[str, Any], common: dict[str, Any]
) -> EvalResult | None:
    """An evaluation-only node's result; one that counts has a number of examples, a
    loss >= 0 and an accuracy in [0, 1]. Anything less is an error, not a result."""
    num = _opt_int(metrics.get(keys.EVAL_NUM_EXAMPLES), MAX_EXAMPLES)
    loss = _opt_float(metrics.get(keys.EVAL_LOSS))
    accuracy = _opt_float(metrics.get(keys.EVAL_ACCURACY), high=1.0)
    error = _opt_text(report.get(keys.EVAL_ERROR)) or ""
    if num is not None and (num < 1 or loss is None or accuracy is None):
        bad = {
            keys.EVAL_NUM_EXAMPLES: metrics.get(keys.EVAL_NUM_EXAMPLES),
            keys.EVAL_LOSS: metrics.get(keys.EVAL_LOSS),
            keys.EVAL_ACCURACY: metrics.get(keys.EVAL_ACCURACY),
        }
        error = error or "malformed evaluation: " + ", ".join(
            f"{k}={_show(v)}" for k, v in bad.items()
        )
        num = loss = accuracy = None
    elif num is None:
        loss = accuracy = None
    result = EvalResult(
        loss=loss,
        accuracy=accuracy,
        num_examples=num,
        eval_s=_opt_float(metrics.get(keys.EVAL_S)),
        runtime=_opt_text(report.get(keys.EVAL_RUNTIME), EVAL_RUNTIMES) or "",
        error=error,
        peak_bytes=common["peak_bytes"],
        baseline_bytes=common["baseline_bytes"],
    )
    return result if result.ran or result.error else None


def read_train_reply(
    content: RecordDict, *, kind: str
) -> tuple[TrainReply, dict[str, np.ndarray] | None]:
    """The one reader of a train reply from any node: its figures and (``full``,
    ``part``) its arrays (native numpy arrays of the dtypes ``torch.from_numpy``
    takes; wire imports no torch), or ``MalformedReply`` with the
    reason, whatever the fault (missing or renamed records, values of any type,
    array bytes that are empty, a zip file, truncated, of an object or non-native
    dtype). The arrays' keys, shapes and values are checked against the model by
    ``server.aggregate``.
    """
    try:
        reply = TrainReply.from_content(content, kind=kind)
        if kind == "none":
            return reply, None
        return reply, _state_arrays(TrainReply.arrays(content))
    except MalformedReply:
        raise
    except Exception as e:  # a peer's bytes: any fault is a rejection, not a crash
        raise MalformedReply(
            f"unreadable reply ({type(e).__name__}: {_show(e, 120)})"
        ) from None


_DTYPES = frozenset(
    (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "float16",
        "float32",
        "float64",
    )
)  # numpy dtypes that torch.from_numpy takes


def _state_arrays(arrays: Any) -> dict[str, np.ndarray]:
    if not isinstance(arrays, ArrayRecord):
        raise MalformedReply("arrays is not an ArrayRecord")
    state = {}
    for key in list(arrays.keys()):
        value = arrays[key].numpy()  # np.load(allow_pickle=False)
        if (
            not isinstance(value, np.ndarray)
            or value.dtype.name not in _DTYPES
            or not value.dtype.isnative
        ):
            raise MalformedReply(
                f"array {key[:80]!r} has dtype {getattr(value, 'dtype', '?')}; "
                "expected a native bool, integer or float array"
            )
        state[key] = np.ascontiguousarray(value)
    return state


def _one(records: Any, key: str, what: str) -> Any:
    """The record under ``key``, or the only record of its kind (a plain client may
    name it otherwise)."""
    if key in records:
        return records[key]
    if len(records) == 1:
        return next(iter(records.values()))
    raise MalformedReply(f"no {what} {key!r} in the reply")


def _finite(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _opt_int(value: Any, high: int = MAX_BYTES) -> int | None:
    """An optional count or size: an integral number in 0..``high``, else None."""
    if not _finite(value) or value != int(value) or not 0 <= value <= high:
        return None
    return int(value)


def _opt_float(value: Any, low: float = 0.0, high: float = math.inf) -> float | None:
    """An optional finite number in [low, high] (times, losses, accuracies)."""
    if not _finite(value) or not low <= value <= high:
        return None
    return float(value)


def _opt_text(value: Any, choices: tuple[str, ...] | None = None) -> str | None:
    """A text of the report, cut to ``MAX_TEXT`` characters; one of ``choices``."""
    if not isinstance(value, str) or (choices is not None and value not in choices):
        return None
    return value[:MAX_TEXT]


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text[:limit]


def _as_int(value: Any, key: str, low: int, high: int) -> int:
    """An integer metric in ``low..high``; lists and non-integral values are
    malformed."""
    if not _finite(value) or value != int(value) or not low <= value <= high:
        raise MalformedReply(
            f"{key}: expected an integer in {low}..{high}, got {_show(value)}"
        )
    return int(value)
