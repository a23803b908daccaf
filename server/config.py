"""The ServerApp's settings: Flower's flat kebab-case run config, parsed once.

``ServerConfig`` holds the run's shape (``wire.shape.RunShape``, shared with the
simulation settings and the train instruction) and three sub-configs: ``privacy``,
``export`` and ``fleet``. Their keys stay flat and unchanged (``dp-clipping-norm``,
``export-onnx``, ``fleet-speeds``); ``wire.flat`` flattens them, and reads the fleet's
comma-separated lists once into typed tuples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from memory.lora import LoraSpec
from memory.sizes import parse_bytes
from server.fedopt import ServerOptConfig
from wire.flat import flat_key, from_flat, to_flat
from wire.instruction import MEASURES
from wire.keys import FLEET_DISK, FLEET_KEYS, FLEET_MEMORY, FLEET_SPEEDS
from wire.shape import RUNTIME_RESERVE, RunShape
from workloads.registry import EVAL_MAX_ITEMS, Workload, get_workload
from workloads.splits import SPLITS

STRATEGIES = ("fleetfit", "exclude", "heterofl", "fedrolex")
"""What nodes are asked to train (see ``ServerConfig.strategy``)."""

UPDATE_CLIPS = ("median", "off")
"""How updates' changes are clipped (see ``ServerConfig.update_clip``)."""

REPLY_ALLOWANCE_BYTES = 2**20  # "auto" max-reply-bytes beyond 1.25 x the model:
#   metrics, report texts and each array's .npy header (about 128 bytes)


