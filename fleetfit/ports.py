"""Who holds a TCP port: ``fleetfit server``'s check before it starts, and its proof
that the SuperLink it talks to is the one it started.

    holder("127.0.0.1", 9091)  # None, or e.g. "pid 5292 (flower-superlink ...)"
    not_owned("127.0.0.1", 9091, [superlink.pid])  # None: it is ours

A port is busy when binding it fails (``EADDRINUSE``): that is what the SuperLink or
nginx would meet. The holder is found among the listening sockets that psutil reads
from ``/proc``; another user's sockets show no pid to a user who is not root, and are
described as such.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Iterable
from typing import Any

import psutil

WILDCARDS = ("0.0.0.0", "::")
CMDLINE_CHARS = 100  # how much of a holder's command line a message shows


def addresses(host: str) -> list[str]:
    """The IP addresses ``host`` (an address, ``localhost`` or a wildcard) binds."""
    host = host.strip("[]")
    if host in ("", "*"):
        return ["0.0.0.0"]
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos})


def in_use(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something holds it. Only
    ``EADDRINUSE`` counts: a privileged port or an address this machine lacks is for
    the server itself to report."""
    for ip in addresses(host):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As uvicorn and nginx bind: a port in TIME_WAIT is free, and an IPv6
            # wildcard does not take the IPv4 one.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((ip, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


def _ip(address: str) -> str:
    return address[len("::ffff:") :] if address.startswith("::ffff:") else address


def listeners(host: str, port: int) -> list[Any]:
    """The listening TCP sockets that take ``host:port`` from a server that binds
    it: on one of its addresses, or on a wildcard address (or, for a wildcard
    ``host``, on any address)."""
    wanted = {_ip(ip) for ip in addresses(host)}
    wildcard = bool(wanted & set(WILDCARDS))
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        ip, at = _ip(conn.laddr.ip), conn.laddr.port
        if at == port and (wildcard or ip in wanted or ip in WILDCARDS):
            found.append(conn)
    return found


def describe(pid: int | None, arguments: bool = True) -> str:
    """``pid 5292 (flower-superlink --host ...)``: a process for a one-line message,
    its command line shortened (``arguments=False``: its program only); a process
    whose fleetfit server is known says so."""
    if pid is None:
        return "a process of another user (run as root, or ask `ss -ltnp`, to see it)"
    try:
        proc = psutil.Process(pid)
        words = proc.cmdline() or [proc.name()]
    except psutil.Error:
        return f"pid {pid}"
    if len(words) > 1 and os.path.basename(words[0]).startswith("python"):
        words = words[1:]  # a Python program: its script or module says what it is
        while len(words) > 1 and words[0].startswith("-") and words[0] != "-m":
            words = words[1:]
        if words[0] == "-m":
            words = words[1:]
    words = [os.path.basename(words[0]), *words[1:]]
    line = " ".join(words if arguments else words[:1])
    if len(line) > CMDLINE_CHARS:
        line = line[: CMDLINE_CHARS - 3] + "..."
    server = _fleetfit_server(proc)
    owner = f", started by fleetfit server pid {server}" if server else ""
    return f"pid {pid} ({line}{owner})"


def _fleetfit_server(proc: psutil.Process) -> int | None:
    """The pid of the ``fleetfit server`` whose supervisor started ``proc``, if any
    (``fleetfit.supervise``: the supervisor's parent, while it lives)."""
    try:
        for parent in proc.parents():
            if any(w.endswith("supervise.py") for w in parent.cmdline()):
                command = parent.parent()
                return command.pid if command is not None else None
    except psutil.Error:
        pass
    return None


def holder(host: str, port: int) -> str | None:
    """What holds ``host:port`` (``describe``'s words), or None when it is free."""
    if not in_use(host, port):
        return None
    pids = sorted({c.pid for c in listeners(host, port)}, key=lambda p: p or 0)
    if not pids:
        return "a socket this user cannot see (run as root, or ask `ss -ltnp`)"
    return ", ".join(describe(pid) for pid in pids)


def free_port_near(host: str, port: int, skip: Iterable[int] = ()) -> int:
    """The first free port after ``port`` (not one of ``skip``), for a message's
    example; an ephemeral one when the next 100 are all taken."""
    for candidate in range(port + 1, min(port + 101, 65536)):
        if candidate not in skip and not in_use(host, candidate):
            return candidate
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def not_owned(host: str, port: int, pids: Iterable[int]) -> str | None:
    """Why ``host:port`` is not served by the processes ``pids`` (or their
    descendants), in words; None when every socket listening there is theirs.

    ``fleetfit server`` asks this of its SuperLink before it sends it anything: a
    second SuperLink on a port already taken fails to bind while the first one
    answers the health check."""
    ours: set[int] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            ours |= {pid, *(p.pid for p in proc.children(recursive=True))}
        except psutil.Error:
            continue
    found = listeners(host, port)
    if not found:
        return "nothing listens there"
    foreign = sorted({c.pid for c in found if c.pid not in ours}, key=lambda p: p or 0)
    if foreign:
        return "it is held by " + ", ".join(describe(p) for p in foreign)
    return None
