"""Hostile replies for the server's round loop: a transport with a few honest nodes
and many hostile ones, replies written as plain data, and the checks a round must pass
whatever the hostile nodes sent (used by ``test_reply_fuzz.py`` and
``test_reply_cases.py``).

Every honest node trains the whole model and sends the same state dict ``S`` (the
initial model plus a fixed small change), so the global model after any round must
equal ``S``. A hostile reply that carries arrays carries ``S`` itself (or the part of
it its assignment trains), or arrays the server must reject (wrong keys, shape or
dtype, non-finite values, bytes that are no ``.npy``): whatever the server accepts,
the average is ``S``.

A reply is written as a ``Spec``: record name -> (record type, contents), with
``"arrays"`` contents an ``ArraysSpec`` (see ``build_arrays``), so that a failing
example prints as readable data.
"""

from __future__ import annotations

import functools
import io
import json
import math
import signal
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from server import persist
from server.assign import Assigner
from server.config import ExportConfig, ServerConfig
from tests import fakes  # noqa: F401  (sets Flower's task identity)
from wire import keys
from wire.facts import NodeFacts
from wire.instruction import TrainInstruction
from wire.shape import RunShape
from wire.windows import model_blocks, trained_keys
from workloads import get_workload

WORKLOAD = "digits-mlp"  # the cheapest built-in model: 3 linear layers
HONEST_EXAMPLES = 100  # num-examples of every honest reply
FULL_BUDGET_BYTES = (
    10**10
)  # gets ``full``; ``role_budgets`` finds ``part`` and ``none``

Spec = dict[str, tuple[str, Any]]  # record name -> ("arrays" | "metrics" | "config", x)
# What a node answers: ("reply", Spec) | ("error", code, reason) | ("silent",)
# | ("foreign", Spec): a reply whose source is a node that was not asked.
Answer = tuple[Any, ...]


def make_config(out: str | Path, rounds: int = 2, **kw: Any) -> ServerConfig:
    """A tiny run: digits-mlp, one local step, no ONNX, no evaluation-only work."""
    return ServerConfig(
        shape=RunShape(workload=WORKLOAD, local_steps=1, seed=0),
        num_server_rounds=rounds,
        min_nodes=1,
        out=str(out),
        client_measure="inline",
        runtime_reserve="0",
        export=ExportConfig(onnx="off", eval_only="off"),
        **kw,
    )


# ---------------------------------------------------------------- the honest update
@functools.cache
def _model() -> torch.nn.Module:
    return get_workload(WORKLOAD).make_model(0)


@functools.cache
def honest_state() -> dict[str, torch.Tensor]:
    """``S``: the initial model (seed 0) plus a fixed change of about 1% of it."""
    gen = torch.Generator().manual_seed(1234)
    return {
        k: (v + 0.01 * v.abs().mean() * torch.randn(v.shape, generator=gen)).to(v.dtype)
        for k, v in _model().state_dict().items()
    }


@functools.cache
def _honest_record(names: tuple[str, ...]) -> ArrayRecord:
    s = honest_state()
    return ArrayRecord({k: Array(s[k].numpy()) for k in names})


def model_keys() -> list[str]:
    return list(honest_state())


@functools.cache
def window_keys(window: tuple[int, int] | None) -> tuple[str, ...]:
    """The keys an assignment with ``window`` trains (None: the head block's keys,
    a wrong set for ``full``)."""
    model = _model()
    blocks = model_blocks(get_workload(WORKLOAD), model)
    if window is None:
        window = (len(blocks) - 1, len(blocks) - 1)
    return tuple(trained_keys(model, window, blocks))


@functools.cache
def role_budgets() -> dict[str, int]:
    """A memory budget (bytes, runtime reserve 0) that gets each kind of assignment."""
    wl = get_workload(WORKLOAD)
    cfg = make_config("unused")
    assigner = Assigner(
        wl,
        _model(),
        local_steps=1,
        runtime_reserve_bytes=0,
        train_time_s=cfg.train_time,
    )
    none = assigner.assign(NodeFacts(budget_bytes=1000, disk_budget_bytes=0), 1)
    budgets = {
        "full": FULL_BUDGET_BYTES,
        "part": none.min_budget_bytes,
        "none": 1000,
    }
    for kind, budget in budgets.items():
        got = assigner.assign(NodeFacts(budget_bytes=budget, disk_budget_bytes=0), 1)
        assert got.kind == kind, (kind, budget, got)
    return budgets


