"""The terminal of fleetfit's commands: one rich ``Console`` on stderr, shared by the
log handler and the progress bars, so that log lines and relayed output print above a
live bar instead of through it.

On a terminal, logs go through rich's ``RichHandler`` and ``say`` prints above any live
display. Elsewhere (a pipe, a file, CI, tests) everything stays plain lines: no ANSI
codes, no wrapping, no bar.

>>> from simulations.console import say
>>> say("round 1/5  accuracy 0.6100  clients 10/10  train loss 2.0500  26.8 s")
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

_bound: Console | None = None  # the command's: on the stderr it started with
_dynamic: Console | None = None  # otherwise: on whatever sys.stderr is at the time


def bind() -> Console:
    """Bind the shared console to the current ``sys.stderr``; a command calls this
    once as it starts (``log_handler`` does). Bound, a library that redirects
    ``sys.stderr`` for a while (the ONNX exporter does, in the ServerApp's thread)
    cannot swallow the rows and the bar that other threads print meanwhile."""
    global _bound
    _bound = Console(file=sys.stderr)
    return _bound


def console() -> Console:
    """The shared console: the bound one while its stream is open, else one that
    writes to whatever ``sys.stderr`` is at the time (tests, library use)."""
    global _dynamic
    if _bound is not None and not getattr(_bound.file, "closed", False):
        return _bound
    if _dynamic is None:
        _dynamic = Console(stderr=True)
    return _dynamic


def is_live(con: Console | None = None) -> bool:
    """Whether ``con`` (default: the shared console) can redraw a bar in place."""
    con = con or console()
    return con.is_terminal and not con.is_dumb_terminal


def say(line: str | Text, con: Console | None = None) -> None:
    """Print one line above any live bar: on a terminal, ANSI colours in ``line`` are
    kept (``Text.from_ansi``); elsewhere it is written as plain text."""
    con = con or console()
    text = line if isinstance(line, Text) else Text.from_ansi(line)
    con.print(text, soft_wrap=True, markup=False, highlight=False)


def log_handler() -> logging.Handler:
    """The handler of fleetfit's commands: ``LEVEL logger: message`` on stderr, through
    rich on a terminal (above any live bar), else plain lines. Binds the shared
    console to the current ``sys.stderr`` (``bind``)."""
    con = bind()
    if is_live(con):
        handler: logging.Handler = RichHandler(
            console=con,
            show_time=False,
            show_path=False,
            markup=False,
            rich_tracebacks=False,
        )
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    return handler
