"""A node's own whole-model plan, for a train instruction that carries none.

fleetfit's server sends every node its plan (``server.assign``). An ordinary Flower
strategy (Flower's ``FedAvg``: ``arrays`` and a ``config`` of the user's keys, such as
``lr``, plus ``server-round``) sends none, and aggregates only replies that carry the
whole model's keys. So the node plans for itself with the same memory library the
server uses (``memory.plan`` through ``memory.unit_profile.plan_units``), for its own
budget minus the runtime reserve (fixed process costs the memory model does not hold,
as the server does; ``runtime-reserve`` in the run config, else ``wire.shape.RUNTIME_RESERVE``):

- a budget that holds plain training trains plainly, as before (no plan);
- a smaller one trains the whole model under the fastest plan that fits (recompute,
  offload, streaming, micro-batches);
- a budget that holds no whole-model plan is refused (``NoWholeModelPlan``, which the
  ClientApp turns into an error reply, a failure to Flower's strategies) naming the
  budget and the smallest that fits: a ``part`` window would reply with fewer keys,
  which an ordinary strategy cannot aggregate.

Example::

    plan = own_plan(workload, node, reserve_bytes=reserve_bytes(context.run_config))
    # None: plain training; else a MemoryPlan for train_assigned
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from client.config import NodeConfig
from memory.cost import predict
from memory.errors import BudgetError
from memory.proximal import anchored
from memory.sizes import format_bytes, parse_bytes
from memory.spec import MemoryPlan
from memory.unit_profile import plan_units
from wire.flat import flat_keys
from wire.shape import RUNTIME_RESERVE, RUNTIME_RESERVE_KEY, RunShape
from wire.windows import workload_profiles
from workloads import Workload

log = logging.getLogger(__name__)

FLEETFIT_MARKERS = ("kind", "plan")
"""Instruction keys fleetfit's server always sends (``TrainInstruction.to_config``
writes every field): a config with neither comes from another strategy."""


class NoWholeModelPlan(ValueError):
    """The node's budget holds no plan for the whole model (an ordinary strategy
    cannot take a part)."""

    def __init__(self, message: str, *, budget_bytes: int, min_budget_bytes: int):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


def is_stock_instruction(config: Mapping[str, Any]) -> bool:
    """Whether a train ``config`` comes from a strategy other than fleetfit's."""
    return not any(k in config for k in FLEETFIT_MARKERS)


def stock_config(
    config: Mapping[str, Any], run_config: Mapping[str, Any]
) -> dict[str, Any]:
    """A stock strategy's ``config`` with the run's shape (``workload``,
    ``local-steps``, ...) taken from the run config where the strategy sent none:
    Flower's FedAvg forwards only the keys its ServerApp gives it."""
    shape = {k: run_config[k] for k in flat_keys(RunShape) if k in run_config}
    return {**shape, **config}


def reserve_bytes(run_config: Mapping[str, Any]) -> int:
    """The runtime reserve: the run config's ``runtime-reserve``, else the default."""
    value = run_config.get(RUNTIME_RESERVE_KEY, RUNTIME_RESERVE)
    return parse_bytes(value, what=RUNTIME_RESERVE_KEY, allow_zero=True)


def own_plan(
    workload: Workload,
    node: NodeConfig,
    *,
    reserve_bytes: int,
    proximal_mu: float = 0.0,
) -> MemoryPlan | None:
    """The fastest whole-model plan for the node's budget (None: plain training);
    ``proximal_mu`` > 0: priced with FedProx's anchor (``memory.proximal.anchored``).

    Raises:
        NoWholeModelPlan: no whole-model plan fits; the message names the budget,
            where it came from, and the smallest budget that fits.
    """
    budget, disk = node.budget_bytes, node.disk_budget_bytes
    profiles = {
        c: anchored(p, proximal_mu) for c, p in workload_profiles(workload).items()
    }
    usable = budget - reserve_bytes
    # plain first: the planner's times tie (FLOPs, not measured), so its "fastest"
    # can be a recompute plan where plain training fits
    profile = profiles[1]
    if (
        predict(profile, MemoryPlan.plain([b.name for b in profile.blocks])).peak_bytes
        <= usable
    ):
        return None
    try:  # a budget under the reserve leaves nothing: 1 byte fails with the minimum
        plan, _ = plan_units(
            profiles,
            max(1, usable),
            disk_budget_bytes=disk,
            offload_dir=node.offload_dir,
        )
    except BudgetError as e:
        need = (e.min_budget_bytes or 0) + reserve_bytes
        raise NoWholeModelPlan(
            f"{_budget_name(node)} {format_bytes(budget)} ({budget} bytes) holds no "
            f"whole-model plan for {workload.name} with a disk budget of "
            f"{format_bytes(disk)}; the smallest that fits is {format_bytes(need)} "
            f"({need} bytes, with the {format_bytes(reserve_bytes)} runtime reserve); "
            "give this node that much memory-budget, or run fleetfit's ServerApp, "
            "which gives nodes this small a part of the model",
            budget_bytes=budget,
            min_budget_bytes=need,
        ) from None
    log.info(
        "no plan in the train instruction (an ordinary strategy): the whole model "
        "trains under this node's own plan for %s %s: %s",
        _budget_name(node),
        format_bytes(budget),
        describe(plan),
    )
    return plan


def describe(plan: MemoryPlan) -> str:
    """A plan in words: what each block does, micro-batches, predicted peak."""
    moved = [
        f"{b.name}:{b.activations}" + ("+stream" if b.state == "stream" else "")
        for b in plan.blocks
        if b.activations != "keep" or b.state != "resident"
    ]
    return (
        f"{', '.join(moved) or 'every block keeps its activations'}; "
        f"{plan.num_microbatches} micro-batch(es), {plan.loss_chunks} loss chunk(s); "
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)}"
    )


def _budget_name(node: NodeConfig) -> str:
    return {
        "node-config": "memory-budget",
        "fleet": "fleet-memory-budgets entry",
    }.get(node.budget_source, "measured memory budget")


__all__ = [
    "FLEETFIT_MARKERS",
    "NoWholeModelPlan",
    "describe",
    "is_stock_instruction",
    "own_plan",
    "reserve_bytes",
    "stock_config",
]
