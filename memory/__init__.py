"""What a training step costs, plans that fit a byte budget, and the mechanisms and
measurements those plans use. A pure library: torch and numpy only.

Training one model on one device: ``plan_training`` (``memory.api``), then
``TrainingPlan.trainer`` (a ``PlannedTrainer``)."""

from typing import Any

from memory.blocks import as_blocks
from memory.errors import BudgetError, MemoryPlanError
from memory.sizes import format_bytes, parse_bytes

__all__ = [
    "BudgetError",
    "LogitsCrossEntropy",
    "MemoryPlanError",
    "PlannedTrainer",
    "TrainSettings",
    "TrainingPlan",
    "as_blocks",
    "format_bytes",
    "parse_bytes",
    "plan_training",
]

_LAZY = {
    "LogitsCrossEntropy": "memory.declared_loss",
    "plan_training": "memory.api",
    "TrainingPlan": "memory.api",
    "PlannedTrainer": "memory.step",
    "TrainSettings": "memory.step",
}


def __getattr__(name: str) -> Any:  # the trainer's imports only where it is used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'memory' has no attribute {name!r}")
