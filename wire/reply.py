"""What a client answers: written by ``client`` and read by ``server``, here only.

A train reply holds ``arrays`` (the trained state: every key for ``full``, the window
and head for ``part``, none for ``none``), ``metrics`` (``num-examples`` and what the
node measured) and ``report`` (the assignment that ran, how the peak was measured).

``TrainReply.from_content`` reads a reply from any node, a stock client or a
misbehaving one: it raises ``MalformedReply`` (a ``ValueError``) naming what is wrong
where the server cannot use the reply, and otherwise keeps what it can (an optional
figure of the wrong type is ``None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from wire import keys


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
        """Read a reply to an assignment of ``kind``.

        Raises:
            MalformedReply: no metrics; for ``full`` and ``part``, no arrays, a
                ``num-examples`` that is not an integer, a ``train-loss`` or a
                ``partition-id`` of the wrong type.
        """
        report = dict(content.config_records.get(keys.REPORT, {}))
        metrics = _one(content.metric_records, keys.METRICS, "MetricRecord")
        peak_method = report.get(keys.PEAK_METHOD)
        common: dict[str, Any] = {
            "peak_bytes": _opt_int(metrics.get(keys.PEAK_BYTES)),
            "baseline_bytes": _opt_int(metrics.get(keys.BASELINE_BYTES)),
            "message_bytes": _opt_int(metrics.get(keys.MESSAGE_BYTES)),
            "train_s": _opt_float(metrics.get(keys.TRAIN_S)),
            "num_examples": _opt_int(metrics.get(keys.NUM_EXAMPLES)),
            "peak_method": peak_method if isinstance(peak_method, str) else None,
            "steps_done": _opt_int(metrics.get(keys.STEPS_DONE)),
        }
        if kind == "none":
            reason = report.get(keys.REASON, "")
            return cls(
                "none",
                **common,
                partition_id=_opt_int(metrics.get(keys.PARTITION_ID)),
                min_budget_bytes=_opt_int(metrics.get(keys.MIN_BUDGET_BYTES)),
                reason=reason if isinstance(reason, str) else "",
                eval=_eval_result(metrics, report, common),
            )
        _one(content.array_records, keys.ARRAYS, "ArrayRecord")
        if keys.NUM_EXAMPLES not in metrics:
            raise MalformedReply(f"no metric {keys.NUM_EXAMPLES!r} in the reply")
        common["num_examples"] = _as_int(metrics[keys.NUM_EXAMPLES], keys.NUM_EXAMPLES)
        loss = metrics.get(keys.TRAIN_LOSS)
        if loss is not None and (
            isinstance(loss, bool) or not isinstance(loss, int | float)
        ):
            raise MalformedReply(f"{keys.TRAIN_LOSS} {str(loss)[:40]} is not a number")
        pid = metrics.get(keys.PARTITION_ID)
        return cls(
            kind,
            **common,
            train_loss=None if loss is None else float(loss),
            partition_id=None if pid is None else _as_int(pid, keys.PARTITION_ID),
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
        values = []
        for key in (keys.EVAL_LOSS, keys.EVAL_ACCURACY):
            v = _opt_float(metrics.get(key))
            if v is None:
                raise MalformedReply(f"no number {key!r} in the evaluate reply")
            values.append(v)
        num = _as_int(metrics.get(keys.NUM_EXAMPLES), keys.NUM_EXAMPLES)
        return cls(values[0], values[1], num)


def _eval_result(
    metrics: Any, report: dict[str, Any], common: dict[str, Any]
) -> EvalResult | None:
    runtime = report.get(keys.EVAL_RUNTIME, "")
    error = report.get(keys.EVAL_ERROR, "")
    result = EvalResult(
        loss=_opt_float(metrics.get(keys.EVAL_LOSS)),
        accuracy=_opt_float(metrics.get(keys.EVAL_ACCURACY)),
        num_examples=_opt_int(metrics.get(keys.EVAL_NUM_EXAMPLES)),
        eval_s=_opt_float(metrics.get(keys.EVAL_S)),
        runtime=runtime if isinstance(runtime, str) else "",
        error=str(error),
        peak_bytes=common["peak_bytes"],
        baseline_bytes=common["baseline_bytes"],
    )
    return result if result.ran or result.error else None


def _one(records: Any, key: str, what: str) -> Any:
    """The record under ``key``, or the only record of its kind (a plain client may
    name it otherwise)."""
    if key in records:
        return records[key]
    if len(records) == 1:
        return next(iter(records.values()))
    raise MalformedReply(f"no {what} {key!r} in the reply")


def _opt_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) else None


def _opt_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _as_int(value: Any, key: str) -> int:
    """An integer metric; lists and non-integral values are malformed."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise MalformedReply(f"{key}: expected an integer, got {value!r}")
    return int(value)
