"""What this machine measured, kept on disk so that the same command plans the same.

A plan depends on three figures the machine measures: the matmul rate (unit times from
FLOPs), the disk bandwidth of the offload directory and torch's fixed runtime cost.
Measured anew in every process they drift, most of all while other work loads the
machine, and so do the plans. ``cached(name, measure)`` measures a figure once and keeps
it in ``$FLEETFIT_CACHE_DIR/machine.json`` (default ``~/.cache/fleetfit``) under a key
of this machine: host, processor, torch version and thread count, so a figure is not
reused on other hardware or another thread setting. Delete the file (or set
``FLEETFIT_CACHE_DIR`` elsewhere) to measure again; ``FLEETFIT_NO_CACHE=1`` measures
every time. A cache that cannot be read or written is ignored (a warning), never an
error.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def cache_path() -> Path:
    """The cache file (``$FLEETFIT_CACHE_DIR/machine.json``)."""
    root = os.environ.get("FLEETFIT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "fleetfit"
    )
    return Path(root) / "machine.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """This machine as the cache knows it."""
    import torch

    return (
        f"{platform.node()}|{_cpu_model()}|{os.cpu_count()}|torch {torch.__version__}"
        f"|{torch.get_num_threads()} threads"
    )


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the machine cache %s (%s)", path, e)
        return {}


def cached(name: str, measure: Callable[[], Any]) -> Any:
    """``measure()``'s value for ``name`` on this machine, measured once and kept."""
    if os.environ.get("FLEETFIT_NO_CACHE") == "1":
        return measure()
    path = cache_path()
    key = machine_key()
    data = _load(path)
    entry = data.get(key, {})
    if isinstance(entry, dict) and name in entry:
        return entry[name]
    value = measure()
    entry = dict(entry) if isinstance(entry, dict) else {}
    entry[name] = value
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("cannot keep machine figures in %s (%s)", path, e)
    return value
