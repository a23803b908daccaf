"""Warm starts for measuring children: fork each from a server that has imported torch.

A fresh measuring child spends seconds importing torch (3.3 s here; 7.9 s with
transformers' model code) before it measures anything. A warm server is a Python
process started once, with the measuring child's environment (the allocators'
settings of ``memory.measure.CHILD_ENV`` are read when a process starts, so they are
the server's), that imports torch and the runtime's lazily loaded modules and then
forks one child per measurement. The child takes the caller's working directory,
environment and ``sys.path`` as a fresh ``python -c`` would, and runs the same child
code (``memory.measure._CHILD``).

The measurement is unchanged: a fork shares the server's anonymous pages (counted in
the child's RSS, as in a fresh process), but not the page-table entries of read-only
file mappings (the code of torch's libraries), which the kernel leaves to be faulted
in again on first touch; they would be counted as the step's growth (25 MiB on a
small MLP, measured). The server records which file-backed pages it has mapped after
its imports, and the child maps the same pages (``MADV_POPULATE_READ``) before its
baseline, so its resident set starts where a fresh child's does; then it resets its
peak (``VmHWM``). A warm child reports the peak of a fresh one within 2 MiB
(tests/memory/test_warmstart.py, on three reference plans).

Library modules a child imported before its baseline (its ``preload`` and warm-up:
transformers' model code, peft; ``WARM_LIBRARIES``) are imported by the server after
that child ends, so the next child finds them loaded, as it finds torch: such code
counts in the baseline either way. What the target imports itself counts in its peak,
in a fresh child and here alike.

Warm starts are on when ``FLEETFIT_WARM_CHILDREN=1`` (the test suite sets it; a
command that measures many children in a row may). A server is kept per
kind of child (what it imports before its baseline), interpreter, start-time
environment and project checkout; it ends with its caller
(``PR_SET_PDEATHSIG``, set from one long-lived thread of the caller, and at the end
of its input), and its child ends with it. A
call that cannot run warm (not Linux, a busy server, a server that failed to start)
runs in a fresh process: the caller sees no difference but the time.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

WARM_ENV = "FLEETFIT_WARM_CHILDREN"
"""``1``: measuring children fork from a warm server (see the module's docstring)."""

WARM_LIBRARIES = ("transformers", "peft", "safetensors", "numpy", "torchao")
"""Libraries a server imports after a child used them, so the next child finds them."""

# Environment read when a process starts (allocators, thread pools, the interpreter,
# CUDA): a child whose environment differs here from a server's needs its own server.
_START_KEYS = re.compile(
    r"^(MALLOC_|MKL_|OMP_|KMP_|GOMP_|OPENBLAS_|LD_|GLIBC_|PYTHON|CUDA_|TORCH|PYTORCH_"
    r"|NVIDIA_|HF_|TRANSFORMERS_)"
)
_MAX_SERVERS = 6
_PER_KEY = 2  # children measured at once from one environment (threads)
_START_TIMEOUT_S = 300.0


def enabled() -> bool:
    """Whether measuring children start warm (``FLEETFIT_WARM_CHILDREN=1`` on Linux)."""
    return os.environ.get(WARM_ENV) == "1" and sys.platform.startswith("linux")


# The server: imports, the map of its file-backed pages, then one fork per request.
# Requests and replies are JSON lines on its stdin and on a duplicate of its stdout.
_SERVER = r"""# fleetfit warm server
import ctypes, importlib, json, os, signal, struct, sys, traceback
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the caller
if os.getppid() != int(sys.argv[1]):
    os._exit(0)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller and its child
reply = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)
start_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
base_path = [p for p in sys.path if p and p not in start_path]
import torch, psutil
from memory.overhead import preload_runtime
preload_runtime()
libraries = tuple(sys.argv[2].split(","))

def file_pages():
    # [start, end) ranges of this process's file-backed pages that are mapped now
    out = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pm:
        for line in maps:
            f = line.split()
            if len(f) < 6 or not f[5].startswith("/") or "r" not in f[1]:
                continue
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            pm.seek(lo // 4096 * 8)
            data = pm.read((hi - lo) // 4096 * 8)
            n = len(data) // 8
            start = None
            for i, v in enumerate(struct.unpack(f"{n}Q", data)):
                if v >> 63:
                    if start is None:
                        start = i
                elif start is not None:
                    out.append((lo + start * 4096, lo + i * 4096))
                    start = None
            if start is not None:
                out.append((lo + start * 4096, lo + n * 4096))
    return out

def child(req):
    libc.prctl(1, signal.SIGKILL)  # end with the server
    signal.signal(signal.SIGINT, signal.default_int_handler)
    reply.close()
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    for name, target in (("out", 1), ("err", 2)):
        fd = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    path = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [""] + list(dict.fromkeys(path)) + [p for p in base_path if p not in path]
    importlib.invalidate_caches()
    if threads > 1:  # OpenMP's worker threads, started by torch's import in a fresh
        torch.set_num_threads(torch.get_num_threads())  # child; a fork has none
    for lo, hi in pages:  # map the pages a fresh child has mapped after its imports
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 22)  # POPULATE_READ
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts here, as a fresh child's starts at its birth
    sys.argv = req["argv"]
    space = {"__name__": "__main__"}
    exec(compile(req["code"], "<string>", "exec"), space)
    # only what the child imported before its baseline: a module imported by the
    # target itself is the target's growth, in a fresh child as here
    before = space.get("baseline_modules") or []
    with open(req["mods"], "w") as f:
        json.dump(sorted(m for m in before if m.split(".")[0] in libraries), f)

def learn(path):
    # import what the child imported from WARM_LIBRARIES: the next child finds it
    global pages
    try:
        with open(path) as f:
            names = [m for m in json.load(f) if m not in sys.modules]
    except (OSError, ValueError):
        return
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:
            pass
    if names:
        pages = file_pages()

pages = file_pages()
threads = len(os.listdir("/proc/self/task"))
reply.write(json.dumps({"ready": os.getpid()}) + "\n")
reply.flush()
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child(req)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n")
    reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    reply.flush()
    learn(req["mods"])
"""


class WarmTimeout(Exception):
    """The warm child ran past its timeout and was killed."""


@dataclass
class WarmResult:
    """What a warm child did: its exit code (negative: the signal that ended it)
    and what it wrote to standard error."""

    returncode: int
    stderr: str


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.lock = threading.Lock()
        self.owner = os.getpid()
        self._buf = b""
        self._log = tempfile.TemporaryFile(prefix="fleetfit-warm-")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(os.getpid()), ",".join(WARM_LIBRARIES)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
        )
        line = self._read(_START_TIMEOUT_S)
        if line is None or "ready" not in line:
            self.close()
            raise RuntimeError(f"the warm server did not start: {self._log_tail()}")

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace").strip() or "no output"

    def _read(self, timeout_s: float | None) -> dict[str, int] | None:
        # One JSON line from the server; None when none came within ``timeout_s``.
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if deadline is not None:
                left = max(deadline - time.monotonic(), 0)
                ready, _, _ = select.select([fd], [], [], left)
                if not ready:
                    return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the warm server ended")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(
        self,
        code: str,
        argv: list[str],
        env: dict[str, str],
        tmp: str,
        timeout_s: float,
    ) -> WarmResult:
        assert self.proc.stdin is not None
        err = os.path.join(tmp, "warm-stderr.txt")
        req = {
            "code": code,
            "argv": ["-c", *argv],
            "cwd": os.getcwd(),
            "env": env,
            "out": os.path.join(tmp, "warm-stdout.txt"),
            "err": err,
            "mods": os.path.join(tmp, "warm-modules.json"),
        }
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read(60.0)
        if pid is None:
            raise EOFError("the warm server did not fork")
        done = self._read(timeout_s)
        if done is None:
            try:
                os.kill(pid["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._read(60.0)
            raise WarmTimeout(f"ran past {timeout_s:g} s")
        with open(err, errors="replace") as f:
            stderr = f.read()
        return WarmResult(int(done["status"]), stderr)

    def close(self) -> None:
        if self.owner != os.getpid():  # inherited through a fork: the parent's
            return
        if self.proc.poll() is None:
            try:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


_servers: dict[tuple[object, ...], list[_Server]] = {}
_servers_lock = threading.Lock()


# Servers start from this one long-lived thread (created at the first start):
# PR_SET_PDEATHSIG fires when the thread that started a process ends.
_spawner = ThreadPoolExecutor(1, thread_name_prefix="fleetfit-warm-start")


def _project_root(env: dict[str, str]) -> str | None:
    # where a fresh child would import fleetfit's own ``memory`` package from
    for p in [os.getcwd(), *env.get("PYTHONPATH", "").split(os.pathsep)]:
        if p and os.path.isfile(os.path.join(p, "memory", "__init__.py")):
            return os.path.realpath(p)
    return None


def _key(env: dict[str, str]) -> tuple[object, ...]:
    # a sitecustomize on the path runs when a process starts: it is the server's
    hooks = tuple(
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p
        and any(
            os.path.exists(os.path.join(p, f))
            for f in ("sitecustomize.py", "usercustomize.py")
        )
    )
    start = tuple(
        sorted(
            (k, v) for k, v in env.items() if _START_KEYS.match(k) and k != "PYTHONPATH"
        )
    )
    return (sys.executable, os.getpid(), start, hooks, _project_root(env))


def server_pids() -> list[int]:
    """The process ids of this process's warm servers (long-lived by design)."""
    with _servers_lock:
        return [
            s.proc.pid
            for group in _servers.values()
            for s in group
            if isinstance(s, _Server) and s.alive
        ]


def close_all() -> None:
    """End every warm server of this process."""
    with _servers_lock:
        servers = [s for group in _servers.values() for s in group]
        _servers.clear()
    for s in servers:
        s.close()


atexit.register(close_all)


def _acquire(key: tuple[object, ...], env: dict[str, str]) -> _Server | None:
    # An idle server of this key, locked; a new one while the key has fewer than
    # _PER_KEY; None when all are busy or none can start.
    with _servers_lock:
        group = _servers.setdefault(key, [])
        for s in [s for s in group if not s.alive]:
            group.remove(s)
            s.close()
        for s in group:
            if s.lock.acquire(blocking=False):
                return s
        if len(group) >= _PER_KEY:
            return None
        while sum(map(len, _servers.values())) >= _MAX_SERVERS:
            old = next(k for k, g in _servers.items() if g)
            victim = next((s for s in _servers[old] if not s.lock.locked()), None)
            if victim is None:
                return None
            _servers[old].remove(victim)
            victim.close()
        placeholder = _Placeholder()
        group.append(placeholder)  # type: ignore[arg-type]
    try:
        # Started from one long-lived thread: PR_SET_PDEATHSIG fires when the
        # thread that started a process ends, and callers' threads come and go.
        server: _Server | None = _spawner.submit(_Server, env).result()
    except (OSError, RuntimeError, EOFError):
        server = None
    with _servers_lock:
        group = _servers.setdefault(key, [])
        if placeholder in group:
            group.remove(placeholder)  # type: ignore[arg-type]
        if server is not None:
            server.lock.acquire()
            group.append(server)
    return server


class _Placeholder:
    # A server being started: counts in its key's group, never idle.
    lock = threading.Lock()
    lock.acquire()
    alive = True
    proc = None

    def close(self) -> None:
        pass


def run_warm(
    code: str,
    argv: list[str],
    env: dict[str, str],
    tmp: str,
    timeout_s: float,
    kind: tuple[object, ...] = (),
) -> WarmResult | None:
    """Run the child ``code`` with ``argv`` forked from a warm server.

    Args:
        code: the Python source a fresh child would run with ``python -c``.
        argv: its arguments (``sys.argv[1:]``).
        env: its whole environment (``memory.measure.child_env``).
        tmp: a directory for its standard output and error files.
        timeout_s: kill the child after this many seconds.
        kind: what the child imports before its baseline (its target's module, its
            preloads, its warm-up): children of one kind share a server, so what a
            server learns from one (``WARM_LIBRARIES``) is what the next would import
            before its baseline anyway; another kind gets a server of its own.

    Returns:
        The exit code and standard error, or None where a warm start does not apply
        (the caller runs a fresh process instead): warm starts off, every server of
        this environment busy with other threads' children, or none could start.

    Raises:
        WarmTimeout: the child ran past ``timeout_s`` (it was killed).
    """
    if not enabled() or _project_root(env) is None:
        return None
    key = (*_key(env), kind)
    server = _acquire(key, env)
    if server is None:
        return None
    try:
        return server.run(code, argv, env, tmp, timeout_s)
    except (EOFError, OSError, ValueError):
        with _servers_lock:
            group = _servers.get(key, [])
            if server in group:
                group.remove(server)
        server.close()
        return None
    finally:
        server.lock.release()
