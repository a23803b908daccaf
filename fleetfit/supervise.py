"""The supervisor of ``fleetfit server``'s processes: nothing it started outlives it.

    sup = Supervisor(lock=out / LOCK_NAME)   # starts the supervisor; it makes sup.work
    link = sup.spawn("superlink", ["flower-superlink", ...], env, log=out / "a.log")
    stop(link)                               # link: pid, poll, wait, terminate, kill
    sup.close()                              # the rest killed, sup.work removed

Flower's SuperLink starts its SuperExec in a session of its own, and the SuperExec
starts the ServerApp: neither a parent-death signal nor a kill of the command's
process group reaches them. So the command starts this small supervisor (this file,
run as a script: the standard library and psutil only) in a session of its own, where
no signal meant for the command's process group or terminal reaches it. The supervisor
makes itself a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): whatever it
starts, and whatever that starts, stays below it when an intermediate parent dies. It
starts the Flower processes and nginx when the command asks, over a socket pair; when
that socket ends (the command exited, whatever killed it: SIGKILL, the OOM killer) or
the command asks it to shut down, it sends SIGTERM to every process below it, SIGKILL
after ``GRACE_S`` to those left, reaps them, removes its work folder and the lock file,
and exits.

The lock file (``<run folder>/server-processes.json``) names the command, the
supervisor and every process below it with their start times, rewritten as they
change; a later ``fleetfit server`` on the same run folder refuses to start while any
of them lives (``survivors``). It stays behind only when the supervisor itself was
SIGKILLed, the one case in which processes can outlive the command.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

LOCK_NAME = "server-processes.json"
GRACE_S = 2.0  # SIGTERM to SIGKILL, seconds: the whole stop stays within 5 s
POLL_S = 0.1  # how often the supervisor looks at its children, seconds
TREE_EVERY_S = 1.0  # how often it reaps orphans and rewrites the lock file, seconds
MAX_MESSAGE = 1 << 20  # bytes: one request (a command line and its environment)
LOST = -1  # the return code of a child whose supervisor died before it did
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


# ---------------------------------------------------------------- command side
class Child:
    """A process the supervisor started, with the part of ``subprocess.Popen``'s
    interface the command uses: ``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, supervisor: Supervisor, pid: int, name: str) -> None:
        self.pid = pid
        self.name = name
        self.returncode: int | None = None
        self._supervisor = supervisor
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its return code, once it has exited (``subprocess.TimeoutExpired`` after
        ``timeout`` seconds). Waits in short slices, so Ctrl-C interrupts it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended.wait(0.5):
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self._supervisor._signal(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Supervisor:
    """The command's end: starts the supervisor process and asks it to start and
    signal processes. ``work`` is the supervisor's work folder (a fresh
    ``prefix*`` folder in the system's temporary folder), removed when it exits.

    Raises:
        RuntimeError: the supervisor did not start within ``timeout_s``.
    """

    def __init__(
        self,
        lock: Path | None = None,
        prefix: str = "fleetfit-server-",
        timeout_s: float = 30.0,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        script = str(Path(__file__).resolve())
        try:
            # -I: no user site, no PYTHONPATH, not the script's folder on the path
            self.proc = subprocess.Popen(
                [sys.executable, "-I", script, str(theirs.fileno()), prefix]
                + [str(lock or "")],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.lock = lock
        self._sock = ours
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, Child] = {}
        self._exits: dict[int, int] = {}
        self._ids = itertools.count()
        self._lost = False
        self._closing = False
        hello = self._receive(timeout_s)
        if hello is None or "work" not in hello:
            self.proc.kill()
            code = self.proc.wait()
            ours.close()
            raise RuntimeError(
                f"the process supervisor ({script}) did not start (exit code {code})"
            )
        self.work = Path(hello["work"])
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        if not select.select([self._sock], [], [], timeout_s)[0]:
            return None
        data = self._sock.recv(MAX_MESSAGE)
        return json.loads(data) if data else None

    def _read(self) -> None:
        """The reader thread: replies to requests, and children's exits."""
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._cond:
                if "id" in message:
                    self._replies[message["id"]] = message
                elif "exit" in message:
                    pid, code = message["exit"], message["code"]
                    child = self._children.pop(pid, None)
                    if child is not None:
                        child._end(code)
                    else:
                        self._exits[pid] = code
                self._cond.notify_all()
        with self._cond:
            self._lost = True
            for child in self._children.values():
                child._end(LOST)
            self._children.clear()
            self._cond.notify_all()
        if not self._closing:
            log.error(
                "the process supervisor (pid %d) ended before this command: the "
                "processes it started may still run (see the run folder's %s)",
                self.pid,
                LOCK_NAME,
            )

    def _send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode()
        with self._send_lock:
            if self._lost:
                raise RuntimeError(f"the process supervisor (pid {self.pid}) is gone")
            if fds:
                socket.send_fds(self._sock, [data], fds)
            else:
                self._sock.send(data)

    def _signal(self, pid: int, signum: int) -> None:
        try:
            self._send({"op": "signal", "pid": pid, "signal": int(signum)})
        except (OSError, RuntimeError):
            pass  # the supervisor is gone, and with it what it could signal

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        log: Path | None = None,
        append: bool = False,
        stdout: int | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Have the supervisor start ``args``; its output goes to file ``log``
        (appended to with ``append``) or to the open file descriptor ``stdout`` (a
        pipe's end, say: passed over the socket), else nowhere.

        Raises:
            OSError: the program could not be started (``FileNotFoundError``...).
        """
        request_id = next(self._ids)
        request = {
            "op": "spawn",
            "id": request_id,
            "args": [str(a) for a in args],
            "env": env,
            "cwd": str(cwd) if cwd else None,
            "log": str(log) if log else None,
            "append": append,
        }
        self._send(request, [stdout] if stdout is not None else None)
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._replies or self._lost, timeout=60
            ):
                raise RuntimeError(f"the process supervisor did not start {name}")
            if self._lost:
                raise RuntimeError(f"the process supervisor died starting {name}")
            reply = self._replies.pop(request_id)
            if "error" in reply:
                raise OSError(reply["errno"] or 0, f"{name}: {reply['error']}")
            child = Child(self, int(reply["pid"]), name)
            if child.pid in self._exits:
                child._end(self._exits.pop(child.pid))
            else:
                self._children[child.pid] = child
        return child

    def run(
        self, name: str, args: list[str], env: dict[str, str], timeout_s: float
    ) -> tuple[int, str]:
        """Start ``args`` and wait for it: its return code and output (stdout and
        stderr together, as text).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it was killed).
        """
        read_end, write_end = os.pipe()
        try:
            try:
                child = self.spawn(name, args, env, stdout=write_end)
            finally:
                os.close(write_end)
            chunks = []
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    child.kill()
                    child.wait()
                    raise subprocess.TimeoutExpired(name, timeout_s)
                if select.select([read_end], [], [], min(left, 0.5))[0]:
                    data = os.read(read_end, 1 << 16)
                    if not data:
                        break
                    chunks.append(data)
        finally:
            os.close(read_end)
        code = child.wait(timeout=max(1.0, deadline - time.monotonic()))
        return code, b"".join(chunks).decode(errors="replace")

    def close(self, timeout_s: float = 20.0) -> None:
        """Have the supervisor stop what is left (SIGTERM, SIGKILL after
        ``GRACE_S``), remove its work folder and exit; wait for it."""
        self._closing = True
        try:
            self._send({"op": "shutdown"})
        except (OSError, RuntimeError):
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()
        if self.lock is not None and self.lock.exists():
            # The supervisor was killed (its lock file stays): what it recorded
            # below it may run on, orphaned; stop that from here.
            left = survivors(self.lock)
            _terminate([pid for pid, role, _ in left if role == "process"])
            self.lock.unlink(missing_ok=True)


def survivors(lock: Path) -> list[tuple[int, str, str]]:
    """The processes that ``lock`` (a run folder's ``LOCK_NAME``) records and that
    still run: ``(pid, role, program)``, the role ``"command"``, ``"supervisor"`` or
    ``"process"``. A pid counts only with its recorded start time (psutil), so a pid
    reused since is not taken for it. An unreadable lock file records nothing."""
    try:
        record = json.loads(lock.read_text())
        entries = [
            (int(e["pid"]), float(e["create_time"]), str(e["role"]))
            for e in record["processes"]
        ]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    alive = []
    for pid, started, role in entries:
        try:
            proc = psutil.Process(pid)
            if (
                abs(proc.create_time() - started) < 0.05
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append((pid, role, program(proc)))
        except psutil.Error:
            continue
    return alive


def program(proc: psutil.Process) -> str:
    """What ``proc`` runs, in a word or two: its program (a Python script's name,
    ``python -m``'s module), without its arguments (a ServerApp's carry a token)."""
    words = proc.cmdline() or [proc.name()]
    if len(words) > 1 and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
        while len(words) > 1 and words[0].startswith("-"):
            if words[0] == "-m":
                return " ".join(words[1:3])  # e.g. "fleetfit.cli server"
            words = words[1:]
    return os.path.basename(words[0])


def _terminate(pids: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to ``pids``, SIGKILL after ``grace_s`` to those left."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=grace_s)


# ------------------------------------------------------------- supervisor side
class _Stop(Exception):
    """A signal asked the supervisor to stop."""


def _on_signal(signum: int, frame: object) -> None:
    raise _Stop


def _set_subreaper() -> bool:
    """Make this process a child subreaper (Linux): orphans below it come to it,
    not to init. False where the system has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0


def _send_reply(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the command is gone; the next receive says so


def _spawn(
    sock: socket.socket,
    request: dict[str, Any],
    fds: list[int],
    children: dict[int, subprocess.Popen],
) -> None:
    out: Any = fds[0] if fds else subprocess.DEVNULL
    logfile = None
    try:
        if request.get("log"):
            logfile = open(request["log"], "ab" if request.get("append") else "wb")  # noqa: SIM115
            out = logfile
        proc = subprocess.Popen(
            request["args"],
            env=request["env"],
            cwd=request.get("cwd"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    except OSError as e:
        _send_reply(sock, {"id": request["id"], "error": str(e), "errno": e.errno})
    else:
        children[proc.pid] = proc
        _send_reply(sock, {"id": request["id"], "pid": proc.pid})
    finally:
        if logfile is not None:
            logfile.close()
        for fd in fds:
            os.close(fd)


def _tree(me: psutil.Process) -> list[psutil.Process]:
    """Every live (not zombie) process below this one."""
    live = []
    for proc in me.children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
        except psutil.Error:
            continue
    return live


def _reap(children: dict[int, subprocess.Popen]) -> None:
    """Reap the zombies among this process's children that it did not start
    (orphans that came to it); its own ``children`` are reaped by ``poll``."""
    for proc in psutil.Process().children():
        if proc.pid in children:
            continue
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _write_lock(
    lock: Path, work: Path, command: psutil.Process, last: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Rewrite ``lock`` when the processes below this one changed; returns them
    (as last written: a folder that cannot be written keeps ``last``)."""
    me = psutil.Process()
    entries = []
    for role, proc in [
        ("command", command),
        ("supervisor", me),
        *(("process", p) for p in _tree(me)),
    ]:
        try:
            entries.append(
                {
                    "pid": proc.pid,
                    "role": role,
                    "create_time": proc.create_time(),
                    "program": program(proc),
                }
            )
        except psutil.Error:
            continue
    if entries == last:
        return last
    record = {"work": str(work), "processes": entries}
    tmp = lock.with_name(lock.name + ".tmp")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, lock)
    except OSError:
        return last
    return entries


def _kill_tree(grace_s: float = GRACE_S, give_up_s: float = 10.0) -> None:
    """SIGTERM to every process below this one, SIGKILL after ``grace_s`` to
    those left (and to any started meanwhile), until none is left; reaped."""
    me = psutil.Process()
    start = time.monotonic()
    termed: set[int] = set()
    while True:
        while True:  # reap whatever has ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        live = _tree(me)
        elapsed = time.monotonic() - start
        if not live or elapsed > give_up_s:
            return
        for proc in live:
            try:
                if elapsed >= grace_s:
                    proc.kill()
                elif proc.pid not in termed:
                    proc.terminate()
                    termed.add(proc.pid)
            except psutil.Error:
                continue
        time.sleep(0.05)


def serve(sock: socket.socket, prefix: str, lock: Path | None) -> None:
    """The supervisor: make the work folder, say so, then serve requests until
    the socket ends, a ``shutdown`` request or a signal; then stop everything."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    work: Path | None = None
    children: dict[int, subprocess.Popen] = {}
    last: list[dict[str, Any]] = []
    try:
        command = psutil.Process(os.getppid())  # recorded once: it may die first
        work = Path(tempfile.mkdtemp(prefix=prefix))
        _set_subreaper()
        _send_reply(sock, {"work": str(work), "pid": os.getpid()})
        next_tree = 0.0
        while True:
            if select.select([sock], [], [], POLL_S)[0]:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 4)
                if not data:
                    break  # the command exited
                request = json.loads(data)
                if request["op"] == "shutdown":
                    break
                if request["op"] == "spawn":
                    _spawn(sock, request, fds, children)
                elif request["op"] == "signal":
                    proc = children.get(request["pid"])
                    if proc is not None and proc.poll() is None:
                        proc.send_signal(request["signal"])
            for pid, proc in list(children.items()):
                if proc.poll() is not None:
                    del children[pid]
                    _send_reply(sock, {"exit": pid, "code": proc.returncode})
            if time.monotonic() >= next_tree:
                next_tree = time.monotonic() + TREE_EVERY_S
                _reap(children)
                if lock is not None:
                    last = _write_lock(lock, work, command, last)
    except _Stop:
        pass
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        _kill_tree()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        if lock is not None and last:
            lock.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """``supervise.py FD PREFIX LOCK``: serve on the socket ``FD``."""
    fd, prefix, lock = int(argv[0]), argv[1], argv[2]
    serve(socket.socket(fileno=fd), prefix, Path(lock) if lock else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
