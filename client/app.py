"""fleetfit's ClientApp (Flower Message API).

- ``query``: replies with the node's facts: partition id and count, memory and disk
  budgets (``client.config``), device memory and disk, measured compute rate.
- ``train``: runs the server's assignment (``full``: the whole model under its plan;
  ``part``: a window of blocks and the head; ``none``: replies that nothing fits, with
  the smallest budget that would) on its share of the data, and replies with the
  trained ``arrays`` and ``metrics`` (``num-examples``, ``train-loss``, the measured
  peak of its training work, the bytes of the message it received, ...). A stock
  strategy's instruction (no fleetfit keys) trains the whole model plainly.
- ``evaluate``: evaluates the received arrays on the held-out data.

Errors raised here become error replies: the round goes on without this node.

Differential privacy: a train instruction that carries Flower's ``clipping_norm``
(``DifferentialPrivacyClientSideFixedClipping`` puts it there) has its update clipped
before it leaves the node (``clipping_mod``, Flower's ``fixedclipping_mod`` for
fleetfit's assignments). Replies keep the received arrays' key order, since Flower's DP
wrappers pair arrays by position.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable

from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.supercore.differential_privacy import (
    KEY_CLIPPING_NORM,
    compute_clip_model_update,
)

from client.config import (
    FLEET_DISK,
    FLEET_MEMORY,
    FLEET_SPEEDS,
    NodeConfig,
    available_memory_bytes,
    check_workload_allowed,
    free_disk_bytes,
    total_memory_bytes,
)
from client.ort_eval import evaluate_only
from client.train import draw_batches, train_assigned
from memory.profile import measure_flops_per_s
from memory.spec import MemoryPlan
from server import protocol
from workloads import get_workload
from workloads.node_data import evaluate_batches

log = logging.getLogger(__name__)
app = ClientApp()

CLIENT_ERROR = 1  # Error.code of a reply whose handler failed; the reason says why

Handler = Callable[[Message, Context], Message]


def _error_reply(handler: Handler) -> Handler:
    """Turn a failure into an error reply naming the cause; the round goes on."""

    @functools.wraps(handler)
    def wrapped(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as e:  # a failing client is data, not a crash
            log.warning("%s failed: %s: %s", handler.__name__, type(e).__name__, e)
            return Message(
                Error(CLIENT_ERROR, f"{type(e).__name__}: {e}"), reply_to=msg
            )

    return wrapped


def _node(context: Context, extra: dict | None = None) -> NodeConfig:
    fleet = {
        k: v
        for k, v in {**dict(context.run_config), **(extra or {})}.items()
        if k in (FLEET_MEMORY, FLEET_DISK, FLEET_SPEEDS)
    }
    return NodeConfig.from_node_config(dict(context.node_config), fleet)


@app.query()
@_error_reply
def query(msg: Message, context: Context) -> Message:
    asked = dict(msg.content.config_records.get(protocol.CONFIG, {}))
    node = _node(context, asked)
    facts = ConfigRecord(
        {
            protocol.PARTITION_ID: node.partition_id,
            protocol.NUM_PARTITIONS: node.num_partitions,
            protocol.BUDGET_BYTES: node.budget_bytes,
            protocol.DISK_BUDGET_BYTES: node.disk_budget_bytes,
            protocol.BUDGET_SOURCE: node.budget_source,
            protocol.TOTAL_MEMORY_BYTES: total_memory_bytes(),
            protocol.AVAILABLE_MEMORY_BYTES: available_memory_bytes(),
            protocol.FREE_DISK_BYTES: free_disk_bytes(node.offload_dir),
            protocol.FLOPS_PER_S: measure_flops_per_s() * node.speed_factor,
            protocol.NUM_CPUS: os.cpu_count() or 1,
        }
    )
    return Message(RecordDict({protocol.NODE: facts}), reply_to=msg)


def message_bytes(content: RecordDict) -> int:
    """Bytes of a received message's payload: its arrays and its config values."""
    total = 0
    for rec in content.array_records.values():
        total += sum(len(a.data) for a in rec.values())
    for cfg in content.config_records.values():
        total += sum(len(str(k)) + len(str(v)) for k, v in cfg.items())
    return total


def clipping_mod(
    msg: Message, context: Context, call_next: ClientAppCallable
) -> Message:
    """Clip this node's update to the instruction's ``clipping_norm``, if it has one.

    Flower's ``fixedclipping_mod`` for fleetfit's assignments: the update (reply minus
    received arrays) is clipped to L2 norm ``clipping_norm`` over the keys the reply
    carries (all of them for ``full``, the window and head for ``part``; a ``none``
    reply has no arrays and passes unchanged). Integer buffers (BatchNorm's step
    counters) are neither counted nor scaled. Without ``clipping_norm`` the reply
    passes unchanged (the server did not ask for client-side clipping).
    """
    config = msg.content.config_records.get(protocol.CONFIG, ConfigRecord())
    if KEY_CLIPPING_NORM not in config:
        return call_next(msg, context)
    norm = config[KEY_CLIPPING_NORM]
    if isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0:
        return Message(
            Error(
                ErrorCode.MOD_FAILED_PRECONDITION,
                f"clipping_norm={norm!r} must be a positive number",
            ),
            reply_to=msg,
        )
    received = msg.content.array_records.get(protocol.ARRAYS)
    reply = call_next(msg, context)
    if reply.has_error() or protocol.ARRAYS not in reply.content.array_records:
        return reply
    sent = reply.content.array_records[protocol.ARRAYS]
    if received is None or not set(sent) <= set(received):
        return Message(
            Error(
                ErrorCode.MOD_FAILED_PRECONDITION,
                "clipping_mod: the reply carries arrays the node did not receive",
            ),
            reply_to=msg,
        )
    new = {k: sent[k].numpy() for k in sent}
    keys = [k for k in sent if new[k].dtype.kind == "f"]
    trained = [new[k] for k in keys]
    compute_clip_model_update(trained, [received[k].numpy() for k in keys], float(norm))
    new.update(zip(keys, trained, strict=True))
    reply.content.array_records[protocol.ARRAYS] = ArrayRecord(
        {k: Array(new[k]) for k in sent}
    )
    log.info("update clipped to L2 norm %g over %d arrays", norm, len(keys))
    return reply


