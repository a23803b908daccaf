"""What a client answers: written by ``client`` and read by ``server``, here only.

A train reply holds ``arrays`` (the trained state: every key for ``full``, the window
and head for ``part``, the LoRA factors ``<module>.lora_A``/``<module>.lora_B`` for
``adapter``, none for ``none``), ``metrics`` (``num-examples`` and what the
node measured) and ``report`` (the assignment that ran, how the peak was measured).

``read_train_reply`` reads a reply from any node, a stock client or a misbehaving
one, arrays included: it raises ``MalformedReply`` (a ``ValueError``) naming what is
wrong, whatever the fault. A figure may be missing (a stock Flower client sends only
``num-examples``); one that is present must be valid (of its type, finite, in range;
an evaluation's loss >= 0 and accuracy in [0, 1], all three of its figures or none),
or the whole reply is refused with the key and the value named.

Before any array is decoded, the reply's size (``reply_bytes``: what Flower already
holds in memory, its arrays' bytes, names and texts, counted without decoding) is
checked against the server's limit (run config ``max-reply-bytes``), and its array
keys against the keys the assignment trains: a reply too large, or naming a key it
was not asked for, is refused without a copy of its arrays being made. Texts and key
names in reasons are cut (``cap_text``, ``MAX_KEY_CHARS``), since reasons are logged
and written to the run folder.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from wire import keys

MAX_BYTES = 2**60  # 1 EiB: a larger memory or message figure is nonsense
MAX_EXAMPLES = 2**53  # a claimed example count above this is malformed; the server
#   caps what it believes far lower (run config ``max-examples``)
MAX_PARTITION = 2**31 - 1
MAX_LOSS = 1e9  # a larger loss is nonsense (and its average would overflow)
MAX_TEXT = 300  # characters kept of a reply's texts (reasons, errors)
MAX_KEY_CHARS = 80  # characters of a peer's key name kept in a reason
NUMBER_BYTES = 8  # what a number in a Metric/ConfigRecord counts for (reply_bytes)
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

    kind: str  # full | part | adapter | none: the assignment that ran
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

        A figure or text may be missing (``None``); one that is present must be valid:
        counts and sizes integers in range, times and losses finite, an evaluation's
        loss >= 0 and accuracy in [0, 1], texts of the report texts (cut to
        ``MAX_TEXT`` characters).

        Raises:
            MalformedReply: naming the key and the value: no metrics; for ``full``
                and ``part``, no arrays or no ``num-examples``; any figure or report
                entry present but invalid; an evaluation without its loss, accuracy
                or number of examples.
        """
        record = content.config_records.get(keys.REPORT)
        report: dict[str, Any] = dict(record) if record is not None else {}
        metrics = _one(content.metric_records, keys.METRICS, "MetricRecord")
        _text(report, keys.KIND, ("full", "part", "adapter", "none"))
        window = report.get(keys.WINDOW)
        if window is not None and not (
            isinstance(window, list)
            and len(window) == 2
            and all(_finite(w) and w == int(w) and 0 <= w <= 2**31 for w in window)
        ):
            raise MalformedReply(
                f"report {keys.WINDOW}: expected [start, stop], got {_show(window)}"
            )
        common: dict[str, Any] = {
            "peak_bytes": _count(metrics, keys.PEAK_BYTES),
            "baseline_bytes": _count(metrics, keys.BASELINE_BYTES),
            "message_bytes": _count(metrics, keys.MESSAGE_BYTES),
            "train_s": _number(metrics, keys.TRAIN_S),
            "num_examples": _count(metrics, keys.NUM_EXAMPLES, 0, MAX_EXAMPLES),
            "peak_method": _text(report, keys.PEAK_METHOD, PEAK_METHODS),
            "steps_done": _count(metrics, keys.STEPS_DONE, 0, 2**31),
        }
        partition_id = _count(metrics, keys.PARTITION_ID, 0, MAX_PARTITION)
        loss = _number(metrics, keys.TRAIN_LOSS, low=-MAX_LOSS, high=MAX_LOSS)
        reason = _text(report, keys.REASON) or ""
        if kind == "none":
            return cls(
                "none",
                **common,
                partition_id=partition_id,
                min_budget_bytes=_count(metrics, keys.MIN_BUDGET_BYTES),
                reason=reason,
                eval=_eval_result(metrics, report, common),
            )
        _one(content.array_records, keys.ARRAYS, "ArrayRecord")
        if keys.NUM_EXAMPLES not in metrics:
            raise MalformedReply(f"no metric {keys.NUM_EXAMPLES!r} in the reply")
        common["num_examples"] = _count(metrics, keys.NUM_EXAMPLES, 1, MAX_EXAMPLES)
        return cls(kind, **common, train_loss=loss, partition_id=partition_id)

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
        try:
            metrics = _one(content.metric_records, keys.METRICS, "MetricRecord")
            for key in (keys.EVAL_LOSS, keys.EVAL_ACCURACY, keys.NUM_EXAMPLES):
                if key not in metrics:
                    raise MalformedReply(f"no {key!r} in the evaluate reply")
            loss = _number(metrics, keys.EVAL_LOSS, high=MAX_LOSS)
            accuracy = _number(metrics, keys.EVAL_ACCURACY, high=1.0)
            num = _count(metrics, keys.NUM_EXAMPLES, 1, MAX_EXAMPLES)
        except MalformedReply:
            raise
        except Exception as e:  # a peer's records: any fault is a rejection
            raise MalformedReply(
                f"unreadable evaluate reply ({_show(e, 120)})"
            ) from None
        assert loss is not None and accuracy is not None and num is not None
        return cls(loss, accuracy, num)


