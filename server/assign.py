"""What each node trains in a round, from the memory model (``memory.plan``).

For a node with memory budget B and disk budget D, the plan is made for
``B - runtime_reserve_bytes``: the planner models a training step (state, activations,
workspace), while a process also pays fixed costs the model does not hold (torch's
first backward and convolution set-up, allocator state: 55-90 MiB measured on this
machine for digits-cnn and gpt-byte, see docs/federation.md).

- ``full``: the fastest whole-model plan that fits (``plan_memory``: recompute,
  offload, streaming and micro-batching as needed).
- ``part``: otherwise, successive layer training: a window of blocks ``[start, stop)``
  plus the head (the last block) is trained; blocks before the window are frozen and
  run without storing activations; blocks between the window and the head are frozen
  but run forward and backward (no gradients, no optimizer state). The widest window
  that fits is chosen; among its positions the one for this round comes first, so the
  window moves through the model over rounds (position ``(round - 1) mod positions``),
  and other positions are tried when that one does not fit. The head always trains; a
  tied parameter (GPT-2's head projection is its token embedding) belongs to the first
  block using it and trains only when that block is in the window.
- ``adapter`` (run config ``adapters = auto | all``): LoRA adapters (``memory.lora``)
  on the linear modules of blocks ``[start, last)`` of a frozen base; ``start`` is
  the lowest block that fits (the most blocks adapted). Priced by
  ``adapter_profile``: the frozen base holds its parameters only (in bfloat16 with
  ``lora-base-dtype``), the adapters their parameters, gradients and AdamW state,
  and every block from ``start`` up still keeps (or recomputes) its activations for
  the backward. ``auto``: a node that no whole-model plan fits gets an adapter before
  a ``part`` window; ``all``: every node gets one. A node whose facts say it cannot
  train adapters (``NodeFacts.adapters`` False: no peft) is assigned as with ``off``.
- ``none``: not even the head alone fits: the node is told so, with the smallest budget
  that would get it a part.

With ``strategy="exclude"`` (the status quo, for comparisons) a node gets ``full``
plain training when the plain step's predicted peak plus the reserve fits its budget,
and ``none`` otherwise: no plan, no part.

An ``any_model`` workload (a transformers model, dict inputs, the model's own loss) is assigned the same way over its units
(``memory.units.find_units``, in execution order; the last is the head), profiled
with ``memory.unit_profile.unit_profiles`` (one profile per loss chunk count its head
allows) and planned with ``plan_units``.

Time: with the node's measured compute rate, the plan's predicted step time is scaled
to the node; a node whose ``local_steps`` would not fit in ``train_time_s`` gets fewer
steps (at least one) instead of being dropped.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from torch import nn

from memory.cost import CHAIN_OPTIONS, STREAM, predict
from memory.errors import BudgetError
from memory.lora import (
    LoraSpec,
    frozen_base_bytes,
    int8_linears,
    linear_shape,
    target_paths,
)
from memory.plan import min_budget_bytes
from memory.profile import Profile
from memory.proximal import anchored
from memory.spec import MemoryPlan
from memory.unit_profile import plan_units
from wire.facts import NodeFacts
from wire.windows import model_blocks, trained_keys, workload_profiles
from workloads import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """One node's work in one round."""

    kind: str  # full | part | adapter | none
    budget_bytes: int | None  # None: the node did not say (a plain Flower client)
    disk_budget_bytes: int | None
    plan: MemoryPlan | None  # the trained chain's plan (None: plain training)
    window: tuple[int, int] | None  # part: trained blocks [start, stop) plus the head
    local_steps: int
    predicted_peak_bytes: int = 0  # the plan's peak plus the runtime reserve
    predicted_step_s: float = 0.0  # on this node
    min_budget_bytes: int = 0  # none: smallest budget that gets a part
    reason: str = ""
    # heterofl / fedrolex (server.submodel): the sub-model's width ratio (None: the
    # model itself), its window offset in units of every hidden axis, its workload
    width: float | None = None
    roll: int = 0
    workload: str = ""  # "": the run's
    adapters: LoraSpec | None = None  # adapter: what trains (its start block)

    def describe(self) -> str:
        if self.kind == "part" and self.window is not None:
            return f"part [{self.window[0]}, {self.window[1]}) + head"
        if self.kind == "adapter" and self.adapters is not None:
            a = self.adapters
            return f"adapter rank {a.rank} from block {a.start} ({a.base_dtype} base)"
        if self.width is not None:
            return f"{self.kind} at width {self.width:g}"
        return self.kind


