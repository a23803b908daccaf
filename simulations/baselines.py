"""The sub-model baselines of a comparison: HeteroFL and FedRolex on a fleet.

The server does the work (``server.submodel``: sizing, slicing, aggregation); this
module says before a run what it will do on a fleet: the level every device gets
from its budget by the same memory model, and how many devices no level fits
(excluded, as in ``exclude``). ``compare`` checks it first (a workload that cannot be
cut fails before any simulation) and adds it to the strategy's summary entry as
``sizing``.

Example:
    >>> from simulations.baselines import sizing
    >>> from simulations.fleet import load_fleet
    >>> sizing(load_fleet("phones"), "heterofl")["excluded_devices"]
"""

from __future__ import annotations

import logging
from typing import Any

from memory.sizes import format_bytes
from server.config import ServerConfig
from server.submodel import STRATEGIES, SubmodelAssigner
from simulations.fleet import Fleet
from workloads import get_workload

log = logging.getLogger(__name__)


def assigner(fleet: Fleet, strategy: str) -> SubmodelAssigner:
    """The server's assigner of ``strategy`` for ``fleet``'s workload and shape.

    Raises:
        ValueError: the workload has no width-scaled sub-models.
    """
    assert strategy in STRATEGIES, strategy
    cfg = ServerConfig()
    wl = get_workload(
        fleet.shape.workload,
        batch_size=fleet.shape.batch_size or None,
        seq_len=fleet.shape.seq_len or None,
    )
    return SubmodelAssigner(
        wl,
        strategy=strategy,
        local_steps=fleet.shape.local_steps,
        runtime_reserve_bytes=cfg.reserve_bytes,
        train_time_s=cfg.train_time,
    )


def sizing(fleet: Fleet, strategy: str) -> dict[str, Any]:
    """Every device's level under ``strategy`` (``heterofl`` or ``fedrolex``: both
    size alike), from its budget.

    Returns ``{"levels": [ratio or None per partition], "need_bytes": {ratio:
    bytes}, "excluded_devices": n, "classes": {class: {"1": n, "0.5": n, ...,
    "none": n}}}``.
    """
    a = assigner(fleet, strategy)
    need = {f"{r:g}": a.need_bytes(r) for r in a.levels}
    levels = [a.level_for(b) for b in fleet.budgets]
    classes: dict[str, dict[str, int]] = {}
    for pid, r in enumerate(levels):
        name = fleet.classes[fleet.partition_class[pid]].name
        key = "none" if r is None else f"{r:g}"
        counts = classes.setdefault(name, {})
        counts[key] = counts.get(key, 0) + 1
    excluded = sum(r is None for r in levels)
    log.info(
        "%s on %s: levels %s (plain step needs %s); %d of %d devices excluded",
        strategy,
        fleet.name,
        ", ".join(f"{k}: {n}" for k, n in _totals(levels).items()),
        ", ".join(f"{k}: {format_bytes(v)}" for k, v in need.items()),
        excluded,
        len(levels),
    )
    return {
        "levels": levels,
        "need_bytes": need,
        "excluded_devices": excluded,
        "classes": classes,
    }


def _totals(levels: list[float | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in levels:
        key = "none" if r is None else f"{r:g}"
        out[key] = out.get(key, 0) + 1
    return out
