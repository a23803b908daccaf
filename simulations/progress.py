"""A progress bar for a simulation: one step per federated round.

The federation writes its run folder's ``summary.json`` after every round (atomically);
``RoundProgress`` follows that file from a background thread, so it needs nothing from
Flower's engine and works the same however the rounds are run. On a terminal the bar
redraws in place; elsewhere (logs, CI) it prints one line per round.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


class RoundProgress:
    """Follow ``summary_path`` until ``close()``, drawing ``rounds`` steps."""

    def __init__(
        self,
        summary_path: Path,
        rounds: int,
        *,
        stream: TextIO | None = None,
        interval_s: float = 0.5,
        label: str = "",
    ) -> None:
        self.path = Path(summary_path)
        self.rounds = rounds
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.label = label
        self.t0 = time.monotonic()
        self._since = time.time()  # ignore a summary left from an earlier run
        self._shown = 0
        self._stop = threading.Event()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Draw what is there, end the line, stop following."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()
        if self._tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def _poll(self) -> None:
        rounds = self._rounds()
        if len(rounds) <= self._shown:
            return
        for k in range(self._shown + 1, len(rounds) + 1):
            if not self._tty or k == len(rounds):
                self._draw(rounds[:k])
        self._shown = len(rounds)

    def _rounds(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_mtime < self._since:
                return []
            rounds = json.loads(self.path.read_text()).get("rounds", [])
        except (OSError, ValueError, AttributeError):
            return []  # not written yet, or being replaced
        return rounds if isinstance(rounds, list) else []

    def _draw(self, rounds: list[dict[str, Any]]) -> None:
        self.stream.write(
            ("\r" if self._tty else "")
            + format_bar(rounds, self.rounds, time.monotonic() - self.t0, self.label)
            + ("" if self._tty else "\n")
        )
        self.stream.flush()


def format_bar(
    rounds: list[dict[str, Any]], total: int, elapsed_s: float, label: str = ""
) -> str:
    """``label [#####-----] 3/10 rounds  accuracy 0.8123  4.1 s/round  eta 29 s``."""
    done = min(len(rounds), total)
    width = 20
    fill = round(width * done / max(total, 1))
    last = rounds[-1] if rounds else {}
    metric = (
        f"perplexity {last['perplexity']:.2f}"
        if "perplexity" in last
        else f"accuracy {last.get('accuracy', float('nan')):.4f}"
    )
    per = elapsed_s / done if done else 0.0
    clients = f"{last.get('num_clients', 0)}/{last.get('num_sampled', 0)} clients"
    parts = [
        f"[{'#' * fill}{'-' * (width - fill)}] {done}/{total} rounds",
        metric,
        clients,
        f"{per:.1f} s/round",
        f"eta {per * (total - done):.0f} s",
    ]
    return (f"{label} " if label else "") + "  ".join(parts)
