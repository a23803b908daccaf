"""Test tiers by what a test starts, enforced; and the reaper of what a test leaves.

Tiers (README, "Tests"):

- ``default`` (no marker): starts no process at all.
- ``child`` (``@pytest.mark.child``): starts processes one at a time: a measured child,
  one CLI subprocess, a 2-rank torchrun.
- ``heavy`` (``@pytest.mark.heavy``; ``simulation`` and ``deployment`` imply it): Ray,
  SuperLink deployments, soak, grids, 3-rank and larger torchrun, several processes at
  once.

``--tier default|child|heavy|all`` selects one; without it a bare ``pytest`` runs the
default tier and a command line that names files or tests runs all of theirs. Tests
marked ``zoo`` (the architecture zoos: minutes, not in CI) run only where ``-m``
names the marker (``-m zoo``), in any tier.

``@pytest.mark.zoo`` (the architecture zoos, ``benchmarks/zoo.py``) is in no tier: such
a test runs only where the ``-m`` expression names ``zoo`` (``pytest -m zoo``), never in
CI or ``scripts/check``, whatever the tier.

Enforced while a test runs: a default-tier test that starts a process, or a child-tier
test that starts one while another it started is still running, or one that runs a
heavy tier's process (a SuperLink, a SuperNode, ``flwr``, Ray, nginx serving, 3+ ranks; its
own child or one a CLI subprocess started, sampled every 0.5 s), fails with the marker
it needs. Warm measuring servers
(``memory.warmstart``) live across tests and count for no test.

The reaper: a test that leaves a process of its own running (a child, or a child's
child) once it is torn down fails, after a grace period, and what it left is killed,
so that one failure costs seconds and not the next test's timeout.
"""

from __future__ import annotations

import _posixsubprocess
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

TIERS = ("default", "child", "heavy")
_HEAVY_MARKERS = {"heavy", "simulation", "deployment"}
_HEAVY_COMMANDS = re.compile(
    r"flower-superlink|flower-supernode|flower-superexec|flwr-serverapp|flwr-clientapp"
    r"|/flwr\b|\bflwr (run|ls|log|stop)|/ray/|\bray::|raylet|gcs_server"
    r"|nginx(?!.*\s-t(\s|$))"  # nginx serving; ``nginx -t`` only checks a config
    r"|--nproc[-_]per[-_]node[= ]([3-9]|\d\d)"
)
GRACE_S = {"default": 3.0, "child": 5.0, "heavy": 15.0}
"""Seconds a test's leftover processes get to end on their own before the reaper."""
TIMEOUT_S = {"default": 300, "child": 600, "heavy": 900}
"""Each tier's per-test timeout (``pytest.mark.timeout`` overrides it)."""
PREPARE: list[Any] = []
"""Callables run once before the first default-tier test of a session, counted for no
test: what a session measures once and keeps (a process), which whichever test came
first would otherwise start (conftest.py: the machine's runtime figure)."""


def tier_of(item: pytest.Item) -> str:
    names = {m.name for m in item.iter_markers()}
    if names & _HEAVY_MARKERS:
        return "heavy"
    return "child" if "child" in names else "default"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=(*TIERS, "all"),
        default=None,
        help="the tier to run (default: 'default' for a bare pytest, 'all' when "
        "files or tests are named)",
    )


def _selected_tier(config: pytest.Config) -> str:
    tier = config.getoption("--tier")
    if tier:
        return str(tier)
    named = config.args_source == pytest.Config.ArgsSource.ARGS
    return "all" if named else "default"


def group_of(item: pytest.Item) -> str | None:
    """The xdist group a test runs in (one worker, one test at a time): SuperLink
    deployments (their rounds wait on deadlines that a second deployment's load
    could miss), and every other test that starts a process (they measure memory or
    time), except Ray simulations; None for those and for the default tier, which
    run anywhere. A simulation measures each device's step in a child of its own,
    whose peak no other process changes (two ViT plans measured side by side: 233
    MiB each, as alone), and its simulated times are figures, not wall time."""
    names = {m.name for m in item.iter_markers()}
    if "deployment" in names:
        return "deployment"
    if "simulation" in names or tier_of(item) == "default":
        return None
    return "measure"


def _order(item: pytest.Item) -> int:
    """Where a test goes in an xdist worker's collection: the groups first (the
    scheduler hands each to one worker, largest first), then the other tests that
    start processes (minutes each), then the default tier (seconds each, filling
    whichever worker frees first)."""
    if group_of(item) is not None:
        return 0
    return 1 if tier_of(item) != "default" else 2


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    tier = _selected_tier(config)
    xdist = config.pluginmanager.hasplugin("xdist")
    # the zoos (``zoo``: minutes, not in CI) run only where ``-m`` names them
    zoos = "zoo" in (config.getoption("markexpr", "") or "")
    keep, drop = [], []
    for item in items:
        if item.get_closest_marker("zoo") and not zoos:
            drop.append(item)
            continue
        t = tier_of(item)
        if not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(TIMEOUT_S[t]))
        group = group_of(item)
        if xdist and group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        (keep if tier in ("all", t) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if xdist and os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_order)  # stable: each part keeps the collection order


def pytest_report_header(config: pytest.Config) -> str:
    return f"tier: {_selected_tier(config)}"


# --- what a test starts -----------------------------------------------------------

