"""This machine's rates that a plan's times depend on: the matmul rate and disk bandwidth.

``measure_flops_per_s()`` times a few fp32 matmuls (the rate behind every time derived
from FLOPs); ``measure_disk_bandwidth(dir)`` writes (with fsync) and reads back a short
file in the offload directory. Both are kept for the life of the process and in the
machine cache (``memory.machine``), so the same command plans the same on a busy machine.

Example:
    >>> measure_flops_per_s()  # doctest: +SKIP
    61234567890.1
    >>> measure_disk_bandwidth("/tmp/offload").read_bytes_per_s  # doctest: +SKIP
    1.8e9
"""

from __future__ import annotations

import os
import tempfile
import time

import torch

from memory.machine import cached
from memory.profile import DiskBandwidth

_RATE_CACHE: dict[str, float] = {}
_DISK_CACHE: dict[str, DiskBandwidth] = {}


def measure_flops_per_s(size: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate, FLOP/s: the fastest of a few timed matmuls
    (other work on the machine only slows some of them), kept in the machine cache
    (``memory.machine``) so that plans do not drift between runs."""
    if "cpu" in _RATE_CACHE:
        return _RATE_CACHE["cpu"]

    def probe() -> float:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        a @ b  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return 2 * size**3 / min(times)

    rate = float(cached(f"matmul_flops_per_s_{size}", probe))
    _RATE_CACHE["cpu"] = rate
    return rate


def measure_disk_bandwidth(
    directory: str | os.PathLike | None = None, nbytes: int = 64 * 2**20
) -> DiskBandwidth:
    """Sequential write (with fsync) and read (page cache dropped) bandwidth.

    A short probe in ``directory`` (default: the system's temporary directory), the
    probe file removed; kept per directory for the life of the process and in the
    machine cache (``memory.machine``).
    """
    path = os.path.realpath(os.fspath(directory or tempfile.gettempdir()))
    if path in _DISK_CACHE:
        return _DISK_CACHE[path]
    os.makedirs(path, exist_ok=True)
    key = f"disk_bytes_per_s {path} {nbytes}"
    bw = DiskBandwidth(path, *cached(key, lambda: _disk_probe(path, nbytes)))
    _DISK_CACHE[path] = bw
    return bw


def _disk_probe(path: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes per second of ``path``."""
    chunk = os.urandom(min(nbytes, 4 * 2**20))
    fd, probe = tempfile.mkstemp(prefix=".fleetfit-bw-", dir=path)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, len(chunk)):
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(probe)
    return written / max(read_s, 1e-9), written / max(write_s, 1e-9)
