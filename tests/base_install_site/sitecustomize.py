"""Test-only (``tests/base_install.py``): in this process, the top-level modules named
in ``FLEETFIT_TEST_BLOCK_MODULES`` are not found where pip installs them (the
site-packages folders), as on an install without them (``import peft``:
``ModuleNotFoundError: No module named 'peft'``; ``importlib.util.find_spec("peft")``:
None). A copy a package vendors in a folder of its own (Ray's runtime-env agent puts
its aiohttp first on ``sys.path``) is still found, as it would be. What the blocker
did is appended to ``FLEETFIT_TEST_BLOCK_LOG``. Python imports this module at start-up
because its folder is first on ``PYTHONPATH``."""

from __future__ import annotations

import os
import site
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

BLOCKED = frozenset(
    filter(None, os.environ.get("FLEETFIT_TEST_BLOCK_MODULES", "").split(","))
)
SITE_DIRS = {Path(p).resolve() for p in site.getsitepackages()}


def note(what: str) -> None:
    path = os.environ.get("FLEETFIT_TEST_BLOCK_LOG")
    if path:
        with open(path, "a") as f:  # one short write: lines of processes do not mix
            f.write(f"{os.getpid()} {what}\n")


def installed_by_pip(spec: ModuleSpec) -> bool:
    """Whether a top-level module's spec is one in a site-packages folder."""
    places = [spec.origin] if spec.origin and spec.has_location else []
    places += list(spec.submodule_search_locations or [])  # a package's folder
    return any(Path(p).resolve().parent in SITE_DIRS for p in places) or any(
        Path(p).resolve().parent.parent in SITE_DIRS
        for p in places
        if Path(p).name == "__init__.py"
    )


class Hidden(MetaPathFinder):
    """A finder of ``sys.meta_path`` that does not find the blocked modules."""

    def __init__(self, finder: Any) -> None:
        self.finder = finder

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        spec = self.finder.find_spec(fullname, path, target)
        if spec is not None and fullname in BLOCKED and installed_by_pip(spec):
            note(f"blocked {fullname}")
            return None
        return spec

    def __getattr__(self, name: str) -> Any:  # invalidate_caches, find_distributions
        return getattr(self.finder, name)


class Guard(MetaPathFinder):
    """First on ``sys.meta_path``: hides the blocked modules from finders added
    since start-up too."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname in BLOCKED:
            hide()
        return None


def hide() -> None:
    for i, finder in enumerate(sys.meta_path):
        if not isinstance(finder, Hidden | Guard):
            sys.meta_path[i] = Hidden(finder)


if BLOCKED:
    hide()
    sys.meta_path.insert(0, Guard())
    try:  # sys.argv is not set yet
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        argv = sys.argv
    shown = [
        "<code>" if i and argv[i - 1] == "-c" else a[:160] for i, a in enumerate(argv)
    ]
    note(f"loaded {' '.join(shown)[:600]}".replace("\n", " "))
