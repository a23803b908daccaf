"""What an oversize train reply costs the ServerApp's process: peak RSS growth, in MB,
while Flower materialises the message and while fleetfit reads it.

One honest whole-model reply of ``--workload`` plus an extra array of ``--extra-mb``
megabytes (a hostile node's). Each case runs in a fresh child process:

1. the reply is built and serialised into Flower's object contents (what the
   ServerApp's process holds after pulling a message from the SuperLink: Flower
   splits arrays into 5 MiB chunks and keeps each distinct chunk once, so an array
   of ``--fill ones`` travels as a few MB), and the built message freed;
2. ``materialise``: Flower's ``inflate_object_from_contents`` (the ServerApp's pull
   does this) turns the contents into the Message fleetfit's loop receives;
3. ``read``: ``wire.reply.read_train_reply`` on it, either without limits (the code
   before issue 32: every array decoded before the keys were checked) or with the
   assignment's keys and ``max-reply-bytes`` "auto" (1.25 x the model + 1 MiB).

Peaks are ``VmHWM`` from ``/proc/self/status``, reset between phases by writing 5
to ``/proc/self/clear_refs`` (Linux), less the RSS at the phase's start.

    .venv/bin/python benchmarks/reply_size.py                      # 400 MB, ~10 s
    .venv/bin/python benchmarks/reply_size.py --extra-mb 100 --workload gpt-tiny
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.inflatable.inflatable_object import (  # noqa: E402
    get_all_nested_objects,
)
from flwr.supercore.inflatable.inflatable_utils import (  # noqa: E402
    inflate_object_from_contents,
)
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from wire import keys  # noqa: E402
from wire.reply import MalformedReply, read_train_reply  # noqa: E402
from workloads import get_workload  # noqa: E402

MB = 10**6
# Messages built outside a Flower run need a run identity, as Flower's runtime sets.
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _case(workload: str, extra_mb: int, fill: str, limits: bool, out: Any) -> None:
    state = get_workload(workload).make_model(0).state_dict()
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    arrays = {k: Array(v.numpy()) for k, v in state.items()}
    if fill == "random":  # every 5 MiB chunk differs: pulled whole
        extra = np.random.default_rng(0).integers(0, 256, extra_mb * MB, np.uint8)
    else:  # identical chunks: Flower stores and sends each distinct chunk once
        extra = np.ones(extra_mb * MB, np.uint8)
    arrays["extra"] = Array(extra)
    del extra
    ask = Message(RecordDict({}), 1, MessageType.TRAIN)
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord(arrays),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 100}),
            keys.REPORT: ConfigRecord({keys.KIND: "full"}),
        }
    )
    reply = Message(content, reply_to=ask)
    objects = get_all_nested_objects(reply)
    contents = {oid: obj.deflate() for oid, obj in objects.items()}
    root = reply.object_id
    del reply, content, arrays, objects, state
    gc.collect()
    held = _status("VmRSS")
    pulled = sum(len(v) for v in contents.values())

    start = _reset_peak()
    message = inflate_object_from_contents(root, contents)
    assert isinstance(message, Message)
    materialise = _status("VmHWM") - start
    gc.collect()

    start = _reset_peak()
    kw: dict[str, Any] = {}
    if limits:
        kw = {
            "expected": set(get_workload(workload).make_model(0).state_dict()),
            "max_bytes": model_bytes * 5 // 4 + 2**20,
        }
    try:
        read_train_reply(message.content, kind="full", **kw)
        outcome = "read"
    except MalformedReply as e:
        outcome = str(e)[:90]
    read = _status("VmHWM") - start
    out.put((pulled, held, materialise, read, outcome))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="digits-mlp")
    ap.add_argument("--extra-mb", type=int, default=400)
    ap.add_argument(
        "--fill",
        default="random,ones",
        help="the extra array's bytes: random (distinct chunks) and/or ones",
    )
    ap.add_argument(
        "--cases",
        default="no-limits,limits",
        help="no-limits (the reader before issue 32) and/or limits",
    )
    args = ap.parse_args()
    print(
        f"# {platform.node()}: {args.workload} reply + an extra {args.extra_mb} MB "
        "array; peak RSS growth of each phase (MB)"
    )
    print(
        "| extra array | reader | pulled objects | RSS after pull | materialise | "
        "read | outcome |"
    )
    print("|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for fill in args.fill.split(","):
        for case in args.cases.split(","):
            q = ctx.Queue()
            p = ctx.Process(
                target=_case,
                args=(args.workload, args.extra_mb, fill, case == "limits", q),
            )
            p.start()
            try:
                pulled, held, materialise, read, outcome = q.get(timeout=600)
            finally:
                p.join()
            print(
                f"| {fill} | {case} | {pulled / MB:.0f} | {held / MB:.0f} | "
                f"+{materialise / MB:.0f} | +{read / MB:.0f} | {outcome} |"
            )


if __name__ == "__main__":
    main()
