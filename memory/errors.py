"""The exceptions of ``memory``."""

from __future__ import annotations


class MemoryPlanError(ValueError):
    """Invalid memory input: a size, a budget, a directory."""


class BudgetError(MemoryPlanError):
    """No plan fits the budget.

    Attributes:
        budget_bytes: the budget that was asked for.
        min_budget_bytes: the smallest budget that would fit, or None if none would.
        dominant: what dominates the smallest plan's peak, in words.
    """

    def __init__(
        self, message: str, *, budget_bytes: int, min_budget_bytes: int | None, dominant: str
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.dominant = dominant


class MeasurementError(RuntimeError):
    """A measuring child process failed: it raised, crashed or ran too long."""