def _eval_result(
    metrics: Any, report: dict[str, Any], common: dict[str, Any]
) -> EvalResult | None:
    """An evaluation-only node's result: a number of examples, a loss >= 0 and an
    accuracy in [0, 1], all three or none (an evaluation that failed says why in
    ``eval-error``)."""
    num = _count(metrics, keys.EVAL_NUM_EXAMPLES, 1, MAX_EXAMPLES)
    loss = _number(metrics, keys.EVAL_LOSS, high=MAX_LOSS)
    accuracy = _number(metrics, keys.EVAL_ACCURACY, high=1.0)
    figures = {
        keys.EVAL_NUM_EXAMPLES: num,
        keys.EVAL_LOSS: loss,
        keys.EVAL_ACCURACY: accuracy,
    }
    given = [k for k, v in figures.items() if v is not None]
    if given and len(given) < len(figures):
        missing = [k for k, v in figures.items() if v is None]
        raise MalformedReply(
            f"an evaluation with {', '.join(given)} but no {', '.join(missing)}"
        )
    result = EvalResult(
        loss=loss,
        accuracy=accuracy,
        num_examples=num,
        eval_s=_number(metrics, keys.EVAL_S),
        runtime=_text(report, keys.EVAL_RUNTIME, EVAL_RUNTIMES) or "",
        error=_text(report, keys.EVAL_ERROR) or "",
        peak_bytes=common["peak_bytes"],
        baseline_bytes=common["baseline_bytes"],
    )
    return result if result.ran or result.error else None


def read_train_reply(
    content: RecordDict,
    *,
    kind: str,
    expected: Collection[str] | None = None,
    max_bytes: int = 0,
) -> tuple[TrainReply, dict[str, np.ndarray] | None]:
    """The one reader of a train reply from any node: its figures and (``full``,
    ``part``, ``adapter``) its arrays (native numpy arrays of the dtypes
    ``torch.from_numpy`` takes; wire imports no torch), or ``MalformedReply`` with the
    reason, whatever the fault (missing or renamed records, values of any type,
    array bytes that are empty, a zip file, truncated, of an object or non-native
    dtype).

    Before any array is decoded: a reply whose ``reply_bytes`` exceed ``max_bytes``
    (0: no limit) is refused, and so is one whose array keys are not exactly
    ``expected`` (None: not checked here). Shapes and values are checked against the
    model by ``server.aggregate``.
    """
    try:
        size = reply_bytes(content)
        if max_bytes and size > max_bytes:
            raise MalformedReply(
                f"the reply holds {size:,} bytes, over max-reply-bytes "
                f"({max_bytes:,}); its arrays were not decoded"
            )
        reply = TrainReply.from_content(content, kind=kind)
        if kind == "none":
            return reply, None
        arrays = TrainReply.arrays(content)
        if expected is not None:
            _check_keys(arrays, expected)
        return reply, _state_arrays(arrays)
    except MalformedReply:
        raise
    except Exception as e:  # a peer's bytes: any fault is a rejection, not a crash
        raise MalformedReply(
            f"unreadable reply ({type(e).__name__}: {_show(e, 120)})"
        ) from None


