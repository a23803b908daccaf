"""Partition plans as plain data: which devices run which blocks, with what memory
plan and schedule (``PartitionPlan``), what the planner may choose
(``PlannerConfig``), and the error for a cluster too small (``PartitionError``).

A plan is printable (``table()``), JSON (``to_dict`` / ``from_dict``) and checkable
without processes (``partition.schedule.validate``); ``partition.planner`` makes one,
``partition.runtime`` runs one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from memory.sizes import format_bytes
from memory.spec import MemoryPlan
from partition.pipeline import SCHEDULES
from partition.schedule import Action, Schedule, compile_plan


class PartitionError(ValueError):
    """No plan fits the cluster.

    Attributes:
        min_memory_bytes: the smallest per-device memory with which the model would
            fit on this many devices (every device given that much).
    """

    def __init__(self, message: str, *, min_memory_bytes: int | None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner may choose.

    Attributes:
        schedules: schedules to consider (names from ``partition.pipeline.SCHEDULES``).
        max_microbatches: the most micro-batches per replica step.
        max_stages_per_rank: the most stages per rank for interleaved schedules.
        replicas: allow data-parallel replicas of the pipeline.
        recompute: allow recomputing blocks' activations to fit memory.
        disk_budget_bytes: disk a one-device plan may use (offload, streaming); 0
            forbids it. Pipelined stages keep state resident.
        max_orders: device orders to try (distinct permutations, then heuristics).
        candidates: boundary sets per setting checked in the simulator.
        action_overhead_s: seconds of runtime work per stage action (forward or
            backward of one micro-batch) at the profile's rate, beyond the blocks'
            own time: the pipelining runtime's bookkeeping, posting sends and
            receives; scaled by each device's speed like the blocks.
        update_s_per_byte: seconds of optimizer update per byte of trainable
            parameters at the profile's rate (0: not modelled); scaled by each
            device's speed. Each rank steps its own stages after its last action.
        sends: how the simulator moves tensors between ranks
            (``partition.simulate.SENDS``): ``"eager"`` (default) or
            ``"rendezvous"``, as gloo moves them under torch's schedules.
    """

    schedules: tuple[str, ...] = SCHEDULES
    max_microbatches: int = 16
    max_stages_per_rank: int = 2
    replicas: bool = True
    recompute: bool = True
    disk_budget_bytes: int = 0
    max_orders: int = 24
    candidates: int = 3
    action_overhead_s: float = 0.0
    update_s_per_byte: float = 0.0
    sends: str = "eager"