def honest_facts(partition_id: int, role: str = "full") -> dict[str, Any]:
    """A query reply's ``node`` record that gets the ``role`` assignment."""
    return {
        keys.PARTITION_ID: partition_id,
        keys.NUM_PARTITIONS: 8,
        keys.BUDGET_BYTES: role_budgets()[role],
        keys.DISK_BUDGET_BYTES: 0,
        keys.BUDGET_SOURCE: "node-config",
        keys.FLOPS_PER_S: 1e10,
        keys.NUM_CPUS: 2,
    }


def honest_reply(kind: str, partition_id: int) -> Spec:
    """What an honest node answers to an assignment of ``kind`` (``none``: an
    evaluation-only result beside it)."""
    metrics: dict[str, Any] = {
        keys.NUM_EXAMPLES: HONEST_EXAMPLES,
        keys.TRAIN_LOSS: 0.5,
        keys.TRAIN_S: 0.01,
        keys.PARTITION_ID: partition_id,
        keys.PEAK_BYTES: 2_000_000,
        keys.BASELINE_BYTES: 100_000_000,
        keys.MESSAGE_BYTES: 60_000,
        keys.STEPS_DONE: 1,
    }
    report: dict[str, Any] = {keys.KIND: kind, keys.PEAK_METHOD: "inline"}
    spec: Spec = {}
    if kind == "full":
        spec[keys.ARRAYS] = ("arrays", ("S", None))
    elif kind == "part":
        spec[keys.ARRAYS] = ("arrays", ("window", None))
        report[keys.WINDOW] = [0, 0]  # the window that ran; not read by the server
    else:
        metrics = {
            keys.NUM_EXAMPLES: 0,
            keys.PARTITION_ID: partition_id,
            keys.MIN_BUDGET_BYTES: role_budgets()["part"],
            keys.EVAL_LOSS: 1.5,
            keys.EVAL_ACCURACY: 0.5,
            keys.EVAL_NUM_EXAMPLES: 40,
            keys.EVAL_S: 0.2,
            keys.PEAK_BYTES: 1_000_000,
            keys.BASELINE_BYTES: 30_000_000,
        }
        report = {
            keys.KIND: "none",
            keys.PEAK_METHOD: "ort-child",
            keys.REASON: "nothing fits",
            keys.EVAL_RUNTIME: "onnxruntime",
        }
    spec[keys.METRICS] = ("metrics", metrics)
    spec[keys.REPORT] = ("config", report)
    return spec


# ---------------------------------------------------------------- changes to replies
def mutate(spec: Spec, changes: list[tuple[Any, ...]]) -> Spec:
    """``spec`` with ``changes`` applied in order:

    - ``("set", record, key, value)``, ``("drop", record, key)``,
      ``("rename", record, key, new_key)``: one field of a record (a record that is
      not there is created);
    - ``("arrays", arrays_spec)``: other arrays (``build_arrays``);
    - ``("drop-record", name)``, ``("rename-record", name, new_name)``,
      ``("retype-record", name)`` (a MetricRecord sent as a ConfigRecord and the
      other way round), ``("extra-record", name, (type, contents))``.
    """
    out: Spec = {n: (kind, _copy(x)) for n, (kind, x) in spec.items()}
    for change in changes:
        op, name = change[0], change[1]
        if op == "arrays":
            out[keys.ARRAYS] = ("arrays", change[1])
            continue
        if op in ("set", "drop", "rename"):
            kind, x = out.get(
                name, ("metrics" if name == keys.METRICS else "config", {})
            )
            if not isinstance(x, dict):
                kind, x = "config", {}
            if op == "set":
                x[change[2]] = change[3]
            elif change[2] in x:
                value = x.pop(change[2])
                if op == "rename":
                    x[change[3]] = value
            out[name] = (kind, x)
        elif op == "drop-record":
            out.pop(name, None)
        elif op == "rename-record" and name in out:
            out[change[2]] = out.pop(name)
        elif op == "retype-record" and name in out and out[name][0] != "arrays":
            kind, x = out[name]
            out[name] = ("config" if kind == "metrics" else "metrics", x)
        elif op == "extra-record":
            out[name] = (change[2][0], _copy(change[2][1]))
    return out


def _copy(x: Any) -> Any:
    return dict(x) if isinstance(x, dict) else x


