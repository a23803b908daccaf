"""A memory plan as plain data: what to do with each block's activations and state.

The planner (``memory.plan``) produces it; ``partition.schedule`` compiles it into a
schedule of actions and ``partition.local`` executes that schedule on one device.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

Activations = Literal["keep", "recompute", "offload"]
State = Literal["resident", "stream"]


@dataclass(frozen=True)
class BlockPlan:
    """What one block does in a training step.

    Attributes:
        name: the block's module path (``"layers.3"``).
        activations: ``keep`` the tensors its forward saves for backward, ``recompute``
            them in backward from the block's input, or ``offload`` them to disk (or to
            host memory on CUDA) and bring them back for backward.
        state: keep parameters, gradients and optimizer state ``resident`` in memory, or
            ``stream`` them from disk: loaded for forward and again for backward, the
            optimizer update applied block by block right after the block's backward,
            then written back.
        offload_inputs: with ``recompute``, the inputs the recompute keeps go to disk
            too and come back for the rerun (``memory.apply``).
    """

    name: str
    activations: Activations = "keep"
    state: State = "resident"
    offload_inputs: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """A whole training step's plan for one device.

    Attributes:
        blocks: one ``BlockPlan`` per block, in forward order.
        num_microbatches: the batch is cut into this many equal micro-batches whose
            gradients are accumulated (1 = the whole batch at once).
        loss_chunks: the loss head computes its logits and loss in this many chunks of
            the token dimension (1 = at once); large vocabularies need it.
        budget_bytes: the memory budget the plan was made for (None: smallest plan).
        disk_budget_bytes: the disk budget it was made for.
        predicted_peak_bytes: predicted peak memory of the run above the import baseline.
        predicted_step_s: predicted time of one step, seconds.
        predicted_disk_bytes: bytes the plan keeps on disk.
        notes: what the planner found worth saying (the peak's event, assumptions,
            refusals, differences from plain training).
        batch_dependent_microbatches: the plan micro-batches a model with
            batch-dependent layers knowingly (planned with ``allow_microbatching=True``):
            their statistics are taken per micro-batch, so it trains a different model
            than whole batches would. ``PlannedTrainer`` refuses micro-batches on such
            a model (in training mode) without it.
    """

    blocks: tuple[BlockPlan, ...]
    num_microbatches: int = 1
    loss_chunks: int = 1
    budget_bytes: int | None = None
    disk_budget_bytes: int | None = None
    predicted_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    predicted_disk_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    batch_dependent_microbatches: bool = False

    @property
    def is_plain(self) -> bool:
        """True when the plan is plain training (nothing recomputed, moved or split)."""
        return (
            self.num_microbatches == 1
            and self.loss_chunks == 1
            and all(
                b.activations == "keep"
                and b.state == "resident"
                and not b.offload_inputs
                for b in self.blocks
            )
        )

    @classmethod
    def plain(cls, names: list[str]) -> MemoryPlan:
        return cls(tuple(BlockPlan(n) for n in names))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MemoryPlan:
        d = dict(d)
        d["blocks"] = tuple(BlockPlan(**b) for b in d["blocks"])
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
