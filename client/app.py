"""fleetfit's ClientApp (Flower Message API).

- ``query``: replies with the node's facts (partition id, count).
- ``train``: loads the global arrays, trains ``local-steps`` on its share of the data,
  replies with ``arrays`` and ``metrics`` (``num-examples``, ``train-loss``, ...).
- ``evaluate``: evaluates the received arrays on the held-out data.

Errors raised here become error replies: the round goes on without this node.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from client.config import NodeConfig
from client.train import train_local
from server import protocol
from workloads import get_workload

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


@app.query()
@_error_reply
def query(msg: Message, context: Context) -> Message:
    node = NodeConfig.from_node_config(dict(context.node_config))
    facts = ConfigRecord(
        {
            protocol.PARTITION_ID: node.partition_id,
            protocol.NUM_PARTITIONS: node.num_partitions,
        }
    )
    return Message(RecordDict({protocol.NODE: facts}), reply_to=msg)


@app.train()
@_error_reply
def train(msg: Message, context: Context) -> Message:
    node = NodeConfig.from_node_config(dict(context.node_config))
    ins = protocol.TrainInstruction.from_config(
        dict(msg.content.config_records[protocol.CONFIG])
    )
    workload = get_workload(
        ins.workload, batch_size=ins.batch_size or None, seq_len=ins.seq_len or None
    )
    model = workload.make_model(ins.seed)
    model.load_state_dict(
        msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    )
    result = train_local(
        model,
        workload,
        node.partition_id,
        node.num_partitions,
        split=ins.split,
        alpha=ins.dirichlet_alpha,
        seed=ins.seed,
        server_round=ins.server_round,
        local_steps=ins.local_steps,
        lr=ins.lr,
    )
    metrics = MetricRecord(
        {
            protocol.NUM_EXAMPLES: result.num_examples,
            protocol.TRAIN_LOSS: result.mean_loss,
            protocol.TRAIN_S: result.train_s,
            protocol.PARTITION_ID: node.partition_id,
        }
    )
    content = RecordDict(
        {protocol.ARRAYS: ArrayRecord(model.state_dict()), protocol.METRICS: metrics}
    )
    return Message(content, reply_to=msg)


@app.evaluate()
@_error_reply
def evaluate(msg: Message, context: Context) -> Message:
    config = dict(msg.content.config_records.get(protocol.CONFIG, {}))
    workload = get_workload(str(config.get("workload", "digits-cnn")))
    model = workload.make_model(0)
    model.load_state_dict(
        msg.content.array_records[protocol.ARRAYS].to_torch_state_dict()
    )
    m = workload.evaluate(model)
    metrics = MetricRecord(
        {
            "eval-loss": m["loss"],
            "eval-acc": m["accuracy"],
            protocol.NUM_EXAMPLES: len(workload.items(train=False)),
        }
    )
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)
