"""The ServerApp's settings: Flower's flat kebab-case run config, parsed once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from memory.errors import MemoryPlanError
from memory.sizes import parse_bytes
from wire.flat import from_flat, split_list, to_flat
from wire.instruction import MEASURES, parse_classes
from wire.keys import FLEET_DISK, FLEET_MEMORY, FLEET_SPEEDS
from workloads.registry import EVAL_MAX_ITEMS, Workload, get_workload
from workloads.splits import SPLITS

STRATEGIES = ("fleetfit", "exclude")
"""What nodes are asked to train (see ``ServerConfig.strategy``)."""


@dataclass(frozen=True)
class ServerConfig:
    """Settings of a federated run (run-config key in brackets)."""

    workload: str = "digits-cnn"  # [workload] built-in name or module:function
    num_server_rounds: int = 5  # [num-server-rounds] training rounds
    local_steps: int = 20  # [local-steps] optimizer steps per client per round
    lr: float = 0.003  # [lr] client AdamW learning rate
    split: str = "iid"  # [split] iid | dirichlet | natural
    dirichlet_alpha: float = 0.5  # [dirichlet-alpha] label skew for split=dirichlet
    seed: int = 0  # [seed] all randomness derives from it
    fraction_train: float = 1.0  # [fraction-train] share of nodes sampled per round
    min_nodes: int = 2  # [min-nodes] nodes to wait for before round 1
    batch_size: int = 0  # [batch-size] 0: the workload's default
    seq_len: int = 0  # [seq-len] 0: the workload's default
    out: str = "runs/flwr"  # [out] run folder
    round_timeout_s: float = field(default=600.0, metadata={"key": "round-timeout"})
    #   [round-timeout] seconds to wait for replies
    node_wait_s: float = field(default=300.0, metadata={"key": "node-wait"})
    #   [node-wait] seconds to wait for min-nodes
    min_replies: int = 1  # [min-replies] replies a round needs to change the model
    train_time_s: float = field(default=0.0, metadata={"key": "train-time"})
    #   [train-time] seconds of local training per round; a slow node gets fewer
    #   steps. 0: half of round-timeout
    norm_bound: float = 10.0  # [norm-bound] reject updates whose relative change is
    #   above this many times the round's median; 0 disables
    runtime_reserve: str = "100MiB"  # [runtime-reserve] fixed process costs the
    #   memory model does not hold; plans are made for budget minus this
    client_measure: str = "auto"  # [client-measure] auto | child | inline: auto
    #   measures in a child process when the node was given a budget
    resume: bool = False  # [resume] continue from the run folder's state/ subfolder
    fleet_memory_budgets: str = ""  # [fleet-memory-budgets] comma-separated sizes by
    #   partition id (simulation; a node's own memory-budget wins)
    fleet_disk_budgets: str = ""  # [fleet-disk-budgets] same, for disk
    fleet_speeds: str = ""  # [fleet-speeds] same, factors on the measured speed
    fleet_availability: str = ""  # [fleet-availability] same, the probability that a
    #   node is online in a round (simulation; an offline node is not sampled)
    fleet_classes: str = ""  # [fleet-classes] device class index of every partition
    #   (comma-separated, one per partition): a natural split follows the classes
    strategy: str = "fleetfit"  # [strategy] fleetfit: every node trains what fits
    #   (plan, part, or evaluation only); exclude: the status quo, a node whose plain
    #   training step does not fit its budget takes no part
    eval_runtime: str = "torch"  # [eval-runtime] torch | onnxruntime: the runtime of
    #   the server's central evaluation (onnxruntime: the exported model, in process)
    eval_windows: int = EVAL_MAX_ITEMS  # [eval-windows] language models: held-out
    #   windows (of seq-len tokens) the central evaluation runs on each round
    eval_only: str = "onnxruntime"  # [eval-only] onnxruntime | off: nodes too small
    #   for any training evaluate the round's model (ONNX) on their data in a
    #   torch-free process, or (off) only reply that nothing fits
    export_onnx: str = "end"  # [export-onnx] end | every-round | off: write
    #   model.onnx and export.json to the run folder
    export_quantize: bool = False  # [export-quantize] also model.int8.onnx
    dp_clipping_norm: float = 0.0  # [dp-clipping-norm] > 0: central differential
    #   privacy: every update's change clipped to this L2 norm, uniform average
    #   (server/privacy.py); nodes also clip before sending. 0: off
    dp_noise_multiplier: float = 0.0  # [dp-noise-multiplier] Gaussian noise of
    #   this many clipping norms on the sum of clipped changes

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> ServerConfig:
        """Parse and validate; unknown keys are an error naming the key."""
        cfg = from_flat(cls, run_config, what="run-config", strict=True)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(key: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"run-config {key}={value!r} is invalid: {rule}")

        if self.num_server_rounds < 1:
            raise bad("num-server-rounds", self.num_server_rounds, "must be at least 1")
        if self.local_steps < 1:
            raise bad("local-steps", self.local_steps, "must be at least 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise bad("lr", self.lr, "must be a positive number")
        if self.split not in SPLITS:
            raise bad("split", self.split, f"choose one of {', '.join(SPLITS)}")
        if not self.dirichlet_alpha > 0:
            raise bad("dirichlet-alpha", self.dirichlet_alpha, "must be > 0")
        if not 0 < self.fraction_train <= 1:
            raise bad("fraction-train", self.fraction_train, "must be in (0, 1]")
        if self.min_nodes < 1:
            raise bad("min-nodes", self.min_nodes, "must be at least 1")
        if self.batch_size < 0 or self.seq_len < 0:
            raise bad(
                "batch-size/seq-len", (self.batch_size, self.seq_len), "must be >= 0"
            )
        if self.min_replies < 0:
            raise bad("min-replies", self.min_replies, "must be >= 0")
        if not (self.train_time_s >= 0 and math.isfinite(self.train_time_s)):
            raise bad("train-time", self.train_time_s, "must be >= 0 seconds")
        if not (self.norm_bound >= 0 and math.isfinite(self.norm_bound)):
            raise bad("norm-bound", self.norm_bound, "must be >= 0")
        if self.eval_runtime not in ("torch", "onnxruntime"):
            raise bad("eval-runtime", self.eval_runtime, "torch or onnxruntime")
        if self.eval_windows < 1:
            raise bad("eval-windows", self.eval_windows, "must be at least 1")
        if self.eval_only not in ("onnxruntime", "off"):
            raise bad("eval-only", self.eval_only, "onnxruntime or off")
        if self.export_onnx not in ("end", "every-round", "off"):
            raise bad("export-onnx", self.export_onnx, "end, every-round or off")
        if self.client_measure not in MEASURES:
            raise bad("client-measure", self.client_measure, "auto, child or inline")
        try:
            parse_bytes(self.runtime_reserve, what="runtime-reserve", allow_zero=True)
            for key, spec in (
                (FLEET_MEMORY, self.fleet_memory_budgets),
                (FLEET_DISK, self.fleet_disk_budgets),
            ):
                for item in split_list(spec):
                    parse_bytes(item, what=key, allow_zero=key == FLEET_DISK)
        except MemoryPlanError as e:
            raise ValueError(str(e)) from None
        for item in split_list(self.fleet_speeds):
            try:
                ok = float(item) > 0
            except ValueError:
                ok = False
            if not ok:
                raise bad(FLEET_SPEEDS, self.fleet_speeds, "positive numbers")
        for item in split_list(self.fleet_availability):
            try:
                ok = 0 < float(item) <= 1
            except ValueError:
                ok = False
            if not ok:
                raise bad(
                    "fleet-availability",
                    self.fleet_availability,
                    "probabilities in (0, 1], comma-separated",
                )
        if self.fleet_classes:
            try:
                classes = self.classes or (-1,)
            except ValueError:
                classes = (-1,)
            if min(classes) < 0:
                raise bad(
                    "fleet-classes",
                    self.fleet_classes,
                    "class indices >= 0, one per partition, comma-separated",
                )
        for key, value in (
            ("dp-clipping-norm", self.dp_clipping_norm),
            ("dp-noise-multiplier", self.dp_noise_multiplier),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise bad(key, value, "must be a number >= 0")
        if self.dp_noise_multiplier > 0 and not self.dp_clipping_norm > 0:
            raise bad(
                "dp-noise-multiplier",
                self.dp_noise_multiplier,
                "needs dp-clipping-norm > 0 (noise is scaled by the clipping norm)",
            )
        if self.strategy not in STRATEGIES:
            raise bad("strategy", self.strategy, " or ".join(STRATEGIES))
        if not self.round_timeout_s > 0 or not self.node_wait_s > 0:
            raise bad(
                "round-timeout/node-wait",
                (self.round_timeout_s, self.node_wait_s),
                "must be > 0 seconds",
            )

    def to_run_config(self) -> dict[str, Any]:
        return to_flat(self)

    @property
    def classes(self) -> tuple[int, ...] | None:
        """``fleet-classes`` as integers (None where not given)."""
        return parse_classes(self.fleet_classes, what="run-config fleet-classes")

    def availability(self, partition_id: int) -> float:
        """The probability that partition ``partition_id``'s node is online a round."""
        items = split_list(self.fleet_availability)
        return float(items[partition_id % len(items)]) if items else 1.0

    def load_workload(self) -> Workload:
        """The run's workload with its batch, sequence and evaluation settings
        (``WorkloadError``, a ``ValueError``, naming what is wrong)."""
        return get_workload(
            self.workload,
            batch_size=self.batch_size or None,
            seq_len=self.seq_len or None,
            eval_windows=self.eval_windows,
        )

    @property
    def reserve_bytes(self) -> int:
        return parse_bytes(self.runtime_reserve, allow_zero=True)

    @property
    def train_time(self) -> float:
        """Seconds of local training a node may spend per round."""
        return self.train_time_s or self.round_timeout_s / 2

    def fleet(self) -> dict[str, str]:
        """The fleet description sent with queries (non-empty keys only)."""
        return {
            k: v
            for k, v in (
                (FLEET_MEMORY, self.fleet_memory_budgets),
                (FLEET_DISK, self.fleet_disk_budgets),
                (FLEET_SPEEDS, self.fleet_speeds),
            )
            if v
        }