@app.train(mods=[clipping_mod])
@_error_reply
def train(msg: Message, context: Context) -> Message:
    node = _node(context)
    received = message_bytes(msg.content)
    ins = protocol.TrainInstruction.from_config(
        dict(msg.content.config_records.get(protocol.CONFIG, {}))
    )
    check_workload_allowed(ins.workload, context.node_config)  # before any import
    report = ConfigRecord({"kind": ins.kind})
    if ins.kind == "none":
        log.warning("no part of the model fits this node: %s", ins.reason)
        metrics = MetricRecord(
            {
                protocol.NUM_EXAMPLES: 0,
                protocol.PARTITION_ID: node.partition_id,
                protocol.MIN_BUDGET_BYTES: ins.min_budget_bytes,
                protocol.MESSAGE_BYTES: received,
            }
        )
        report["reason"] = ins.reason
        if ins.eval_runtime == "onnxruntime":  # evaluate the round's model, torch-free
            eval_metrics, eval_report = evaluate_only(msg.content, node, ins)
            metrics.update(eval_metrics)
            report.update(eval_report)
        return Message(
            RecordDict({protocol.METRICS: metrics, protocol.REPORT: report}),
            reply_to=msg,
        )
    workload = get_workload(
        ins.workload, batch_size=ins.batch_size or None, seq_len=ins.seq_len or None
    )
    state = msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    # the reply keeps the received order: Flower's DP wrappers pair arrays by position
    order = {k: i for i, k in enumerate(state)}
    batches, num_examples, torch_seed = draw_batches(
        workload,
        node.partition_id,
        node.num_partitions,
        split=ins.split,
        alpha=ins.dirichlet_alpha,
        classes=ins.class_list,
        seed=ins.seed,
        server_round=ins.server_round,
        local_steps=ins.local_steps,
    )
    result = train_assigned(
        state,
        workload,
        batches,
        num_examples=num_examples,
        torch_seed=torch_seed,
        plan=MemoryPlan.from_dict(json.loads(ins.plan)) if ins.plan else None,
        window=(ins.window_start, ins.window_stop) if ins.kind == "part" else None,
        lr=ins.lr,
        measure=(
            ("inline" if node.budget_source == "measured" else "child")
            if ins.measure == "auto"
            else ins.measure
        ),
        offload_dir=node.offload_dir,
    )
    del state
    metrics = MetricRecord(
        {
            protocol.NUM_EXAMPLES: result.num_examples,
            protocol.TRAIN_LOSS: result.mean_loss,
            protocol.TRAIN_S: result.train_s,
            protocol.PARTITION_ID: node.partition_id,
            protocol.PEAK_BYTES: result.peak_bytes,
            protocol.BASELINE_BYTES: result.baseline_bytes,
            protocol.MESSAGE_BYTES: received,
            protocol.STEPS_DONE: result.steps,
        }
    )
    report["peak-method"] = result.method
    if ins.kind == "part":
        report["window"] = [ins.window_start, ins.window_stop]
    content = RecordDict(
        {
            protocol.ARRAYS: ArrayRecord(
                dict(sorted(result.state.items(), key=lambda kv: order.get(kv[0], -1)))
            ),
            protocol.METRICS: metrics,
            protocol.REPORT: report,
        }
    )
    return Message(content, reply_to=msg)


@app.evaluate()
@_error_reply
def evaluate(msg: Message, context: Context) -> Message:
    config = dict(msg.content.config_records.get(protocol.CONFIG, {}))
    check_workload_allowed(
        str(config.get("workload", "digits-cnn")), context.node_config
    )
    workload = get_workload(str(config.get("workload", "digits-cnn")))
    model = workload.make_model(0)
    model.load_state_dict(
        msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    )
    if workload.own_data:  # this node's own held-out batches
        node = _node(context)
        batches = workload.eval_batches(node.partition_id, node.num_partitions)
        m = evaluate_batches(model, batches, workload.loss_fn)
        num_examples = int(m["num_examples"])
    else:
        m = workload.evaluate(model)
        num_examples = len(workload.items(train=False))
    metrics = MetricRecord(
        {
            "eval-loss": m["loss"],
            "eval-acc": m["accuracy"],
            protocol.NUM_EXAMPLES: num_examples,
        }
    )
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)
