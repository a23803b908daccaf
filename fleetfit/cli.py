"""The ``fleetfit`` command: a typer application, as Flower's own ``flwr``.

fleetfit simulate                         # digits CNN, 10 virtual clients, 5 rounds
fleetfit simulate --workload gpt-tiny --clients 4 --rounds 3 --out runs/lm
fleetfit --version
fleetfit --install-completion             # shell completion (bash, zsh, fish)

Every command's options are typed and checked while the line is parsed. Bad input,
there or later (a ``ValueError`` and the like from the command), ends the command with
one line on standard error, ``fleetfit <command>: error: ...``, and exit code 2;
Ctrl-C and SIGTERM stop what the command started (Ray) and exit 130 / 143.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Annotated, Any, NoReturn

import click
import typer
from typer.core import TyperGroup

log = logging.getLogger("fleetfit")

# Failures a command reports in one line (bad input, clear failures), exit code 2.
USER_ERRORS = (ValueError, FileNotFoundError, TimeoutError, ConnectionError)


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


class Failure(click.ClickException):
    """A command's failure on bad input, printed as one line (exit code 2)."""

    exit_code = 2
    command = ""  # the failed command's path, e.g. "fleetfit memory plan"


class FleetfitGroup(TyperGroup):
    """typer's group, with fleetfit's ends: one-line errors, no traceback, Ray
    stopped whatever happens. Used by ``main`` and by typer's test runner alike."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            interrupted()
        except USER_ERRORS as e:
            failure = Failure(str(e))
            # the command that failed, for the message: this group's subcommand (a
            # group's own subgroups are FleetfitGroups too, so the innermost says it)
            failure.command = f"{ctx.command_path} {ctx.invoked_subcommand or ''}"
            raise failure from None
        finally:
            _stop_ray()

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(
                args=args,
                prog_name=prog_name or "fleetfit",
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
            code = rv if isinstance(rv, int) else 0
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)  # a UsageError's
            command = getattr(e, "command", "") or (
                ctx.command_path if ctx is not None else "fleetfit"
            )
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            message = " ".join(e.format_message().split())  # one line
            if message:  # empty: a group's help, shown for no arguments
                print(f"{command}: error: {message}{hint}", file=sys.stderr)
            code = e.exit_code
        except click.Abort:
            print("fleetfit: aborted", file=sys.stderr)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


def _version(value: bool) -> None:
    if value:
        import importlib.metadata as md

        def of(dist: str) -> str:
            try:
                return md.version(dist)
            except md.PackageNotFoundError:
                return "not installed"

        from fleetfit import __version__

        typer.echo(
            f"fleetfit {__version__} (flwr {of('flwr')}, torch {of('torch')}, "
            f"Python {sys.version.split()[0]})"
        )
        raise typer.Exit()


app = typer.Typer(
    cls=FleetfitGroup,
    name="fleetfit",
    help="Train models on devices that do not have the memory to train them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    verbose: Annotated[
        bool,
        typer.Option("-v", "--verbose", help="debug logging, fleetfit's and Flower's"),
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="print the versions of fleetfit, Flower, torch and Python, and exit",
        ),
    ] = False,
) -> None:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    _setup_logging(verbose)


def _register() -> None:
    # One module per command group, each with ``register(app)``.
    from fleetfit import (
        cmd_export,
        cmd_federation,
        cmd_memory,
        cmd_partition,
        cmd_simulate,
    )

    for module in (cmd_simulate, cmd_memory, cmd_partition, cmd_federation, cmd_export):
        module.register(app)
    for group in app.registered_groups:  # ``fleetfit memory`` and the like
        if group.typer_instance is not None:
            group.typer_instance.info.cls = FleetfitGroup


_register()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: the process's) and return its exit code."""
    command = typer.main.get_command(app)
    return int(command.main(args=argv, prog_name="fleetfit", standalone_mode=False))


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
    """Every live process below ``root`` (psutil; empty where ``root`` is gone)."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return set()


def _terminate(
    pids: set[int],
    grace_s: float = 3.0,
    signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGKILL),
) -> None:
    """Send ``signals[0]`` to ``pids``, wait up to ``grace_s`` for them to go, send
    the next to the rest, and so on (by default SIGTERM, then SIGKILL).

    A pid is signalled only while it is the process it was when first seen (psutil
    compares its start time), so a pid reused meanwhile is left alone.
    """
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    for sig in signals:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.send_signal(sig)
                    alive.append(p)
            except psutil.Error:
                pass
        if not alive:
            return
        _, procs = psutil.wait_procs(alive, timeout=grace_s)


if __name__ == "__main__":
    sys.exit(main())
