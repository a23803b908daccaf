"""fleetfit's ClientApp (Flower Message API).

- ``query``: replies with the node's facts (partition id, count).
- ``train``: loads the global arrays, trains ``local-steps`` on its share of the data,
  replies with ``arrays`` and ``metrics`` (``num-examples``, ``train-loss``, ...).
- ``evaluate``: evaluates the received arrays on the held-out data.

Errors raised here become error replies: the round goes on without this node.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client.config import NodeConfig
from client.train import train_local
from server import protocol
from workloads import get_workload

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    node = NodeConfig.from_node_config(dict(context.node_config))
    facts = ConfigRecord(
        {protocol.PARTITION_ID: node.partition_id, protocol.NUM_PARTITIONS: node.num_partitions}
    )
    return Message(RecordDict({protocol.NODE: facts}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    node = NodeConfig.from_node_config(dict(context.node_config))
    ins = protocol.TrainInstruction.from_config(dict(msg.content.config_records[protocol.CONFIG]))
    workload = get_workload(
        ins.workload, batch_size=ins.batch_size or None, seq_len=ins.seq_len or None
    )
    model = workload.make_model(ins.seed)
    model.load_state_dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict())
    result = train_local(
        model, workload, node.partition_id, node.num_partitions,
        split=ins.split, alpha=ins.dirichlet_alpha, seed=ins.seed,
        server_round=ins.server_round, local_steps=ins.local_steps, lr=ins.lr,
    )
    metrics = MetricRecord({
        protocol.NUM_EXAMPLES: result.num_examples,
        protocol.TRAIN_LOSS: result.mean_loss,
        protocol.TRAIN_S: result.train_s,
        protocol.PARTITION_ID: node.partition_id,
    })
    content = RecordDict(
        {protocol.ARRAYS: ArrayRecord(model.state_dict()), protocol.METRICS: metrics}
    )
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    config = dict(msg.content.config_records.get(protocol.CONFIG, {}))
    workload = get_workload(str(config.get("workload", "digits-cnn")))
    model = workload.make_model(0)
    model.load_state_dict(msg.content.array_records[protocol.ARRAYS].to_torch_state_dict())
    m = workload.evaluate(model)
    metrics = MetricRecord({
        "eval-loss": m["loss"], "eval-acc": m["accuracy"],
        protocol.NUM_EXAMPLES: len(workload.items(train=False)),
    })
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)
