"""What a client is asked to do in one round, and how its peak is measured."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from wire.flat import from_flat, to_flat
from wire.shape import RunShape

KINDS = ("full", "part", "adapter", "none")
BASE_DTYPES = ("float32", "bfloat16")  # memory.lora.BASE_DTYPES
MEASURES = ("auto", "child", "inline")
EVAL_RUNTIMES = ("", "onnxruntime")


@dataclass(frozen=True)
class TrainInstruction:
    """What a client is asked to do in one round (sent as the ``config`` record).

    Every field has a default, so a stock strategy's config (Flower's FedAvg sends only
    ``server-round``) is a valid instruction: plain training of the whole model.
    """

    server_round: int = 1  # 1-based round number
    shape: RunShape = field(default_factory=RunShape)  # the run's shape, with this
    #   node's local_steps (a slow node gets fewer)
    classes: tuple[int, ...] = ()  # natural split by device class: class index of
    #   every partition (sent as "0,0,1"); (): the split ignores device classes
    kind: str = "full"  # full | part | adapter | none
    plan: str = ""  # MemoryPlan JSON of the trained chain ("": plain training)
    window_start: int = 0  # part: first trained block (index into the model's
    #   blocks); adapter: first block carrying adapters (they sit in [start, last))
    window_stop: int = 0  # part: one past the last trained block before the head
    measure: str = "auto"  # child: a measured child process; inline; auto: child
    #   when the node was given a budget, inline when it measured its own
    min_budget_bytes: int = 0  # none: the smallest budget that would get a part
    reason: str = ""  # none: why, in words
    eval_runtime: str = ""  # none: "onnxruntime": evaluate the ONNX model sent in
    #   arrays[ONNX_MODEL] on the node's data, in a torch-free process
    lora_rank: int = 0  # adapter: the factors' rank r (>= 1)
    lora_alpha: float = 0.0  # adapter: LoRA alpha; updates scale by alpha / r
    lora_targets: tuple[str, ...] = ()  # adapter: leaf names of the adapted linear
    #   modules (sent as "qkv,proj"); (): every linear module of the blocks
    base_dtype: str = "float32"  # adapter: storage of the frozen base: float32 |
    #   bfloat16 (its forward under bfloat16 autocast)

    def to_config(self) -> dict[str, Any]:
        return to_flat(self)

    @property
    def window(self) -> tuple[int, int] | None:
        """The trained window of a ``part`` assignment (None: the whole model)."""
        return (self.window_start, self.window_stop) if self.kind == "part" else None

    @classmethod
    def from_config(cls, config: dict) -> TrainInstruction:
        """Parse a ``config`` record; missing keys take the defaults above."""
        ins = from_flat(cls, config, what="train instruction")
        if ins.kind not in KINDS:
            raise ValueError(f"train instruction kind={ins.kind!r}: one of {KINDS}")
        if ins.eval_runtime not in EVAL_RUNTIMES:
            raise ValueError(
                f"train instruction eval-runtime={ins.eval_runtime!r}: '' or onnxruntime"
            )
        if ins.kind == "adapter" and not (
            ins.lora_rank >= 1
            and math.isfinite(ins.lora_alpha)
            and ins.lora_alpha > 0
            and ins.window_start >= 0
        ):
            raise ValueError(
                f"train instruction kind=adapter: lora-rank={ins.lora_rank!r} must be "
                f">= 1, lora-alpha={ins.lora_alpha!r} > 0 and window-start="
                f"{ins.window_start!r} >= 0"
            )
        if ins.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"train instruction base-dtype={ins.base_dtype!r}: one of {BASE_DTYPES}"
            )
        mu = ins.shape.proximal_mu
        if not (math.isfinite(mu) and mu >= 0):
            raise ValueError(
                f"train instruction proximal-mu={mu!r}: a number >= 0 (0: no "
                "proximal term)"
            )
        if ins.measure not in MEASURES:
            raise ValueError(
                f"train instruction measure={ins.measure!r}: one of {MEASURES}"
            )
        return ins


def resolve_measure(requested: str, budget_source: str | None) -> str:
    """How a node's peak is measured: ``requested`` unless it is ``auto``.

    ``auto``: a node given its budget (node config or fleet) is measured in a child
    process, one that measured its own budget trains inline; with its budget source
    unknown (a node that did not answer the query), ``auto`` stays for the node to
    resolve with its own facts.
    """
    if requested != "auto" or not budget_source:
        return requested
    return "inline" if budget_source == "measured" else "child"


__all__ = [
    "BASE_DTYPES",
    "EVAL_RUNTIMES",
    "KINDS",
    "MEASURES",
    "TrainInstruction",
    "resolve_measure",
]