_me = psutil.Process()
_current: dict[str, Any] = {"item": None, "started": [], "problems": []}
_real_fork_exec = _posixsubprocess.fork_exec
_real_fork = os.fork


def _warm_pids() -> set[int]:
    warmstart = sys.modules.get("memory.warmstart")  # never imported here: torch
    return set(warmstart.server_pids()) if warmstart else set()


def _live(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _note_start(command: str) -> None:
    item = _current["item"]
    if item is None:
        return
    tier = tier_of(item)
    problems: list[str] = _current["problems"]
    if tier == "default":
        problems.append(
            f"a default-tier test started a process ({command[:120]}): mark it "
            "@pytest.mark.child (one at a time) or @pytest.mark.heavy"
        )
    elif tier == "child":
        if _HEAVY_COMMANDS.search(command):
            problems.append(
                f"a child-tier test started a heavy tier's process ({command[:120]}): "
                "mark it @pytest.mark.heavy"
            )
        elif _live(_current["started"]):
            problems.append(
                f"a child-tier test started a process ({command[:120]}) while another "
                "of its own still ran: mark it @pytest.mark.heavy"
            )


def _command(args: Any) -> str:
    if isinstance(args, (str, bytes)):
        args = [args]
    return " ".join(
        a.decode(errors="replace") if isinstance(a, bytes) else str(a) for a in args
    )


def _started(command: str, pid: int) -> None:
    if "# fleetfit warm server" in command:
        # lives across tests; its children count per call (run_warm below), but
        # starting one is a start all the same for a test that may start nothing
        item = _current["item"]
        if item is not None and tier_of(item) == "default":
            _note_start("a warm measuring server (memory.warmstart)")
        return
    _note_start(command)
    if _current["item"] is not None:
        _current["started"].append(pid)


_real_execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _execute_child(self: subprocess.Popen, args: Any, *rest: Any) -> None:
    _real_execute_child(self, args, *rest)
    _started(_command(args), self.pid)


def _fork_exec(args: Any, *rest: Any) -> int:  # multiprocessing's spawn
    pid = int(_real_fork_exec(args, *rest))
    _started(_command(args), pid)
    return pid


def _fork() -> int:
    _note_start("os.fork()")
    pid = _real_fork()
    if pid and _current["item"] is not None:
        _current["started"].append(pid)
    return pid


subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]
_posixsubprocess.fork_exec = _fork_exec
os.fork = _fork
_inflight = [0]


def _wrap_run_warm() -> None:
    # A measured child forked by a warm server is a process the test started.
    warmstart = sys.modules.get("memory.warmstart")
    if warmstart is None or getattr(warmstart.run_warm, "_tiers", False):
        return
    real = warmstart.run_warm

    def run_warm(*args: Any, **kwargs: Any) -> Any:
        if (
            _inflight[0]
            and _current["item"] is not None
            and tier_of(_current["item"]) == "child"
        ):
            _current["problems"].append(
                "a child-tier test measured two children at once: mark it "
                "@pytest.mark.heavy"
            )
        _note_start("a measured child (memory.measure, warm)")
        _inflight[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            _inflight[0] -= 1

    run_warm._tiers = True  # type: ignore[attr-defined]
    warmstart.run_warm = run_warm


def _children() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in _me.children(recursive=True)}
    except psutil.Error:
        return {}


def _describe(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160] or p.name()
    except psutil.Error:
        return str(p.pid)


class _Watch(threading.Thread):
    """Samples a child-tier test's descendants: a SuperLink or Ray started by a CLI
    subprocess is a heavy tier's, though the test started only the CLI."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="tiers-watch")
        self.stop = threading.Event()
        self.seen: str | None = None

    def run(self) -> None:
        while not self.stop.wait(0.5) and self.seen is None:
            for p in _children().values():
                try:
                    line = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                if _HEAVY_COMMANDS.search(line):
                    self.seen = line[:120]
                    break


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _wrap_run_warm()
    while PREPARE and tier_of(item) == "default":
        PREPARE.pop(0)()  # outside any test: no test of the tier starts it
    _current.update(item=item, started=[], problems=[], before=set(_children()))
    _current["watch"] = None
    if tier_of(item) == "child":
        _current["watch"] = _Watch()
        _current["watch"].start()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    finally:
        _current["item"] = None
        problems = list(_current["problems"])
        watch = _current.get("watch")
        if watch is not None:
            watch.stop.set()
            watch.join()
            if watch.seen:
                problems.append(
                    f"a child-tier test ran a heavy tier's process ({watch.seen}): "
                    "mark it @pytest.mark.heavy"
                )
        left = _leftovers(item)
        if left:
            problems.append(
                f"left {len(left)} process(es) running after its teardown, killed: "
                + "; ".join(left)
            )
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)


def _leftovers(item: pytest.Item) -> list[str]:
    before: set[int] = _current.get("before", set())
    warm = _warm_pids()

    def new() -> list[psutil.Process]:
        out = []
        for pid, p in _children().items():
            if pid in before or pid in warm:
                continue
            try:
                if p.ppid() in warm or p.status() == psutil.STATUS_ZOMBIE:
                    continue  # a warm server's child is the server's; a zombie is done
            except psutil.Error:
                continue
            out.append(p)
        return out

    left = new()
    if not left:
        return []
    deadline = time.monotonic() + GRACE_S[tier_of(item)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = new()
    described = [_describe(p) for p in left]
    for p in left:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)
    return described