def query_answer(drawn: tuple[Any, ...], partition_id: int) -> Answer:
    if drawn[0] != "reply":
        return drawn
    _, role, changes = drawn
    facts = honest_facts(partition_id, "full" if role == "plain" else role)
    if role == "plain":  # a node that says nothing of its memory
        facts = {keys.PARTITION_ID: partition_id}
    return ("reply", mutate({keys.NODE: ("config", facts)}, changes))


def train_answer(drawn: tuple[Any, ...], kind: str, partition_id: int) -> Answer:
    if drawn[0] not in ("reply", "foreign"):
        return drawn
    return (drawn[0], mutate(honest_reply(kind, partition_id), drawn[1]))


# ---------------------------------------------------------------- building records
def _npy(a: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=allow_pickle)
    return buf.getvalue()


def bad_bytes(name: str, s: np.ndarray) -> bytes:
    """``.npy`` data the server must refuse in place of ``s`` (named by ``name``)."""
    if name == "empty":
        return b""
    if name == "zip-header":
        return b"PK\x03\x04" + bytes(26)
    if name == "npz":  # a valid zip of a valid array: np.load returns an NpzFile
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("a.npy", _npy(s))
        return buf.getvalue()
    if name == "truncated":
        data = _npy(s)
        return data[: len(data) // 2]
    if name == "header-only":
        return _npy(s)[:128]
    if name == "float64":
        return _npy(s.astype(np.float64))
    if name == "float16":
        return _npy(s.astype(np.float16))
    if name == "int64":
        return _npy(s.astype(np.int64))
    if name == "bool":
        return _npy(s != 0)
    if name == "extra-dim":
        return _npy(np.expand_dims(s, 0))
    if name == "scalar":
        return _npy(np.asarray(s.reshape(-1)[0]))
    if name == "pickle":  # an object array: loading it would run pickle
        return _npy(np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    if name == "nan":
        return _npy(np.full_like(s, np.nan))
    raise AssertionError(f"unknown bad bytes {name!r}")


BAD_BYTES = (
    "empty",
    "zip-header",
    "npz",
    "truncated",
    "header-only",
    "float64",
    "float16",
    "int64",
    "bool",
    "extra-dim",
    "scalar",
    "pickle",
    "nan",
)
# Arrays the server may accept or refuse: either way they hold S's values.
SAME_VALUES = ("big-endian", "fortran", "lying-metadata")


def build_arrays(spec: Any, window: tuple[int, int] | None) -> ArrayRecord:
    """An ``ArraysSpec``: ``(base, change)`` with base ``"S"`` (every key) or
    ``"window"`` (the assignment's keys), and change ``None`` or one of

    - ``("drop", key)``, ``("extra", name)``: a key missing or added;
    - ``("bytes", key, bad)``: ``key``'s data replaced by ``bad_bytes(bad)``;
    - ``("same", key, how)``: the same values written otherwise (``SAME_VALUES``);
    - ``("stype", key, stype)``: an unknown serialization;
    - ``("value", key, x)``: one entry set to the non-finite ``x``;
    - ``("big", key, nbytes)``: an extra array of ``nbytes`` zero bytes (uint8);

    or ``"empty"`` (an ArrayRecord with no arrays) or ``"onnx"`` (the evaluation
    model's key holding bytes), or ``("moved", f)``: the initial model plus ``f``
    times S's change, a plausible update that is not S (never in the fuzzer).
    """
    if spec == "empty":
        return ArrayRecord()
    if spec == "onnx":
        return ArrayRecord(
            {keys.ONNX_MODEL: Array(np.frombuffer(b"\x08\x07", np.uint8))}
        )
    base, change = spec
    if base == "moved":
        init = _model().state_dict()
        return ArrayRecord(
            {
                k: Array((init[k] + change * (v - init[k])).numpy())
                for k, v in honest_state().items()
            }
        )
    names = tuple(model_keys()) if base == "S" else window_keys(window)
    if change is None:
        return _honest_record(names)
    s = {k: v.numpy() for k, v in honest_state().items()}
    arrays = {k: Array(s[k]) for k in names}
    op, key, arg = (*change, None)[:3]
    ref = s.get(key, s[names[-1]])
    if op == "drop":
        arrays.pop(key, None)
        if key not in names:  # nothing to drop: drop the first key instead
            arrays.pop(names[0])
    elif op == "extra":
        arrays[key if key not in s else key + ".extra"] = Array(ref)
    elif op == "bytes":
        data = bad_bytes(arg, ref)
        arrays[key] = Array(str(ref.dtype), tuple(ref.shape), "numpy.ndarray", data)
    elif op == "same":
        if arg == "big-endian":
            data = _npy(ref.astype(ref.dtype.newbyteorder(">")))
        elif arg == "fortran":
            data = _npy(np.asfortranarray(ref))
        else:  # the Array's own dtype and shape lie; the data is right
            data = _npy(ref)
        arrays[key] = Array("int8", (1,), "numpy.ndarray", data)
    elif op == "stype":
        arrays[key] = Array(str(ref.dtype), tuple(ref.shape), arg, _npy(ref))
    elif op == "big":
        arrays[key] = Array(np.zeros(arg, np.uint8))
    elif op == "value":
        bad = ref.copy()
        bad.reshape(-1)[0] = arg
        arrays[key] = Array(bad)
    else:
        raise AssertionError(f"unknown arrays change {change!r}")
    return ArrayRecord(arrays)


def _metric_ok(value: Any) -> bool:
    try:
        MetricRecord({"x": value})
    except TypeError:
        return False
    return True


def build_content(spec: Spec, window: tuple[int, int] | None = None) -> RecordDict:
    """The RecordDict of ``spec`` (a value a record type cannot hold is left out)."""
    records: dict[str, Any] = {}
    for name, (kind, x) in spec.items():
        if kind == "arrays":
            records[name] = build_arrays(x, window)
        elif kind == "metrics":
            records[name] = MetricRecord({k: v for k, v in x.items() if _metric_ok(v)})
        else:
            records[name] = ConfigRecord(dict(x))
    return RecordDict(records)


# ---------------------------------------------------------------- the transport
class HostileTransport:
    """``server.loop.Transport`` over honest nodes (``honest``: node id -> partition
    id) and hostile ones, whose answers ``query_answer(node)`` and
    ``train_answer(node, instruction)`` return (an ``Answer``)."""

    def __init__(
        self,
        honest: Mapping[int, int],
        hostile: list[int],
        query_answer: Callable[[int], Answer],
        train_answer: Callable[[int, TrainInstruction], Answer],
    ) -> None:
        self.honest = dict(honest)
        self.hostile = list(hostile)
        self.query_answer = query_answer
        self.train_answer = train_answer
        self.cases: list[tuple[int, int, str, Answer]] = []  # round, node, what, answer
        self.server_round = 0

    def node_ids(self) -> list[int]:
        return sorted([*self.honest, *self.hostile])

    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]:
        return self.node_ids()

    def query(self, node_ids: list[int], timeout_s: float) -> dict[int, Message]:
        out: dict[int, Message] = {}
        for n in node_ids:
            msg = Message(
                RecordDict({keys.CONFIG: ConfigRecord({})}), n, MessageType.QUERY
            )
            if n in self.honest:
                facts = ConfigRecord(honest_facts(self.honest[n]))
                out[n] = Message(RecordDict({keys.NODE: facts}), reply_to=msg)
                continue
            answer = self.query_answer(n)
            self.cases.append((self.server_round + 1, n, "query", answer))
            reply = _reply(msg, answer, None)
            if reply is not None:
                out[n] = reply
        return out

    def train(
        self,
        instructions: dict[int, tuple[ArrayRecord, ConfigRecord]],
        server_round: int,
        timeout_s: float,
    ) -> list[Message]:
        self.server_round = server_round
        replies = []
        for n, (arrays, config) in instructions.items():
            ins = TrainInstruction.from_config(dict(config))
            msg = Message(
                RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config}),
                n,
                MessageType.TRAIN,
                group_id=str(server_round),
            )
            if n in self.honest:
                spec = honest_reply(ins.kind, self.honest[n])
                replies.append(Message(build_content(spec), reply_to=msg))
                continue
            answer = self.train_answer(n, ins)
            self.cases.append((server_round, n, f"train ({ins.kind})", answer))
            reply = _reply(msg, answer, ins.window)
            if reply is not None:
                replies.append(reply)
        return replies

    def describe(self, server_round: int) -> str:
        """The hostile answers of ``server_round`` (and the queries before it)."""
        return "\n".join(
            f"  node {n} {what}: {answer!r}"
            for r, n, what, answer in self.cases
            if r == server_round
        )