def reply_bytes(content: RecordDict) -> int:
    """What a reply holds, in bytes, read without decoding anything: every record's
    name, every key, every array's ``.npy`` data (as Flower holds it), every text
    (in characters) and bytes value; a number counts ``NUMBER_BYTES``."""
    total = 0
    for name, record in content.items():
        total += len(name)
        if isinstance(record, ArrayRecord):
            for key, array in record.items():
                total += len(key) + len(array.data)
            continue
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            total += len(key) + sum(
                len(v) if isinstance(v, str | bytes) else NUMBER_BYTES for v in values
            )
    return total


def _check_keys(arrays: Any, expected: Collection[str]) -> None:
    """Refuse ``arrays`` unless its keys are exactly ``expected`` (nothing decoded)."""
    if not isinstance(arrays, ArrayRecord):
        raise MalformedReply("arrays is not an ArrayRecord")
    want = set(expected)
    got = set(arrays.keys())
    missing, extra = sorted(want - got), sorted(got - want)
    if missing or extra:
        raise MalformedReply(
            f"array keys differ from the assignment's: missing {key_list(missing)}, "
            f"unexpected {key_list(extra)} ({len(extra)} in all); nothing decoded"
        )


def key_list(names: list[str], limit: int = 5) -> list[str]:
    """The first ``limit`` of ``names``, each cut to ``MAX_KEY_CHARS`` characters (a
    peer's key may be megabytes long; reasons are logged and written to the run
    folder)."""
    return [cap_text(n, MAX_KEY_CHARS) for n in names[:limit]]


def cap_text(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, ending in ``...`` where it was cut."""
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


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
        try:
            value = arrays[key].numpy()  # np.load(allow_pickle=False)
        except Exception as e:  # empty, a zip file, truncated, a pickle: refused
            raise MalformedReply(
                f"array {key[:MAX_KEY_CHARS]!r} is unreadable ({type(e).__name__}: {_show(e, 80)})"
            ) from None
        if (
            not isinstance(value, np.ndarray)
            or value.dtype.name not in _DTYPES
            or not value.dtype.isnative
        ):
            raise MalformedReply(
                f"array {key[:MAX_KEY_CHARS]!r} has dtype {getattr(value, 'dtype', '?')}; "
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


def _count(metrics: Any, key: str, low: int = 0, high: int = MAX_BYTES) -> int | None:
    """The integer ``metrics[key]`` in ``low..high``; None where it is missing."""
    if key not in metrics:
        return None
    value = metrics[key]
    if not _finite(value) or value != int(value) or not low <= value <= high:
        raise MalformedReply(
            f"{key}: expected an integer in {low}..{high}, got {_show(value)}"
        )
    return int(value)


def _number(
    metrics: Any, key: str, low: float = 0.0, high: float = math.inf
) -> float | None:
    """The finite number ``metrics[key]`` in [low, high]; None where it is missing."""
    if key not in metrics:
        return None
    value = metrics[key]
    if not _finite(value) or not low <= value <= high:
        raise MalformedReply(
            f"{key}: expected a finite number in [{low:g}, {high:g}], "
            f"got {_show(value)}"
        )
    return float(value)


def _text(
    report: dict[str, Any], key: str, choices: tuple[str, ...] | None = None
) -> str | None:
    """The report's text ``report[key]`` (one of ``choices``), cut to ``MAX_TEXT``
    characters; None where it is missing."""
    if key not in report:
        return None
    value = report[key]
    if not isinstance(value, str) or (choices is not None and value not in choices):
        want = "one of " + ", ".join(choices) if choices else "a text"
        raise MalformedReply(f"report {key}: expected {want}, got {_show(value)}")
    return value[:MAX_TEXT]


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text[:limit]
