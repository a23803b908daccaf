"""Per-round progress of a federation: one step per federated round.

The federation writes its run folder's ``summary.json`` after every round (atomically);
``RoundProgress`` follows that file from a background thread, so it needs nothing from
Flower's engine and works the same for ``fleetfit simulate`` and ``fleetfit server``.
On a terminal it draws a rich progress bar on the shared console
(``simulations.console``: log lines print above it) and prints a row above the bar as
each round lands::

    round 3/10  accuracy 0.8123  clients 4/5  train loss 0.5120  4.1 s
    rounds ━━━━╸━━━━━━━━━━━ 3/10 accuracy 0.8123, 4/5 clients, 5.2 s/round, eta 36 s

Elsewhere (logs, CI, pipes) it prints the row alone, with the eta, one line per round.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
)

from simulations.console import console as shared_console
from simulations.console import is_live, say


class RoundProgress:
    """Follow ``summary_path`` until ``close()``, showing ``rounds`` steps.

    Args:
        summary_path: the run folder's ``summary.json`` (a file older than this
            object, left by an earlier run, is ignored).
        rounds: the run's number of rounds.
        console: where to draw (default: the shared console on stderr).
        interval_s: how often the file is read, seconds.
        label: the bar's name (e.g. a strategy's).
        bar: draw the live bar where the console can (else rows only).
        rows: print a row per round (off where the run's own log already says each
            round: ``fleetfit simulate`` runs the ServerApp in this process).
    """

    def __init__(
        self,
        summary_path: Path,
        rounds: int,
        *,
        console: Console | None = None,
        interval_s: float = 0.5,
        label: str = "",
        bar: bool = True,
        rows: bool = True,
    ) -> None:
        self.rows = rows
        self.path = Path(summary_path)
        self.rounds = rounds
        self.console = console or shared_console()
        self.interval_s = interval_s
        self.label = label
        self.t0 = time.monotonic()
        self._since = time.time()  # ignore a summary left from an earlier run
        self._shown = 0
        self._lock = threading.Lock()  # one reader at a time: the thread or close()
        self._stop = threading.Event()
        self._bar: Progress | None = None
        if bar and is_live(self.console):
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=16),  # the whole bar fits 80 columns
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                console=self.console,
                refresh_per_second=4,
            )
            self._task = self._bar.add_task(
                label or "rounds", total=rounds, status="waiting for round 1"
            )
            self._bar.start()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Show what is there, stop following (the finished bar stays on screen)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()
        if self._bar is not None:
            self._bar.stop()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._poll()

    def _poll(self) -> None:
        with self._lock:
            rounds = self._rounds()
            if len(rounds) <= self._shown:
                return
            elapsed_s = time.monotonic() - self.t0
            for k in range(self._shown if self.rows else len(rounds), len(rounds)):
                row = format_row(rounds[k], self.rounds)
                if self._bar is None:
                    row += f"  eta {eta_s(k + 1, self.rounds, elapsed_s):.0f} s"
                say(row, self.console)
            self._shown = len(rounds)
            if self._bar is not None:
                self._bar.update(
                    self._task,
                    completed=min(len(rounds), self.rounds),
                    status=format_status(rounds, self.rounds, elapsed_s),
                )

    def _rounds(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_mtime < self._since:
                return []
            rounds = json.loads(self.path.read_text()).get("rounds", [])
        except (OSError, ValueError, AttributeError):
            return []  # not written yet, or being replaced
        if not isinstance(rounds, list):
            return []
        return [r for r in rounds if isinstance(r, dict)]


def metric_text(r: dict[str, Any]) -> str:
    """``perplexity 12.34`` for a language model's round, else ``accuracy 0.8123``."""
    if isinstance(r.get("perplexity"), int | float):
        return f"perplexity {r['perplexity']:.2f}"
    acc = r.get("accuracy")
    return f"accuracy {acc:.4f}" if isinstance(acc, int | float) else "accuracy -"


def format_row(r: dict[str, Any], total: int) -> str:
    """``round 3/10  accuracy 0.8123  clients 4/5  train loss 0.5120  4.1 s``: one
    round of a summary (clients: those whose update was averaged / those sampled)."""
    loss = r.get("train_loss")
    sampled = r.get("num_sampled", r.get("num_clients", 0))
    return "  ".join(
        [
            f"round {r.get('round', '?')}/{total}",
            metric_text(r),
            f"clients {r.get('num_clients', 0)}/{sampled}",
            "train loss " + ("-" if loss is None else f"{loss:.4f}"),
            f"{r.get('round_s', 0.0):.1f} s",
        ]
    )


def eta_s(done: int, total: int, elapsed_s: float) -> float:
    """Seconds left at the pace so far (0 before the first round)."""
    return elapsed_s / done * max(total - done, 0) if done else 0.0


def format_status(rounds: list[dict[str, Any]], total: int, elapsed_s: float) -> str:
    """The bar's text: ``accuracy 0.8123, 4/5 clients, 4.1 s/round, eta 29 s``."""
    done = min(len(rounds), total)
    last = rounds[-1] if rounds else {}
    per = elapsed_s / done if done else 0.0
    sampled = last.get("num_sampled", last.get("num_clients", 0))
    return ", ".join(
        [
            metric_text(last),
            f"{last.get('num_clients', 0)}/{sampled} clients",
            f"{per:.1f} s/round",
            f"eta {eta_s(done, total, elapsed_s):.0f} s",
        ]
    )
