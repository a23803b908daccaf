"""The ``fleetfit`` command.

fleetfit simulate                         # digits CNN, 10 virtual clients, 5 rounds
fleetfit simulate --workload gpt-tiny --clients 4 --rounds 3 --out runs/lm
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

log = logging.getLogger("fleetfit")


def _setup_logging(verbose: bool) -> None:
    """One handler on stderr for every logger, fleetfit's and its dependencies'.

    fleetfit's own loggers and Flower's speak at INFO (DEBUG with ``-v``), other
    libraries' at WARNING. Flower's logger is set to DEBUG when Flower is imported and
    carries a console handler of its own, so its debug lines reached this handler and
    its warnings printed twice: here it loses its own handler and its level is ours.
    """
    # On a terminal, through rich on the console the progress bars share, so log
    # lines print above a live bar; elsewhere plain ``LEVEL name: message`` lines.
    from simulations.console import log_handler

    handler = log_handler()
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in ("fleetfit", "server", "client", "simulations", "memory", "partition"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)
    # Import Flower's logging module first: importing it later would add its console
    # handler back and set its level to DEBUG again.
    import flwr.supercore.logger  # noqa: F401

    flwr_log = logging.getLogger("flwr")
    flwr_log.handlers[:] = []
    flwr_log.propagate = True
    flwr_log.setLevel(logging.DEBUG if verbose else logging.INFO)


def _commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    # One module per command group, each with ``add(subparsers)``.
    from fleetfit import (
        cmd_export,
        cmd_federation,
        cmd_memory,
        cmd_partition,
        cmd_simulate,
    )

    return [
        cmd_simulate.add,
        cmd_memory.add,
        cmd_partition.add,
        cmd_federation.add,
        cmd_export.add,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetfit",
        description="Train models on devices that do not have the memory to train them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _commands():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        interrupted()
    except (ValueError, FileNotFoundError, TimeoutError, ConnectionError) as e:
        # Bad input and clear failures: one line naming the value and the fix.
        print(f"fleetfit: error: {e}", file=sys.stderr)
        return 2
    finally:
        _stop_ray()


def interrupted(signum: int = signal.SIGINT, *_: object) -> NoReturn:
    """Stop what this command started (Ray) and exit 128 + ``signum`` (130 after
    Ctrl-C, 143 after SIGTERM), without joining threads.

    Also installed as the SIGINT and SIGTERM handler of commands whose main thread
    may be inside Flower's simulation engine: its worker pool and its ServerApp
    thread wait for replies that will never come, so a KeyboardInterrupt or
    SystemExit raised there would not end the run.
    """
    what = "terminated" if signum == signal.SIGTERM else "interrupted"
    print(f"{what}: stopping what this command started", file=sys.stderr)
    _kill_ray()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


def stop_on_signals() -> None:
    """Make SIGINT (Ctrl-C) and SIGTERM both stop the command through
    ``interrupted``: clean up what it started, then exit."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupted)


def _kill_ray() -> None:
    """Kill every process this one started, at once, if it runs Ray.

    Not ``ray.shutdown()``: Flower's threads still call Ray, and Ray's core worker
    ends this process when they do after a shutdown, possibly before every process
    it started is gone (Ray's dashboard and runtime-env agents ignore SIGTERM and
    were left running). Killing them all first leaves no such window.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    # No wait: a killed process runs no more code, and Ray's core worker ends this
    # process (exit code 1) once it notices its raylet gone.
    _terminate(_descendants(os.getpid()), grace_s=0.0, signals=(signal.SIGKILL,))


def _stop_ray() -> None:
    """Stop a Ray runtime this process started (also after Ctrl-C or an error).

    ``ray.shutdown()`` asks Ray's head processes to stop; raylet workers that were busy
    in a task can outlive it for a while, orphaned. Whatever this process started and
    is still alive a moment later is terminated, then killed.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    # Flower's threads may still call Ray after the shutdown (a run that failed):
    # Ray would then start a new local Ray for them, orphaned at exit.
    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is not None:
        hook.enable_auto_connect = False  # type: ignore[attr-defined]
    started = _descendants(os.getpid())
    try:
        ray.shutdown()
    finally:
        _terminate(started)


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (read from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields follow the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _terminate(
    pids: set[int],
    grace_s: float = 3.0,
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL),
) -> None:
    """Send ``signals[0]`` to ``pids``, wait up to ``grace_s`` for them to go, send
    the next to the rest, and so on (by default SIGTERM, then SIGKILL)."""
    import time

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    for sig in signals:
        for pid in [p for p in pids if alive(p)]:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