class Assigner:
    """Assignments for one workload; profiles once, caches what it can."""

    def __init__(
        self,
        workload: Workload,
        model: nn.Module,
        *,
        local_steps: int,
        runtime_reserve_bytes: int,
        train_time_s: float,
        strategy: str = "fleetfit",
        proximal_mu: float = 0.0,
        adapters: str = "off",
        lora: LoraSpec | None = None,
    ) -> None:
        if strategy not in ("fleetfit", "exclude"):
            raise ValueError(f"strategy {strategy!r}: choose fleetfit or exclude")
        if adapters not in ("off", "auto", "all"):
            raise ValueError(f"adapters {adapters!r}: choose off, auto or all")
        self.adapters = adapters
        self.lora = lora or LoraSpec(rank=8, alpha=16.0)
        self._adapter_cache: dict[int, dict[int, Profile]] = {}
        self._paths: list[list[str]] | None = None
        self.strategy = strategy
        self.workload = workload
        self.per_unit = workload.any_model
        self.model = model
        self.blocks = model_blocks(workload, model)
        self.names = [b.name for b in self.blocks]
        self.local_steps = local_steps
        self.reserve = runtime_reserve_bytes
        self.train_time_s = train_time_s
        self.proximal_mu = proximal_mu  # > 0: plans hold FedProx's anchor, no streaming
        self._profiles: dict[int, Profile] | None = None  # as measured
        self._trained: dict[int, Profile] | None = None  # as priced (``profiles``)
        self._plain: MemoryPlan | None = None
        self._min: dict[tuple[int, int, int], int] = {}
        self._parts: dict[tuple[int, int], dict[int, Profile]] = {}

    @property
    def profiles(self) -> dict[int, Profile]:
        """The whole model's profiles by loss chunk count (``{1: ...}`` for a chain),
        as trained: with FedProx's anchor where ``proximal_mu > 0`` (made once)."""
        if self._trained is None:
            self._trained = {
                c: anchored(p, self.proximal_mu) for c, p in self._measured.items()
            }
        return self._trained

    @property
    def _measured(self) -> dict[int, Profile]:
        if self._profiles is None:
            self._profiles = workload_profiles(self.workload)
        return self._profiles

    @property
    def profile(self) -> Profile:
        """The whole model's profile with its own loss (one chunk)."""
        return self.profiles[1]

    def assign(self, facts: NodeFacts, server_round: int) -> Assignment:
        budget = facts.budget_bytes
        disk = facts.disk_budget_bytes
        if budget is None:  # a client that did not answer fleetfit's query
            return Assignment("full", None, None, None, None, self.local_steps)
        disk = disk or 0
        usable = budget - self.reserve
        if self.strategy == "exclude":
            return self._plain_or_nothing(budget, disk, facts)
        # a node that cannot train adapters (no peft) is assigned as with them off
        adapters = "off" if facts.adapters is False else self.adapters
        if adapters == "all":
            got = self._adapter(budget, disk, facts)
            if got is not None:
                return got
        if usable > 0 and adapters != "all":
            try:
                plan, _ = plan_units(self.profiles, usable, disk_budget_bytes=disk)
            except BudgetError:
                pass
            else:
                return self._timed("full", budget, disk, plan, None, facts)
        if adapters == "auto":
            got = self._adapter(budget, disk, facts)
            if got is not None:
                return got
        n = len(self.names)
        last = n - 1
        smallest: int | None = None
        for width in range(last - 1, -1, -1):
            positions = last - width + 1 if width else 1
            first = (server_round - 1) % positions
            for j in range(positions):
                start = last if width == 0 else (first + j) % positions
                stop = start + width
                if not self._trains_parameters(start, stop):
                    continue  # e.g. a head whose only weight is the embedding's
                need = self._min_budget(start, stop, disk)
                smallest = need if smallest is None else min(smallest, need)
                if need > usable:
                    continue
                part = self._part_profiles(start, stop)
                try:
                    plan, _ = plan_units(part, usable, disk_budget_bytes=disk)
                except BudgetError:
                    continue
                return self._timed("part", budget, disk, plan, (start, stop), facts)
        need = (smallest or 0) + self.reserve
        return _nothing(
            budget,
            disk,
            need,
            f"a memory budget of {budget} bytes cannot train even the head "
            f"(block {self.names[-1]!r}) with a disk budget of {disk} bytes; the "
            f"smallest budget that gets a part is {need} bytes",
        )

    @property
    def plain_plan(self) -> MemoryPlan:
        """Plain training of the whole model, with its predicted peak and time."""
        if self._plain is None:
            plain = MemoryPlan.plain(self.names)
            pred = predict(self.profile, plain)
            self._plain = replace(
                plain,
                predicted_peak_bytes=pred.peak_bytes,
                predicted_step_s=pred.step_s,
            )
        return self._plain

    def plain_need_bytes(self) -> int:
        """The budget a node needs to train the whole model plainly."""
        return self.plain_plan.predicted_peak_bytes + self.reserve

    def _plain_or_nothing(self, budget: int, disk: int, facts: NodeFacts) -> Assignment:
        need = self.plain_need_bytes()
        if need <= budget:
            return self._timed("full", budget, disk, self.plain_plan, None, facts)
        return _nothing(
            budget,
            disk,
            need,
            f"excluded: the plain training step needs {need} bytes, more than the "
            f"memory budget of {budget} bytes",
        )

    def _timed(
        self,
        kind: str,
        budget: int,
        disk: int,
        plan: MemoryPlan,
        window: tuple[int, int] | None,
        facts: NodeFacts,
    ) -> Assignment:
        step_s = plan.predicted_step_s
        rate = facts.flops_per_s
        if rate is not None and self.profile.flops_per_s:
            step_s *= self.profile.flops_per_s / float(rate)
        steps = self.local_steps
        if step_s > 0 and steps * step_s > self.train_time_s:
            steps = max(1, math.floor(self.train_time_s / step_s))
        return Assignment(
            kind,
            budget,
            disk,
            plan,
            window,
            steps,
            predicted_peak_bytes=plan.predicted_peak_bytes + self.reserve,
            predicted_step_s=step_s,
        )

    @property
    def adapter_paths(self) -> list[list[str]]:
        """Per block, the modules that carry adapters when every block before the
        head does (``memory.lora.target_paths`` from block 0)."""
        if self._paths is None:
            self._paths = target_paths(
                self.model, self.blocks, replace(self.lora, start=0)
            )
        return self._paths

    def adapter_starts(self) -> list[int]:
        """The blocks an adapter assignment may start at, lowest first."""
        return [i for i, paths in enumerate(self.adapter_paths) if paths]

    def adapter_profiles(self, start: int) -> dict[int, Profile]:
        """The profiles of an adapter assignment from block ``start``."""
        if start not in self._adapter_cache:
            numels, saved = self._adapter_sizes()
            held, transient = self._base_sizes()
            self._adapter_cache[start] = {
                c: anchored(
                    adapter_profile(
                        p,
                        start,
                        numels,
                        lora_saved_bytes=saved,
                        base_bytes_per_param=2
                        if self.lora.base_dtype == "bfloat16"
                        else 4,
                        base_bytes=held,
                        dequant_bytes=transient,
                    ),
                    self.proximal_mu,
                )
                for c, p in self._measured.items()
            }
        return self._adapter_cache[start]

    def adapter_min_budget(self, disk: int = 0) -> int:
        """The smallest budget (reserve included) that trains any adapter, over
        every start block (in memory the highest start is the cheapest; with a disk
        to stream the frozen base from, a lower one can be: the frozen prefix is
        held, the chain's base may stream)."""
        return self.reserve + min(
            min_budget_bytes(p, disk_budget_bytes=disk)
            for start in self.adapter_starts()
            for p in self.adapter_profiles(start).values()
        )

    def _adapter_sizes(self) -> tuple[list[int], list[int]]:
        """Per block, the adapters' parameter count and the bytes their forward
        saves beyond the base's (``A x``: tokens x rank floats per module)."""
        modules = dict(self.model.named_modules())
        r = self.lora.rank
        numels, saved = [], []
        prof = self._measured[1]
        for i, paths in enumerate(self.adapter_paths):
            shapes = [linear_shape(modules[p]) for p in paths]
            numels.append(sum(r * (n_in + n_out) for n_in, n_out in shapes))
            tokens = prof.blocks[i].input_bytes // (4 * shapes[0][0]) if shapes else 0
            saved.append(4 * tokens * r * len(shapes))
        return numels, saved

    def _base_sizes(self) -> tuple[list[int], list[int]]:
        """Per block, the bytes its own frozen parameters hold in the adapters'
        base dtype and the transient bytes of its int8 layers
        (``memory.lora.frozen_base_bytes``; a tied parameter counts in the block
        that uses it first, as in the profile)."""
        dtype = self.lora.base_dtype
        int8 = (
            {id(self.model.get_submodule(p)) for p in int8_linears(self.model)}
            if dtype == "int8"
            else set()
        )
        seen: set[int] = set()
        held, transient = [], []
        for b in self.blocks:
            own = [p for p in b.module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            h, t = frozen_base_bytes(b.module, dtype, int8, only={id(p) for p in own})
            held.append(h)
            transient.append(t)
        return held, transient

    def _adapter(self, budget: int, disk: int, facts: NodeFacts) -> Assignment | None:
        """The adapter assignment with the lowest start block that fits."""
        usable = budget - self.reserve
        if usable <= 0:
            return None
        for start in self.adapter_starts():
            try:
                plan, _ = plan_units(
                    self.adapter_profiles(start), usable, disk_budget_bytes=disk
                )
            except BudgetError:
                continue
            a = self._timed("adapter", budget, disk, plan, None, facts)
            return replace(a, adapters=replace(self.lora, start=start))
        return None

    def _min_budget(self, start: int, stop: int, disk: int) -> int:
        key = (start, stop, disk)
        if key not in self._min:
            self._min[key] = min(
                min_budget_bytes(p, disk_budget_bytes=disk)
                for p in self._part_profiles(start, stop).values()
            )
        return self._min[key]

    def _trains_parameters(self, start: int, stop: int) -> bool:
        params = {k for k, _ in self.model.named_parameters(remove_duplicate=False)}
        return bool(params & set(trained_keys(self.model, (start, stop), self.blocks)))

    def _part_profiles(self, start: int, stop: int) -> dict[int, Profile]:
        key = (start, stop)
        if key not in self._parts:
            self._parts[key] = {
                c: anchored(part_profile(p, start, stop), self.proximal_mu)
                for c, p in self._measured.items()
            }
        return self._parts[key]


def _nothing(budget: int, disk: int, need: int, reason: str) -> Assignment:
    """A ``none`` assignment: nothing to train, the budget that would get work."""
    return Assignment(
        "none", budget, disk, None, None, 0, min_budget_bytes=need, reason=reason
    )


def part_profile(profile: Profile, start: int, stop: int) -> Profile:
    """The profile of the chain ``[start, last]`` with only ``[start, stop)`` and the
    head trainable; the frozen prefix's parameters and the chain's input are held
    through the step (added to ``batch_bytes``)."""
    n = len(profile.blocks)
    train = set(range(start, stop)) | {n - 1}
    before = {b.name for b in profile.blocks[:start]}
    blocks = []
    for i in range(start, n):
        b = profile.blocks[i]
        if any(o in before for o in b.shared_with):  # owner frozen in the prefix
            b = replace(b, shared_param_bytes=0, shared_with=())
        if i not in train:
            b = replace(b, grad_bytes=0, optimizer_state_bytes=0)
        blocks.append(b)
    held = sum(b.param_bytes + b.buffer_bytes for b in profile.blocks[:start])
    if start > 0:
        held += profile.blocks[start].costs[1].input_bytes
    return replace(
        profile, blocks=tuple(blocks), batch_bytes=profile.batch_bytes + held
    )


def adapter_profile(
    profile: Profile,
    start: int,
    adapter_numels: list[int],
    *,
    lora_saved_bytes: list[int] | None = None,
    base_bytes_per_param: int = 4,
    base_bytes: list[int] | None = None,
    dequant_bytes: list[int] | None = None,
) -> Profile:
    """The profile of the chain ``[start, last]`` with LoRA adapters on a frozen
    base (``memory.lora``).

    Per block from ``start``: the base's parameters at ``base_bytes_per_param`` bytes
    each (2: bfloat16), no gradient and no optimizer state for them; the adapters'
    ``adapter_numels[i]`` float32 parameters with their gradients and AdamW's two
    moments; the block's activations as profiled (the backward still runs through
    it) plus ``lora_saved_bytes[i]`` (the ``A x`` products kept for ``B``'s
    gradient). The frozen prefix's parameters and the chain's input are held
    through the step (``batch_bytes``), as in ``part_profile``.

    ``base_bytes`` (per block; default: the profile's ``param_bytes`` at
    ``base_bytes_per_param``) is what a block's own frozen parameters hold, and
    ``dequant_bytes`` what its forward and backward add on top (an int8 base's
    dequantized weight, ``memory.lora.frozen_base_bytes``). A block with int8
    layers is never streamed: its int8 weights are buffers, which streaming leaves
    resident.
    """
    n = len(profile.blocks)
    saved = lora_saved_bytes or [0] * n
    extra = dequant_bytes or [0] * n
    before = {b.name for b in profile.blocks[:start]}

    def base(nbytes: int) -> int:
        return nbytes * base_bytes_per_param // 4

    def own(i: int) -> int:
        b = profile.blocks[i]
        return base(b.param_bytes) if base_bytes is None else base_bytes[i]

    blocks = []
    for i in range(start, n):
        b = profile.blocks[i]
        if any(o in before for o in b.shared_with):  # owner frozen in the prefix
            b = replace(b, shared_param_bytes=0, shared_with=())
        numel = adapter_numels[i]
        costs = {
            m: replace(
                c,
                saved_bytes=c.saved_bytes + saved[i] // m,
                forward_peak_bytes=c.forward_peak_bytes + extra[i],
                forward_no_grad_peak_bytes=c.forward_no_grad_peak_bytes + extra[i],
                backward_peak_bytes=c.backward_peak_bytes + extra[i],
            )
            for m, c in b.costs.items()
        }
        if extra[i]:
            b = replace(
                b, options=tuple(o for o in b.options or CHAIN_OPTIONS if o != STREAM)
            )
        blocks.append(
            replace(
                b,
                num_params=b.num_params + numel,
                param_bytes=own(i) + 4 * numel,
                grad_bytes=4 * numel,
                optimizer_state_bytes=8 * numel,
                shared_param_bytes=base(b.shared_param_bytes),
                max_param_tensor_bytes=max(base(b.max_param_tensor_bytes), 0),
                costs=costs,
            )
        )
    held = sum(own(i) + profile.blocks[i].buffer_bytes for i in range(start))
    if start > 0:
        held += profile.blocks[start].costs[1].input_bytes
    return replace(
        profile, blocks=tuple(blocks), batch_bytes=profile.batch_bytes + held
    )
