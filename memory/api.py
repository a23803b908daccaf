"""Training one model on one device within a byte budget: plan, then train.

The two calls a user (and the architecture zoo, ``benchmarks/zoo.py``) makes::

    from memory import plan_training, PlannedTrainer

    planned = plan_training(model, inputs, targets, loss_fn, budget_bytes=256 << 20)
    with planned.trainer(settings=TrainSettings(lr=1e-3)) as tr:
        for x, y in batches:
            tr.step(x, y)

``plan_training`` finds the model's units, profiles one step per loss chunk count the
model's head allows and picks the fastest plan within the budget (None: the plan
with the smallest peak); ``TrainingPlan.trainer`` applies it (``PlannedTrainer``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from memory.blocks import Block
    from memory.profile import Profile
    from memory.spec import MemoryPlan
    from memory.step import PlannedTrainer


@dataclass(frozen=True)
class TrainingPlan:
    """A plan for one model and batch, with what it was made from.

    Attributes:
        model: the model planned (``trainer`` trains it in place).
        plan: the ``MemoryPlan`` chosen.
        profile: the per-unit ``Profile`` it was chosen from.
        units: the model's units, in the plan's block order.
        plain_peak_bytes: the predicted peak of plain training of the same batch (one
            loss chunk, nothing recomputed, moved or split), for comparison.
        loss_fn: the loss it was planned with (None: the model's own ``output.loss``;
            a declared ``LogitsCrossEntropy`` with its head found).
    """

    model: nn.Module
    plan: MemoryPlan
    profile: Profile
    units: tuple[Block, ...]
    plain_peak_bytes: int
    loss_fn: Callable | None = None

    def trainer(self, **kwargs: Any) -> PlannedTrainer:
        """A ``memory.step.PlannedTrainer`` that applies this plan (keyword arguments
        go to it: ``settings``, ``offload_dir``, ``memory_budget_bytes``, ...)."""
        from memory.step import PlannedTrainer

        return PlannedTrainer(
            self.model, self.plan, units=self.units, loss_fn=self.loss_fn, **kwargs
        )


DROPOUT_NOTE = (
    "dropout with micro-batches: each micro-batch draws its own masks, not the whole "
    "batch's, so losses and gradients differ from plain training's by that draw (the "
    "same in distribution); a plan without micro-batches replays plain's masks"
)
"""The note of a plan that micro-batches a model with active dropout."""


def has_dropout(model: nn.Module) -> bool:
    """True when some module in training mode drops activations: a dropout layer
    with ``p > 0``, or a ``MultiheadAttention`` with attention dropout."""
    for m in model.modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            return True
    return False


def plan_training(
    model: nn.Module,
    inputs: Any,
    targets: Any = None,
    loss_fn: Callable | None = None,
    *,
    budget_bytes: int | None = None,
    runtime_bytes: int = 0,
    **plan_kwargs: Any,
) -> TrainingPlan:
    """The fastest plan that trains ``model`` on this batch within ``budget_bytes``.

    Args:
        model: any module (called as ``memory.units.call_model`` describes).
        inputs, targets, loss_fn: one batch and its loss (``loss_fn(output,
            targets)``; None: the model's own ``output.loss``, from ``labels`` in
            ``inputs``). Loss chunks are offered for the model's own loss and for a
            declared ``memory.LogitsCrossEntropy`` (its head found here), where
            ``memory.head`` checks that the chunked loss is that loss.
        budget_bytes: the peak above the process's baseline the step may reach; None
            plans the smallest peak.
        runtime_bytes: the runtime's own first-step cost to add to every prediction
            (``memory.overhead``; 0: predictions of the step's tensors only).
        plan_kwargs: ``disk_budget_bytes``, ``offload_dir``, ``allow_microbatching``,
            ``max_microbatches`` (``memory.plan.plan_memory``).

    The plan's notes state where it trains differently from plain training by
    design: micro-batches on a model with batch-dependent layers (only with
    ``allow_microbatching=True``) or with dropout (other masks are drawn).

    Raises:
        BudgetError: no plan fits; it names the smallest budget that would.
        MemoryPlanError: the model or batch cannot be planned (one line, the reason).
    """
    from memory.cost import predict
    from memory.declared_loss import LogitsCrossEntropy
    from memory.head import declared_head
    from memory.spec import MemoryPlan
    from memory.unit_profile import plan_units, unit_profiles
    from memory.units import find_units

    if isinstance(loss_fn, LogitsCrossEntropy) and loss_fn.head is None:
        head, _ = declared_head(model, inputs, loss_fn)  # None: no chunks offered
        loss_fn = loss_fn if head is None else loss_fn.with_head(head)
    units = tuple(find_units(model, inputs))
    profiles = unit_profiles(
        model, inputs, targets, loss_fn, runtime_bytes=runtime_bytes, units=units
    )
    plan, profile = plan_units(profiles, budget_bytes, **plan_kwargs)
    if plan.num_microbatches > 1 and has_dropout(model):
        plan = dataclasses.replace(plan, notes=(*plan.notes, DROPOUT_NOTE))
    plain = predict(profiles[1], MemoryPlan.plain([u.name for u in units]))
    return TrainingPlan(
        model=model,
        plan=plan,
        profile=profile,
        units=units,
        plain_peak_bytes=plain.peak_bytes,
        loss_fn=loss_fn,
    )