@dataclass(frozen=True)
class PrivacyConfig:
    """Central differential privacy (run-config key in brackets)."""

    clipping_norm: float = field(default=0.0, metadata={"key": "dp-clipping-norm"})
    #   [dp-clipping-norm] > 0: every update's change clipped to this L2 norm, uniform
    #   average (server/privacy.py); nodes also clip before sending. 0: off
    noise_multiplier: float = field(
        default=0.0, metadata={"key": "dp-noise-multiplier"}
    )
    #   [dp-noise-multiplier] Gaussian noise of this many clipping norms on the sum
    #   of clipped changes


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA adapters on a frozen base (run-config key in brackets; memory.lora,
    server.lora_agg)."""

    mode: str = field(default="off", metadata={"key": "adapters"})
    #   [adapters] off | auto | all: auto gives a node that no whole-model plan fits
    #   an adapter assignment before a part window; all gives every node one. off:
    #   the choice measured better (docs/simulations.md, "Adapters or part windows")
    rank: int = field(default=8, metadata={"key": "lora-rank"})
    #   [lora-rank] the factors' rank r
    alpha: float = field(default=16.0, metadata={"key": "lora-alpha"})
    #   [lora-alpha] updates scale by alpha / r
    targets: tuple[str, ...] = field(default=(), metadata={"key": "lora-targets"})
    #   [lora-targets] leaf names of the adapted linear modules ("qkv,fc");
    #   "": every linear module of the blocks before the head
    base_dtype: str = field(default="float32", metadata={"key": "lora-base-dtype"})
    #   [lora-base-dtype] float32 | bfloat16 | int8: how a node holds the frozen base

    def spec(self) -> LoraSpec:
        return LoraSpec(
            rank=self.rank,
            alpha=self.alpha,
            targets=self.targets,
            base_dtype=self.base_dtype,
        )


@dataclass(frozen=True)
class ExportConfig:
    """The exported model (ONNX) and where it is evaluated (run-config key in
    brackets)."""

    onnx: str = field(default="end", metadata={"key": "export-onnx"})
    #   [export-onnx] end | every-round | off: write model.onnx and export.json to
    #   the run folder
    quantize: bool = field(default=False, metadata={"key": "export-quantize"})
    #   [export-quantize] also model.int8.onnx
    eval_runtime: str = "torch"  # [eval-runtime] torch | onnxruntime: the runtime of
    #   the server's central evaluation (onnxruntime: the exported model, in process)
    eval_only: str = "onnxruntime"  # [eval-only] onnxruntime | off: nodes too small
    #   for any training evaluate the round's model (ONNX) on their data in a
    #   torch-free process, or (off) only reply that nothing fits


def _memory_budget(entry: Any) -> int:
    return parse_bytes(entry, what="entry")


def _disk_budget(entry: Any) -> int:
    return parse_bytes(entry, what="entry", allow_zero=True)


def _number(entry: Any) -> float:
    """The entry as a float; NaN where it is none (every range check fails)."""
    if isinstance(entry, bool) or not isinstance(entry, int | float | str):
        return math.nan
    try:
        return float(entry)
    except ValueError:
        return math.nan


def _speed(entry: Any) -> float:
    value = _number(entry)
    if not value > 0:
        raise ValueError("positive numbers")
    return value


def _link(entry: Any) -> float:
    value = _number(entry)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError("bytes per second > 0, comma-separated")
    return value


def _probability(entry: Any) -> float:
    value = _number(entry)
    if not 0 < value <= 1:
        raise ValueError("probabilities in (0, 1], comma-separated")
    return value


def _class_index(entry: Any) -> int:
    if isinstance(entry, int) and not isinstance(entry, bool):
        value = entry
    elif isinstance(entry, str) and entry.strip().isdigit():
        value = int(entry)
    else:
        value = -1
    if value < 0:
        raise ValueError("class indices >= 0, one per partition, comma-separated")
    return value


@dataclass(frozen=True)
class FleetConfig:
    """A simulated fleet, by partition id: entry ``partition-id mod count`` of each
    list; () leaves it to the node (run-config key in brackets; given as a
    comma-separated string or a list, held as typed tuples)."""

    memory_budgets: tuple[int, ...] = field(
        default=(), metadata={"key": FLEET_MEMORY, "item": _memory_budget}
    )
    #   [fleet-memory-budgets] bytes ("512MB" in the run config); a node's own
    #   memory-budget wins; (): each node uses 50% of the memory it measures
    disk_budgets: tuple[int, ...] = field(
        default=(), metadata={"key": FLEET_DISK, "item": _disk_budget}
    )
    #   [fleet-disk-budgets] bytes of disk for offload and streaming (0: none)
    speeds: tuple[float, ...] = field(
        default=(), metadata={"key": FLEET_SPEEDS, "item": _speed}
    )
    #   [fleet-speeds] factors on the measured speed
    uplinks: tuple[float, ...] = field(
        default=(), metadata={"key": "fleet-uplinks", "item": _link}
    )
    #   [fleet-uplinks] bytes/s device -> server, for the simulated round time
    #   (server/simtime.py); (): not modelled
    downlinks: tuple[float, ...] = field(
        default=(), metadata={"key": "fleet-downlinks", "item": _link}
    )
    #   [fleet-downlinks] bytes/s server -> device
    availability: tuple[float, ...] = field(
        default=(), metadata={"key": "fleet-availability", "item": _probability}
    )
    #   [fleet-availability] the probability that a node is online in a round (an
    #   offline node is not sampled)
    classes: tuple[int, ...] = field(
        default=(), metadata={"key": "fleet-classes", "item": _class_index}
    )
    #   [fleet-classes] device class index of every partition (one per partition):
    #   a natural split follows the classes

    def online_probability(self, partition_id: int) -> float:
        """The probability that partition ``partition_id``'s node is online a round."""
        a = self.availability
        return a[partition_id % len(a)] if a else 1.0

    def links(self, partition_id: int) -> tuple[float | None, float | None]:
        """(downlink, uplink) of partition ``partition_id`` in bytes/s (None: not
        given)."""
        down, up = self.downlinks, self.uplinks
        return (
            down[partition_id % len(down)] if down else None,
            up[partition_id % len(up)] if up else None,
        )

    def to_query(self) -> dict[str, str]:
        """The fleet description sent with queries (non-empty lists only), as the
        comma-separated strings a node's config holds."""
        flat = to_flat(self)
        return {k: flat[k] for k in FLEET_KEYS if flat[k]}


