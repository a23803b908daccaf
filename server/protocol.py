"""The wire contract between fleetfit's ServerApp and ClientApp: record keys and the
instruction sent with each message. The one module of ``server`` that ``client`` imports.

Messages follow Flower's conventions so stock components interoperate: a train
instruction holds ``arrays`` (an ArrayRecord) and ``config`` (a ConfigRecord); a reply
holds ``arrays`` and ``metrics`` (a MetricRecord with ``num-examples``). fleetfit adds
a ``report`` ConfigRecord to replies (the assignment that ran, how the peak was
measured), which stock strategies ignore.

Queries: the server's QUERY carries the fleet description (``fleet-*`` run-config keys)
in ``config``; the reply's ``node`` ConfigRecord holds the node's facts (``FACT_KEYS``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NODE = "node"  # query reply: the node's facts
REPORT = "report"  # train reply: what ran (kind, window, plan, measurement method)

# metrics and facts
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
TRAIN_LOSS = "train-loss"
TRAIN_S = "train-s"
PEAK_BYTES = "measured-peak-bytes"  # peak of the training work above its baseline
BASELINE_BYTES = "baseline-bytes"  # RSS after imports (child) or before the work
MESSAGE_BYTES = "message-bytes"  # bytes of the instruction Flower handed the client
STEPS_DONE = "local-steps-done"
MIN_BUDGET_BYTES = "min-budget-bytes"
# evaluation-only nodes (kind none, eval-runtime onnxruntime): their own data, in ORT
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-acc"
EVAL_NUM_EXAMPLES = "eval-num-examples"
EVAL_S = "eval-s"
ONNX_MODEL = "model.onnx"  # key of the ONNX file's bytes (uint8) in ``arrays``

BUDGET_BYTES = "budget-bytes"
DISK_BUDGET_BYTES = "disk-budget-bytes"
BUDGET_SOURCE = "budget-source"  # node-config | fleet | measured
TOTAL_MEMORY_BYTES = "total-memory-bytes"
AVAILABLE_MEMORY_BYTES = "available-memory-bytes"
FREE_DISK_BYTES = "free-disk-bytes"
FLOPS_PER_S = "flops-per-s"  # measured fp32 matmul rate (times the fleet speed)
NUM_CPUS = "num-cpus"

FACT_KEYS = (
    PARTITION_ID,
    NUM_PARTITIONS,
    BUDGET_BYTES,
    DISK_BUDGET_BYTES,
    BUDGET_SOURCE,
    TOTAL_MEMORY_BYTES,
    AVAILABLE_MEMORY_BYTES,
    FREE_DISK_BYTES,
    FLOPS_PER_S,
    NUM_CPUS,
)

KINDS = ("full", "part", "none")
MEASURES = ("auto", "child", "inline")


@dataclass(frozen=True)
class TrainInstruction:
    """What a client is asked to do in one round (sent as the ``config`` record).

    Every field has a default, so a stock strategy's config (Flower's FedAvg sends only
    ``server-round``) is a valid instruction: plain training of the whole model.
    """

    server_round: int = 1  # 1-based round number
    workload: str = "digits-cnn"  # built-in name or module:function
    local_steps: int = 20  # optimizer steps on local data
    lr: float = 0.003  # AdamW learning rate
    seed: int = 0  # run seed; batch order from (seed, round, partition)
    split: str = "iid"  # iid | dirichlet | natural
    dirichlet_alpha: float = 0.5
    classes: str = ""  # natural split by device class: class index of every partition
    batch_size: int = 0  # 0: the workload's default
    seq_len: int = 0  # 0: the workload's default (language models)
    kind: str = "full"  # full | part | none
    plan: str = ""  # MemoryPlan JSON of the trained chain ("": plain training)
    window_start: int = 0  # part: first trained block (index into the model's blocks)
    window_stop: int = 0  # part: one past the last trained block before the head
    measure: str = "auto"  # child: a measured child process; inline; auto: child
    #   when the node was given a budget, inline when it measured its own
    min_budget_bytes: int = 0  # none: the smallest budget that would get a part
    reason: str = ""  # none: why, in words
    eval_runtime: str = ""  # none: "onnxruntime": evaluate the ONNX model sent in
    #   arrays[ONNX_MODEL] on the node's data, in a torch-free process

    def to_config(self) -> dict[str, Any]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    @property
    def class_list(self) -> tuple[int, ...] | None:
        """``classes`` as integers (None: the split ignores device classes)."""
        if not self.classes.strip():
            return None
        try:
            return tuple(int(x) for x in self.classes.split(","))
        except ValueError:
            raise ValueError(
                f"train instruction classes={self.classes[:80]!r} must be "
                "comma-separated integers"
            ) from None

    @classmethod
    def from_config(cls, config: dict) -> TrainInstruction:
        """Parse a ``config`` record; missing keys take the defaults above."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            key = f.name.replace("_", "-")
            if key not in config:
                continue
            value = config[key]
            want = type(f.default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(
                    f"train instruction {key}={value!r} must be a {want.__name__}"
                )
            values[f.name] = value
        ins = cls(**values)
        if ins.kind not in KINDS:
            raise ValueError(f"train instruction kind={ins.kind!r}: one of {KINDS}")
        if ins.eval_runtime not in ("", "onnxruntime"):
            raise ValueError(
                f"train instruction eval-runtime={ins.eval_runtime!r}: '' or onnxruntime"
            )
        if ins.measure not in MEASURES:
            raise ValueError(
                f"train instruction measure={ins.measure!r}: one of {MEASURES}"
            )
        return ins
