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
        self,
        message: str,
        *,
        budget_bytes: int,
        min_budget_bytes: int | None,
        dominant: str,
    ) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.dominant = dominant


class MeasurementError(RuntimeError):
    """A measuring child process failed: it raised, crashed or ran too long."""


class OffloadDirError(MemoryPlanError):
    """The offload directory cannot hold what a plan puts on disk.

    Raised before training starts, when the directory is missing and cannot be
    created, is not writable, or has less free space than the plan needs; and
    during a step when a write there fails all the same (the disk filled up).

    Attributes:
        directory: the offload directory.
        bytes_needed: bytes the plan writes there.
        bytes_free: free bytes found there (None when it could not be read).
    """

    def __init__(
        self, message: str, *, directory: str, bytes_needed: int, bytes_free: int | None
    ) -> None:
        super().__init__(message)
        self.directory = directory
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free


class BudgetExceededError(MemoryPlanError):
    """Training crossed its memory budget while a step ran.

    Raised by ``memory.guard.MemoryGuard`` when the process's resident memory above
    its baseline goes over the budget, before the OS's OOM killer ends the process.

    Attributes:
        measured_bytes: resident bytes above the baseline when the crossing was seen.
        budget_bytes: the budget that was crossed.
        unit: the model unit that was running then ("" when none was set).
    """

    def __init__(
        self, message: str, *, measured_bytes: int, budget_bytes: int, unit: str
    ) -> None:
        super().__init__(message)
        self.measured_bytes = measured_bytes
        self.budget_bytes = budget_bytes
        self.unit = unit


class MissingExtraError(ImportError):
    """A feature needs a package that only an extra of fleetfit installs.

    The message is one line naming the package and the extra: "adapters need peft:
    install the hf extra (bash scripts/install hf, or pip install 'fleetfit[hf]')".

    Attributes:
        feature: what needs the package ("adapters").
        package: the missing package's import name ("peft").
        extra: the extra that installs it ("hf").
    """

    def __init__(self, feature: str, package: str, extra: str) -> None:
        super().__init__(
            f"{feature} need {package}: install the {extra} extra (bash "
            f"scripts/install {extra}, or pip install 'fleetfit[{extra}]')",
            name=package,
        )
        self.feature = feature
        self.package = package
        self.extra = extra