@dataclass(frozen=True)
class ServerConfig:
    """Settings of a federated run (run-config key in brackets)."""

    shape: RunShape = field(default_factory=RunShape)  # [workload] [local-steps]
    #   [lr] [seed] [split] [dirichlet-alpha] [batch-size] [seq-len]: what every
    #   client trains on (wire/shape.py)
    num_server_rounds: int = 5  # [num-server-rounds] training rounds
    fraction_train: float = 1.0  # [fraction-train] share of nodes sampled per round
    min_nodes: int = 2  # [min-nodes] nodes to wait for before round 1
    out: str = "runs/flwr"  # [out] run folder
    round_timeout_s: float = field(default=600.0, metadata={"key": "round-timeout"})
    #   [round-timeout] seconds to wait for replies
    node_wait_s: float = field(default=300.0, metadata={"key": "node-wait"})
    #   [node-wait] seconds to wait for min-nodes
    min_replies: int = 1  # [min-replies] replies a round needs to change the model
    train_time_s: float = field(default=0.0, metadata={"key": "train-time"})
    #   [train-time] seconds of local training per round; a slow node gets fewer
    #   steps. 0: half of round-deadline if set, else half of round-timeout
    round_deadline_s: float = field(default=0.0, metadata={"key": "round-deadline"})
    #   [round-deadline] simulated seconds a device may take for its round (local
    #   steps x its predicted step time + its messages over fleet-downlinks and
    #   fleet-uplinks, server/simtime.py); a device over it is late and its update
    #   is dropped. 0: no deadline
    init_model: str = ""  # [init-model] a safetensors file (server.persist's
    #   model.safetensors) the model starts from instead of its seeded
    #   initialisation, e.g. a pretrained model; "": from scratch
    norm_bound: float = 10.0  # [norm-bound] reject updates whose relative change is
    #   above this many times the round's median; 0 disables
    max_examples: int = 1_000_000  # [max-examples] examples a reply may claim; a
    #   larger claim counts as this many (its status says so)
    weight_clip: float = 2.0  # [weight-clip] an update's averaging weight is at most
    #   this many times the round's median example count (the lower median of the
    #   accepted updates), so no node decides the average by its claim; 0 disables
    update_clip: str = "median"  # [update-clip] median | off: median clips every
    #   accepted update's change (update - global) to the norm the round's median
    #   update has over the entries it trained (server/aggregate.py clip_changes), so
    #   that a reply's influence, not only its weight, is bounded. Applies to every
    #   aggregation but central DP, whose fixed clip (dp-clipping-norm) replaces it
    max_reply_bytes: str = "auto"  # [max-reply-bytes] bytes a train reply may carry
    #   (its arrays' data, record and key names, texts), checked before any array is
    #   decoded: a size ("512MB"), "auto" (1.25 x the global model's bytes + 1 MiB:
    #   a whole-model reply of the largest model the run trains) or "0" (no limit)
    runtime_reserve: str = RUNTIME_RESERVE  # [runtime-reserve] fixed process costs the
    #   memory model does not hold; plans are made for budget minus this
    client_measure: str = "auto"  # [client-measure] auto | child | inline: auto
    #   measures in a child process when the node was given a budget
    resume: bool = False  # [resume] continue from the run folder's state/ subfolder
    fleet: FleetConfig = field(default_factory=FleetConfig)  # [fleet-*] simulation
    strategy: str = "fleetfit"  # [strategy] fleetfit: every node trains what fits
    #   (plan, part, or evaluation only); exclude: the status quo, a node whose plain
    #   training step does not fit its budget takes no part; heterofl / fedrolex:
    #   each node trains the widest width-scaled sub-model whose plain step fits,
    #   static or rolling indices (server/submodel.py)
    eval_windows: int = EVAL_MAX_ITEMS  # [eval-windows] language models: held-out
    #   windows (of seq-len tokens) the central evaluation runs on each round
    export: ExportConfig = field(default_factory=ExportConfig)  # [export-onnx]
    #   [export-quantize] [eval-runtime] [eval-only]
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    #   [dp-clipping-norm] [dp-noise-multiplier]
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    #   [adapters] [lora-rank] [lora-alpha] [lora-targets] [lora-base-dtype]
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    #   [server-opt] [server-lr] [server-momentum] [server-beta1] [server-beta2]
    #   [server-tau] [aggregation] [trim-fraction]: the server optimiser and the
    #   per-key aggregate it steps with (server/fedopt.py)

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> ServerConfig:
        """Parse and validate; unknown keys are an error naming the key."""
        cfg = from_flat(cls, run_config, what="run-config", strict=True)
        cfg.validate()
        return cfg

    def validate(self, what: str = "run-config") -> None:
        """Check every value; ``ValueError`` naming the key, the value and the rule.

        ``what`` names the source in the message (a fleet file reads the same keys).
        """

        def bad(key: str, value: Any, rule: str) -> ValueError:
            return ValueError(f"{what} {key}={value!r} is invalid: {rule}")

        shape = self.shape
        if self.num_server_rounds < 1:
            raise bad("num-server-rounds", self.num_server_rounds, "must be at least 1")
        if shape.local_steps < 1:
            raise bad("local-steps", shape.local_steps, "must be at least 1")
        if not (math.isfinite(shape.lr) and shape.lr > 0):
            raise bad("lr", shape.lr, "must be a positive number")
        if shape.split not in SPLITS:
            raise bad("split", shape.split, f"choose one of {', '.join(SPLITS)}")
        if not (math.isfinite(shape.dirichlet_alpha) and shape.dirichlet_alpha > 0):
            raise bad("dirichlet-alpha", shape.dirichlet_alpha, "must be > 0")
        if not (math.isfinite(shape.proximal_mu) and shape.proximal_mu >= 0):
            raise bad(
                "proximal-mu", shape.proximal_mu, "must be >= 0 (0: no proximal term)"
            )
        if not 0 <= shape.public_share <= 0.5:
            raise bad(
                "public-share",
                shape.public_share,
                "must be in [0, 0.5] (0: every training item is the clients')",
            )
        if not 0 < self.fraction_train <= 1:
            raise bad("fraction-train", self.fraction_train, "must be in (0, 1]")
        if self.min_nodes < 1:
            raise bad("min-nodes", self.min_nodes, "must be at least 1")
        if shape.batch_size < 0 or shape.seq_len < 0:
            raise bad(
                "batch-size/seq-len", (shape.batch_size, shape.seq_len), "must be >= 0"
            )
        if self.min_replies < 0:
            raise bad("min-replies", self.min_replies, "must be >= 0")
        if not (self.train_time_s >= 0 and math.isfinite(self.train_time_s)):
            raise bad("train-time", self.train_time_s, "must be >= 0 seconds")
        if not (self.round_deadline_s >= 0 and math.isfinite(self.round_deadline_s)):
            raise bad(
                "round-deadline",
                self.round_deadline_s,
                "must be >= 0 simulated seconds (0: no deadline)",
            )
        if not (self.norm_bound >= 0 and math.isfinite(self.norm_bound)):
            raise bad("norm-bound", self.norm_bound, "must be >= 0")
        if not 1 <= self.max_examples <= 2**53:
            raise bad("max-examples", self.max_examples, "must be in 1..2**53")
        if not (self.weight_clip == 0 or 1 <= self.weight_clip < math.inf):
            raise bad("weight-clip", self.weight_clip, "must be 0 (off) or >= 1")
        if self.update_clip not in UPDATE_CLIPS:
            raise bad("update-clip", self.update_clip, " or ".join(UPDATE_CLIPS))
        if self.max_reply_bytes.strip().lower() != "auto":
            try:
                parse_bytes(self.max_reply_bytes, what="size", allow_zero=True)
            except ValueError as e:
                raise bad(
                    "max-reply-bytes",
                    self.max_reply_bytes,
                    f'{e}; or "auto" (from the model\'s size) or "0" (no limit)',
                ) from None
        export = self.export
        if export.eval_runtime not in ("torch", "onnxruntime"):
            raise bad("eval-runtime", export.eval_runtime, "torch or onnxruntime")
        if self.eval_windows < 1:
            raise bad("eval-windows", self.eval_windows, "must be at least 1")
        if export.eval_only not in ("onnxruntime", "off"):
            raise bad("eval-only", export.eval_only, "onnxruntime or off")
        if export.onnx not in ("end", "every-round", "off"):
            raise bad("export-onnx", export.onnx, "end, every-round or off")
        if self.client_measure not in MEASURES:
            raise bad("client-measure", self.client_measure, "auto, child or inline")
        try:
            parse_bytes(self.runtime_reserve, what="runtime-reserve", allow_zero=True)
        except ValueError as e:
            raise ValueError(str(e)) from None
        _check_fleet(self.fleet)
        privacy = self.privacy
        for key, value in (
            ("dp-clipping-norm", privacy.clipping_norm),
            ("dp-noise-multiplier", privacy.noise_multiplier),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise bad(key, value, "must be a number >= 0")
        if privacy.noise_multiplier > 0 and not privacy.clipping_norm > 0:
            raise bad(
                "dp-noise-multiplier",
                privacy.noise_multiplier,
                "needs dp-clipping-norm > 0 (noise is scaled by the clipping norm)",
            )
        self.server_opt.validate(what)
        if self.server_opt.aggregation != "mean" and privacy.clipping_norm > 0:
            raise bad(
                "aggregation",
                self.server_opt.aggregation,
                "central DP (dp-clipping-norm > 0) averages the clipped changes "
                "uniformly; use aggregation=mean with it",
            )
        if self.strategy not in STRATEGIES:
            raise bad("strategy", self.strategy, " or ".join(STRATEGIES))
        ad = self.adapters
        if ad.mode not in ("off", "auto", "all"):
            raise bad("adapters", ad.mode, "one of off, auto, all")
        try:
            ad.spec()
        except ValueError as e:
            raise bad("lora-rank/lora-alpha/lora-base-dtype", ad, str(e)) from None
        if ad.mode != "off" and privacy.clipping_norm > 0:
            raise bad(
                "adapters",
                ad.mode,
                "central DP has nodes clip their replies against the arrays they "
                "received, and an adapter reply holds factors it did not receive; "
                "use dp-clipping-norm=0 with adapters",
            )
        if ad.mode != "off" and self.shape.proximal_mu > 0:
            raise bad(
                "adapters",
                ad.mode,
                "adapters start fresh every round, so FedProx's anchor (the "
                "received weights) has nothing to hold them to; use proximal-mu=0",
            )
        if ad.mode != "off" and self.strategy != "fleetfit":
            raise bad(
                "adapters",
                ad.mode,
                f"adapter assignments come from strategy=fleetfit, not {self.strategy}",
            )
        if self.strategy in ("heterofl", "fedrolex") and (
            self.server_opt.aggregation != "mean" or privacy.clipping_norm > 0
        ):
            raise bad(
                "strategy",
                self.strategy,
                "its sub-model updates are averaged entry by entry over the nodes "
                "that cover each entry; use aggregation=mean and no central DP "
                "(dp-clipping-norm=0) with it",
            )
        if not self.round_timeout_s > 0 or not self.node_wait_s > 0:
            raise bad(
                "round-timeout/node-wait",
                (self.round_timeout_s, self.node_wait_s),
                "must be > 0 seconds",
            )

    def to_run_config(self) -> dict[str, Any]:
        return to_flat(self)

    def load_workload(self) -> Workload:
        """The run's workload with its batch, sequence and evaluation settings
        (``WorkloadError``, a ``ValueError``, naming what is wrong)."""
        return get_workload(
            self.shape.workload,
            batch_size=self.shape.batch_size or None,
            seq_len=self.shape.seq_len or None,
            eval_windows=self.eval_windows,
        )

    def reply_limit(self, model_bytes: int) -> int:
        """Bytes a train reply may carry (``max-reply-bytes``; 0: no limit), where
        ``model_bytes`` is the global model's state (the largest model any node is
        sent: sub-models, windows and adapter factors are smaller)."""
        text = self.max_reply_bytes.strip().lower()
        if text == "auto":
            return model_bytes * 5 // 4 + REPLY_ALLOWANCE_BYTES
        return parse_bytes(text, allow_zero=True)

    @property
    def reserve_bytes(self) -> int:
        return parse_bytes(self.runtime_reserve, allow_zero=True)

    @property
    def train_time(self) -> float:
        """Seconds of local training a node may spend per round."""
        return self.train_time_s or (self.round_deadline_s or self.round_timeout_s) / 2


def _check_fleet(fleet: FleetConfig) -> None:
    """A fleet built in Python passes the parser a run config passes: each list,
    written as its run-config string, must read back as itself (a bad entry, or a
    size string where bytes belong, fails naming the key)."""
    for f in fields(FleetConfig):
        if not isinstance(getattr(fleet, f.name), tuple):
            raise ValueError(
                f"run-config {flat_key(f)}={getattr(fleet, f.name)!r} is invalid: "
                "give a tuple, one entry per partition"
            )
    flat = to_flat(fleet)
    parsed = from_flat(FleetConfig, flat, what="run-config")
    for f in fields(FleetConfig):
        given, want = getattr(fleet, f.name), getattr(parsed, f.name)
        if given != want:
            raise ValueError(
                f"run-config {flat_key(f)}={flat[flat_key(f)]!r} is invalid: give "
                f"the entries as parsed, {want!r}, not {given!r}"
            )