@dataclass(frozen=True)
class StagePlan:
    """One stage of the plan.

    Attributes:
        stage_index: position in the pipeline.
        rank: the pipeline rank that runs it (stage_index % ranks).
        devices: the devices running it, one per replica.
        blocks: the module names it owns, in order.
        memory: its memory plan (one ``BlockPlan`` per block).
        peak_bytes: predicted peak on its device (its rank's other stages included
            for interleaved schedules).
        memory_bytes: the smallest memory among its devices.
        forward_s: seconds per micro-batch forward on its slowest device.
        backward_s: seconds per micro-batch backward (recompute included).
    """

    stage_index: int
    rank: int
    devices: tuple[str, ...]
    blocks: tuple[str, ...]
    memory: MemoryPlan
    peak_bytes: int
    memory_bytes: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class PartitionPlan:
    """A training step cut across devices, as data.

    Attributes:
        schedule_name: ``GPipe``, ``1F1B``, ``Interleaved1F1B``,
            ``InterleavedZeroBubble``, or ``local`` for the one-device plan.
        num_microbatches: micro-batches per replica step.
        num_ranks: pipeline ranks per replica.
        stages_per_rank: stages on each rank.
        num_replicas: data-parallel replicas (gradients averaged after the step).
        batch_size: examples per step, all replicas together.
        stages: the stages.
        schedule: per-rank actions of one replica.
        predicted_step_s: predicted seconds per step.
        predicted_bubble: idle share of device time in the pipeline.
        allreduce_s: of the step, seconds of data-parallel gradient reduction.
        cluster: the cluster's name.
        notes: what else the planner found worth saying.
    """

    schedule_name: str
    num_microbatches: int
    num_ranks: int
    stages_per_rank: int
    num_replicas: int
    batch_size: int
    stages: tuple[StagePlan, ...]
    schedule: Schedule = field(repr=False)
    predicted_step_s: float
    predicted_bubble: float
    allreduce_s: float = 0.0
    cluster: str = ""
    notes: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def throughput(self) -> float:
        """Examples per second."""
        return self.batch_size / self.predicted_step_s

    def stage_modules(self) -> list[list[str]]:
        """Each stage's module names (torchtitan's form)."""
        return [list(s.blocks) for s in self.stages]

    def table(self) -> str:
        """The plan for people: one row per stage, then the schedule's summary."""
        head = (
            f"{'stage':>5} {'rank':>4}  {'devices':<18}{'blocks':<24}"
            f"{'recompute':>9}{'peak':>12}{'memory':>12}{'fwd ms':>9}{'bwd ms':>9}"
        )
        rows = [head]
        for s in self.stages:
            names = (
                f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0]
            )
            rec = sum(b.activations != "keep" for b in s.memory.blocks)
            rows.append(
                f"{s.stage_index:>5} {s.rank:>4}  {','.join(s.devices):<18}"
                f"{names:<24}{rec:>9}{format_bytes(s.peak_bytes):>12}"
                f"{format_bytes(s.memory_bytes):>12}{s.forward_s * 1e3:>9.1f}"
                f"{s.backward_s * 1e3:>9.1f}"
            )
        rows.append(
            f"schedule {self.schedule_name}, {self.num_stages} stage(s) on "
            f"{self.num_ranks} rank(s) x {self.num_replicas} replica(s), "
            f"{self.num_microbatches} micro-batch(es) of "
            f"{self.batch_size // (self.num_replicas * self.num_microbatches)}"
        )
        rows.append(
            f"predicted step {self.predicted_step_s:.4f} s "
            f"({self.throughput:.2f} examples/s), bubble {self.predicted_bubble:.1%}"
            + (f", all-reduce {self.allreduce_s:.4f} s" if self.allreduce_s else "")
        )
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schedule"] = {
            "ranks": [[str(a) for a in acts] for acts in self.schedule.ranks],
            "stage_ranks": list(self.schedule.stage_ranks),
        }
        d["stages"] = [dict(asdict(s), memory=s.memory.to_dict()) for s in self.stages]
        d["num_stages"] = self.num_stages
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> PartitionPlan:
        d = dict(d)
        d.pop("num_stages", None)
        stages = tuple(
            StagePlan(
                **{
                    **s,
                    "devices": tuple(s["devices"]),
                    "blocks": tuple(s["blocks"]),
                    "memory": MemoryPlan.from_dict(s["memory"]),
                }
            )
            for s in d["stages"]
        )
        sd = d["schedule"]
        ranks = [[Action.parse(t) for t in acts] for acts in sd["ranks"]]
        names = tuple(b for s in stages for b in s.blocks)
        if d["schedule_name"] == "local":
            sched = compile_plan(stages[0].memory)
        else:
            idx = _stage_block_indices(stages)
            sched = Schedule(
                ranks=ranks,
                num_blocks=len(names),
                num_microbatches=d["num_microbatches"],
                names=names,
                num_stages=len(stages),
                stage_ranks=tuple(sd["stage_ranks"]),
                stage_blocks=idx,
                schedule_name=d["schedule_name"],
            )
        d["stages"] = stages
        d["schedule"] = sched
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def _stage_block_indices(stages: tuple[StagePlan, ...]) -> tuple[tuple[int, ...], ...]:
    out, i = [], 0
    for s in stages:
        out.append(tuple(range(i, i + len(s.blocks))))
        i += len(s.blocks)
    return tuple(out)
