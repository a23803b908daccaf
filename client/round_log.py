"""A SuperNode's round log: one JSON line per round its ClientApp trained in.

``fleetfit client`` names a file in the SuperNode's environment (``FLEETFIT_ROUND_LOG``);
Flower starts the ClientApp as a child of the SuperNode, which inherits it, and
``client.app.train`` appends a line per train instruction (``append``): the server's
round, the work (``full``, ``part``, ``none`` or ``error``), steps, examples, mean loss,
seconds, the measured peak and the runtime's footprint beside the node's budget.
``fleetfit client`` reads the new lines as they come (``RoundLogReader``) and prints
them (``format_entry``), then a table of all of them when it stops (``format_table``)::

    round 3: full, 20 steps on 1,240 examples, loss 0.5120, peak 412.00 MiB (budget
    512.00 MiB, runtime 300.00 MiB), 3.2 s

Writing never fails a reply (a warning is logged); reading skips a line it cannot
parse and leaves an unfinished last line for the next read.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from memory.sizes import format_bytes

log = logging.getLogger(__name__)

ROUND_LOG_ENV = "FLEETFIT_ROUND_LOG"  # the file a ClientApp appends its rounds to
WORK = ("full", "part", "none", "error")


def round_log_path() -> Path | None:
    """The file named by ``FLEETFIT_ROUND_LOG``, or None when it is not set."""
    path = os.environ.get(ROUND_LOG_ENV, "")
    return Path(path) if path else None


def append(entry: dict[str, Any], path: Path | None = None) -> None:
    """Append ``entry`` as one JSON line to ``path`` (default: ``round_log_path()``;
    nothing when neither is set). Never raises: a failure is a warning."""
    try:
        path = path or round_log_path()
        if path is None:
            return
        finite = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in entry.items()
        }
        line = json.dumps(finite, allow_nan=False, default=str) + "\n"
        # One write on an O_APPEND descriptor: a reader sees whole lines or a tail
        # without its newline, never two entries interleaved.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except Exception as e:  # the round log is a display: the reply goes on
        log.warning("cannot write the round log %s: %s: %s", path, type(e).__name__, e)


class RoundLogReader:
    """Reads the entries appended to a round log since the last ``read()``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self.entries: list[dict[str, Any]] = []  # every entry read so far

    def read(self) -> list[dict[str, Any]]:
        """The complete lines written since the last call, parsed; a line that is
        not a JSON object is skipped, an unfinished last line waits for its end."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []  # not written yet
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = []
        for raw in data[:end].splitlines():
            try:
                entry = json.loads(raw)
            except ValueError:
                log.debug("round log %s: skipped a line that is not JSON", self.path)
                continue
            if isinstance(entry, dict):
                new.append(entry)
        self.entries += new
        return new


def _size(n: Any) -> str:
    return format_bytes(n) if isinstance(n, int | float) else "-"


def _num(x: Any, spec: str) -> str:
    try:
        return format(x, spec) if isinstance(x, int | float) else "-"
    except ValueError:  # a float where an int was written
        return str(x)


def work_text(entry: dict[str, Any]) -> str:
    """``full``, ``part (blocks 2-5)``, ``none`` or ``error``."""
    kind = str(entry.get("kind", "?"))
    window = entry.get("window")
    if kind == "part" and isinstance(window, list) and len(window) == 2:
        return f"part (blocks {window[0]}-{window[1] - 1})"
    return kind


def format_entry(entry: dict[str, Any]) -> str:
    """One round of this node, e.g. ``round 3: full, 20 steps on 1,240 examples, loss
    0.5120, peak 412.00 MiB (budget 512.00 MiB, runtime 300.00 MiB), 3.2 s``."""
    head = f"round {entry.get('round', '?')}: {work_text(entry)}"
    kind = entry.get("kind")
    if kind == "error":
        return f"{head}: {entry.get('error', '')}"
    budget = f"budget {_size(entry.get('budget_bytes'))}"
    if kind == "none":
        need = entry.get("min_budget_bytes")
        more = f", needs {_size(need)}" if isinstance(need, int) and need > 0 else ""
        return f"{head}, nothing fits ({budget}{more}): {entry.get('reason', '')}"
    steps, examples = entry.get("steps"), entry.get("num_examples")
    return (
        f"{head}, {_num(steps, 'd')} steps on {_num(examples, ',d')} examples, "
        f"loss {_num(entry.get('train_loss'), '.4f')}, "
        f"peak {_size(entry.get('peak_bytes'))} ({budget}, "
        f"runtime {_size(entry.get('baseline_bytes'))}), "
        f"{_num(entry.get('train_s'), '.1f')} s"
    )


def format_table(entries: list[dict[str, Any]]) -> str:
    """The rounds this node took part in, one row each."""
    head = ["round", "work", "steps", "examples", "loss", "peak", "budget", "runtime"]
    head.append("time s")
    rows = [
        [
            str(e.get("round", "?")),
            work_text(e),
            _num(e.get("steps"), "d"),
            _num(e.get("num_examples"), ",d"),
            _num(e.get("train_loss"), ".4f"),
            _size(e.get("peak_bytes")),
            _size(e.get("budget_bytes")),
            _size(e.get("baseline_bytes")),
            _num(e.get("train_s"), ".1f"),
        ]
        for e in entries
    ]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
