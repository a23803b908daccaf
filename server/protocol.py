"""The wire contract between fleetfit's ServerApp and ClientApp: record keys and the
instruction sent with each message. The one module of ``server`` that ``client`` imports.

Messages follow Flower's conventions so stock components interoperate: a train
instruction holds ``arrays`` (an ArrayRecord) and ``config`` (a ConfigRecord); a reply
holds ``arrays`` and ``metrics`` (a MetricRecord with ``num-examples``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NODE = "node"  # query reply: the node's facts

NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
TRAIN_LOSS = "train-loss"
TRAIN_S = "train-s"


@dataclass(frozen=True)
class TrainInstruction:
    """What a client is asked to do in one round (sent as the ``config`` record)."""

    server_round: int  # 1-based round number
    workload: str  # built-in name or module:function
    local_steps: int  # optimizer steps on local data
    lr: float  # AdamW learning rate
    seed: int  # run seed; the client derives its batch order from (seed, round, partition)
    split: str  # iid | dirichlet | natural
    dirichlet_alpha: float
    batch_size: int  # 0: the workload's default
    seq_len: int  # 0: the workload's default (language models)

    def to_config(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    @classmethod
    def from_config(cls, config: dict) -> TrainInstruction:
        names = cls.__dataclass_fields__
        missing = [
            n.replace("_", "-") for n in names if n.replace("_", "-") not in config
        ]
        if missing:
            raise ValueError(f"train instruction lacks {', '.join(missing)}")
        return cls(**{n: config[n.replace("_", "-")] for n in names})