def _reply(
    msg: Message, answer: Answer, window: tuple[int, int] | None
) -> Message | None:
    if answer[0] == "silent":
        return None
    if answer[0] == "error":
        return Message(Error(answer[1], answer[2]), reply_to=msg)
    if answer[0] == "foreign":  # a reply whose source was not asked
        other = Message(msg.content, 999_999, msg.metadata.message_type)
        return Message(build_content(answer[1], window), reply_to=other)
    return Message(build_content(answer[1], window), reply_to=msg)


# ---------------------------------------------------------------- what must hold
class RoundTimeout(BaseException):
    """A round ran past its time limit (a BaseException: no ``except Exception`` in
    the server swallows it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``RoundTimeout`` in the block after ``seconds`` (SIGALRM; the main
    thread only). A timer already set (pytest-timeout's) is put back afterwards."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise RoundTimeout(f"over {seconds:g} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = old_delay - (time.monotonic() - t0)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not JSON")


def strict_json(path: Path) -> Any:
    """``path`` parsed as strict JSON: NaN, Infinity and -Infinity are errors."""
    return json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)


def _csv_problems(path: Path) -> list[str]:
    import csv

    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    bad = []
    for row in rows:
        for k, v in row.items():
            try:
                x = float(v)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(x):
                bad.append(f"{path.name}: round {row.get('round')} {k}={v}")
    return bad


def round_problems(fed: Any, server_round: int, record: dict[str, Any]) -> list[str]:
    """What is wrong after ``server_round`` (empty: nothing): the model is ``S``, the
    run folder's files name this round and parse as strict JSON, the federated
    evaluation is a mean of accuracies in [0, 1]."""
    out = Path(fed.cfg.out)
    problems = []
    s = honest_state()
    state = fed.model.state_dict()
    for k, v in s.items():
        if not torch.allclose(state[k], v, rtol=1e-6, atol=0):
            diff = float((state[k] - v).abs().max())
            problems.append(f"global model != S at {k} (max |diff| {diff:.3g})")
            break
    rounds: dict[str, Any] = {}
    try:
        summary = strict_json(out / persist.SUMMARY_FILE)
        rounds["summary.json"] = summary["rounds"][-1]["round"]
    except (ValueError, KeyError, IndexError, OSError) as e:
        problems.append(f"summary.json: {e}")
    try:
        state_json = strict_json(out / persist.STATE_DIR / persist.STATE_FILE)
        rounds["state.json"] = state_json["round"]
    except (ValueError, KeyError, OSError) as e:
        problems.append(f"state.json: {e}")
    try:
        _, meta = persist.load_model(out / persist.MODEL_FILE)
        rounds["model.safetensors"] = int(meta["round"])
        saved = persist.load_state(out)
        rounds["state model"] = saved[0] if saved else None
    except (ValueError, KeyError, OSError) as e:
        problems.append(f"model files: {e}")
    if set(rounds.values()) != {server_round}:
        problems.append(f"files disagree on the round (want {server_round}): {rounds}")
    try:
        problems += _csv_problems(out / persist.CSV_FILE)
    except OSError as e:
        problems.append(f"summary.csv: {e}")
    fe = record.get("federated_eval")
    if fe is not None:
        acc, loss = fe.get("accuracy"), fe.get("loss")
        if not (isinstance(acc, float) and 0 <= acc <= 1):
            problems.append(f"federated_eval accuracy {acc!r} is not in [0, 1]")
        if not (isinstance(loss, float) and math.isfinite(loss) and loss >= 0):
            problems.append(f"federated_eval loss {loss!r} is not a finite loss")
    return problems


def assignment(record: dict[str, Any], node_id: int) -> dict[str, Any]:
    (a,) = [a for a in record["assignments"] if a["node_id"] == node_id]
    return a


def refusal(record: dict[str, Any], node_id: int) -> str | None:
    """Why the server refused ``node_id``'s reply this round: its assignment status
    when that is not ``ok``/``none``, else an entry of ``errors`` naming the node."""
    status = next(
        (a["status"] for a in record["assignments"] if a["node_id"] == node_id), None
    )
    if status is not None and status not in ("ok", "none"):
        return status
    return next(
        (e for e in record.get("errors", []) if f"node {node_id}" in e),
        None,
    )
