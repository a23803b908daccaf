"""Stop a training step that crosses its memory budget, before the OOM killer does.

``MemoryGuard`` bounds the process's resident set size (``VmRSS``) above a baseline
while training runs: what training may add on top of the process as it stood when the
guard started (or a baseline given explicitly). Two things watch it:

* a daemon background thread samples the RSS every ``interval_s`` seconds, records the
  highest figure (``peak_bytes``) and the model unit running at that moment, and
  records the first crossing of the budget. It never raises into the main thread
  (Python cannot reliably interrupt the main thread inside a C operation);
* ``check()``, called from module hooks in the main thread at unit boundaries, reads
  the RSS once and raises ``BudgetExceededError`` when it is over the budget, or when
  the background thread has already recorded a crossing. Leaving the ``with`` block
  raises a recorded crossing that no ``check()`` has reported yet.

Code elsewhere names the unit now running by setting ``guard.unit`` (for example
``guard.unit = "transformer.h.3"`` from a forward pre-hook), so the error says where
the memory went.

Limits:
    * Sampling can miss a short spike between two samples (allocated and freed within
      ``interval_s``), and the thread samples only when it gets the GIL: during C
      operations that release it (most torch operations do), not during long pure
      Python stretches that hold it.
    * The check at unit boundaries catches such a spike only if the memory is still
      held when the check runs.
    * Raising stops the step only at the next ``check()`` (or at the end of the
      ``with`` block): a single operation that allocates far past the budget can still
      meet the OOM killer first.
    * RSS counts only resident pages: memory reserved but not yet touched, and memory
      swapped out, are not counted.
    * For the true peak of the process afterwards, read ``VmHWM``
      (``memory.measure.peak_rss_bytes()``), which the kernel keeps exactly.

Example:
    >>> with MemoryGuard(512 * 2**20) as guard:  # doctest: +SKIP
    ...     guard.unit = "transformer.h.3"
    ...     out = block(x)
    ...     guard.check()
    >>> guard.peak_bytes, guard.peak_unit  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from types import TracebackType

from memory.errors import BudgetExceededError, MemoryPlanError
from memory.measure import rss_bytes
from memory.sizes import format_bytes

_JOIN_TIMEOUT_S = 2.0
"""Longest wait for the sampling thread to end when the guard stops, seconds."""


class MemoryGuard:
    """Watch the resident memory above a baseline and stop a step that crosses a budget.

    A context manager: entering starts the guard (reads the baseline, starts the
    sampling thread), leaving stops it. The same guard can be started and stopped
    again; each start resets the peak and any recorded crossing, and reads a new
    baseline unless one was given.

    Args:
        budget_bytes: what training may add above the baseline, bytes; None gives a
            disabled guard (see ``disabled()``).
        baseline_bytes: the RSS that counts as zero, bytes; default: the RSS when the
            guard starts.
        interval_s: the sampling period of the background thread, seconds.
        margin_bytes: slack allowed above the budget before the guard trips (for the
            noise of RSS: allocator caches, the interpreter), bytes; the guard raises
            when the RSS above the baseline exceeds ``budget_bytes + margin_bytes``.

    Attributes:
        unit: the name of the model unit now running ("" when none); set by the
            caller, read by the guard when it records a peak or a crossing.
        peak_bytes: the highest RSS above the baseline seen since the guard started
            (by the thread or by ``check()``), bytes; 0 before any sample.
        peak_unit: the unit running when ``peak_bytes`` was seen, or None.

    Raises:
        MemoryPlanError: a negative budget or margin.
        ValueError: ``interval_s`` not positive.
    """

    def __init__(
        self,
        budget_bytes: int | None,
        *,
        baseline_bytes: int | None = None,
        interval_s: float = 0.005,
        margin_bytes: int = 0,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise MemoryPlanError(
                f"memory guard budget {budget_bytes} is negative; use a number of "
                "bytes >= 0, or None for no guard"
            )
        if margin_bytes < 0:
            raise MemoryPlanError(
                f"memory guard margin {margin_bytes} is negative; use bytes >= 0"
            )
        if not interval_s > 0:
            raise ValueError(
                f"memory guard interval_s must be positive, got {interval_s!r}"
            )
        self.budget_bytes = budget_bytes
        self.margin_bytes = margin_bytes
        self.interval_s = interval_s
        self._given_baseline = baseline_bytes
        self.baseline_bytes: int | None = baseline_bytes
        self.unit: str = ""
        self.peak_bytes: int = 0
        self.peak_unit: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        # The first crossing since the start: (bytes above baseline, unit).
        self._crossing: tuple[int, str] | None = None
        self._reported = False

    @classmethod
    def disabled(cls) -> MemoryGuard:
        """A guard that watches nothing: same interface, ``check()`` does nothing."""
        return cls(None)

    @property
    def enabled(self) -> bool:
        """Whether the guard has a budget (a disabled guard never raises)."""
        return self.budget_bytes is not None

    @property
    def running(self) -> bool:
        """Whether the guard has been started and not stopped."""
        return self._running

    @property
    def crossed(self) -> bool:
        """Whether a crossing of the budget was recorded since the guard started."""
        with self._lock:
            return self._crossing is not None

    def start(self) -> None:
        """Read the baseline and start the sampling thread.

        Raises:
            RuntimeError: the guard is already running.
            MeasurementError: the RSS cannot be read (not a Linux process).
        """
        if self._running:
            raise RuntimeError("this MemoryGuard is already running; stop it first")
        with self._lock:
            self.peak_bytes = 0
            self.peak_unit = None
            self._crossing = None
            self._reported = False
        if not self.enabled:
            self._running = True
            return
        self.baseline_bytes = (
            rss_bytes() if self._given_baseline is None else self._given_baseline
        )
        self._sample()  # in this thread, so that an unreadable RSS raises here
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch, name="fleetfit-memory-guard", daemon=True
        )
        self._running = True
        self._thread.start()

    def stop(self) -> None:
        """Stop the sampling thread (waits for it briefly); raises nothing.

        A crossing recorded and not yet reported stays recorded (``crossed``); the
        ``with`` block raises it, ``stop()`` does not.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_JOIN_TIMEOUT_S)
        self._running = False

    def check(self) -> None:
        """Read the RSS once and raise if the budget is crossed, now or earlier.

        Cheap enough to call from module hooks. Does nothing when the guard is
        disabled or not running.

        Raises:
            BudgetExceededError: the RSS above the baseline is over the budget now
                (the error names the unit now running), or the background thread
                recorded a crossing that no check has reported yet (the error names
                the figure and unit it recorded).
        """
        if not self._running or self.budget_bytes is None:
            return
        used = self._sample()
        unit = self.unit
        with self._lock:
            crossing = None if self._reported else self._crossing
            if used > self._limit() or crossing is not None:
                self._reported = True
        if used > self._limit():
            raise self._error(used, unit)
        if crossing is not None:
            raise self._error(*crossing)

    def _limit(self) -> int:
        assert self.budget_bytes is not None
        return self.budget_bytes + self.margin_bytes

    def _sample(self) -> int:
        """One RSS reading above the baseline; updates the peak and the crossing."""
        assert self.baseline_bytes is not None
        used = rss_bytes() - self.baseline_bytes
        unit = self.unit
        with self._lock:
            if used > self.peak_bytes or self.peak_unit is None:
                self.peak_bytes = max(used, self.peak_bytes)
                self.peak_unit = unit
            if self._crossing is None and used > self._limit():
                self._crossing = (used, unit)
        return used

    def _watch(self) -> None:
        # Never raises: whatever goes wrong only ends the sampling; check() in the
        # main thread still reads the RSS itself.
        try:
            while not self._stop.wait(self.interval_s):
                self._sample()
        except Exception:  # a failed sample must not kill training
            return

    def _error(self, used: int, unit: str) -> BudgetExceededError:
        assert self.budget_bytes is not None
        where = f"while running unit {unit!r}" if unit else "outside any named unit"
        margin = (
            f" (plus a margin of {format_bytes(self.margin_bytes)})"
            if self.margin_bytes
            else ""
        )
        return BudgetExceededError(
            f"training used {format_bytes(used)} above its baseline {where}, over "
            f"the memory budget of {format_bytes(self.budget_bytes)}{margin}; plan "
            "for a smaller budget or free memory",
            measured_bytes=used,
            budget_bytes=self.budget_bytes,
            unit=unit,
        )

    def __enter__(self) -> MemoryGuard:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc_type is not None or self.budget_bytes is None:
            return
        with self._lock:
            crossing = None if self._reported else self._crossing
            self._reported = True
        if crossing is not None:
            raise self._error(*crossing)

    def __repr__(self) -> str:
        budget = "disabled" if self.budget_bytes is None else str(self.budget_bytes)
        return (
            f"MemoryGuard(budget_bytes={budget}, running={self._running}, "
            f"peak_bytes={self.peak_bytes}, peak_unit={self.peak_unit!r})"
        )
