"""Record names and keys of fleetfit's messages.

Messages follow Flower's conventions so stock components interoperate: a train
instruction holds ``arrays`` (an ArrayRecord) and ``config`` (a ConfigRecord); a reply
holds ``arrays`` and ``metrics`` (a MetricRecord with ``num-examples``). fleetfit adds
a ``report`` ConfigRecord to replies (the assignment that ran, how the peak was
measured), which stock strategies ignore.

Queries: the server's QUERY carries the fleet description (``FLEET_KEYS``) in
``config``; the reply's ``node`` ConfigRecord holds the node's facts (``wire.facts.NodeFacts``).
"""

from __future__ import annotations

# record names
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
NODE = "node"  # query reply: the node's facts
REPORT = "report"  # train reply: what ran (kind, window, plan, measurement method)

# metrics of a train reply
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
# evaluation: an evaluate reply, and evaluation-only nodes (kind none, eval-runtime
# onnxruntime) on their own data, in ORT
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-acc"
EVAL_NUM_EXAMPLES = "eval-num-examples"
EVAL_S = "eval-s"
ONNX_MODEL = "model.onnx"  # key of the ONNX file's bytes (uint8) in ``arrays``

# the report of a train reply
KIND = "kind"  # full | part | adapter | none: the assignment that ran
WINDOW = "window"  # part: [start, stop)
PEAK_METHOD = "peak-method"  # child | inline | inline-unreset | ort-child
REASON = "reason"  # none: why nothing fits, in words
EVAL_RUNTIME = "eval-runtime"  # none: the runtime that evaluated (onnxruntime)
EVAL_ERROR = "eval-error"  # none: why the evaluation failed
OWN_PLAN = "own-plan"  # no plan in the instruction (a stock strategy): the plan the
#   node made for its own budget (MemoryPlan JSON, "" for plain training)

# node facts (query reply; wire.facts.NodeFacts reads and writes them)
BUDGET_BYTES = "budget-bytes"
DISK_BUDGET_BYTES = "disk-budget-bytes"
BUDGET_SOURCE = "budget-source"  # node-config | fleet | measured
TOTAL_MEMORY_BYTES = "total-memory-bytes"
AVAILABLE_MEMORY_BYTES = "available-memory-bytes"
FREE_DISK_BYTES = "free-disk-bytes"
FLOPS_PER_S = "flops-per-s"  # measured fp32 matmul rate (times the fleet speed)
NUM_CPUS = "num-cpus"
ADAPTERS = "adapters"  # can train adapters: peft is installed (the hf extra)

# the fleet description (run config, and the server's query to nodes that have none)
FLEET_MEMORY = "fleet-memory-budgets"  # comma-separated sizes by partition id
FLEET_DISK = "fleet-disk-budgets"  # same, for disk
FLEET_SPEEDS = "fleet-speeds"  # same, factors on the measured speed
FLEET_KEYS = (FLEET_MEMORY, FLEET_DISK, FLEET_SPEEDS)

WORKLOAD = "workload"  # evaluate instruction: the workload to build
