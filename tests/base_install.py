"""A base install (no extra) in subprocesses, without a second install.

``extra_only_modules()`` is every top-level module that only an extra of
pyproject.toml installs: the dependency closure of the extras (``hf``, ``dev`` and any
later one) minus the closure of the base dependencies, read from the installed
distributions' metadata, mapped to the modules each distribution provides. ``env()``
puts ``tests/base_install_site`` first on ``PYTHONPATH``: its ``sitecustomize`` hides
every such module where pip installs it (``ModuleNotFoundError: No module named
'peft'``, ``find_spec`` None, as on a base install; a copy a package vendors, as Ray's
runtime-env agent vendors aiohttp, still imports) in every Python process started with
that environment and in every process those start (Flower's SuperNode -> ClientApp,
Ray's workers, the measuring child), since they inherit it. A process the blocker reached appends a
line to ``log`` (``<pid> loaded <command line>``; ``<pid> blocked <module>`` for
every lookup it refused), so a test can show the blocker was there (``reached``).

Example:
    >>> subprocess.run([sys.executable, "-m", "fleetfit.cli", "simulate"],
    ...                env=env(log=tmp_path / "blocker.log"))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(__file__).with_name("base_install_site")
BLOCK_ENV = "FLEETFIT_TEST_BLOCK_MODULES"  # comma-separated top-level modules
LOG_ENV = "FLEETFIT_TEST_BLOCK_LOG"  # where the blocker notes what it did


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def extras() -> dict[str, list[Requirement]]:
    """pyproject.toml's extras: name -> its requirements."""
    table = pyproject()["project"].get("optional-dependencies", {})
    return {name: [Requirement(r) for r in reqs] for name, reqs in table.items()}


def closure(requirements: Iterable[Requirement]) -> set[str]:
    """The distributions (canonical names) ``requirements`` pull in, transitively,
    with the extras each requirement names (``flwr[simulation]``), as installed here
    (a distribution not installed ends its branch)."""
    asked: dict[str, set[str]] = {}  # distribution -> the extras asked of it
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        first = name not in asked
        new = set(req.extras) - asked.setdefault(name, set())
        if not first and not new:
            continue
        asked[name] |= new
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        evaluated = ({""} if first else set()) | new  # "": the requirement itself
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None:
                if first:
                    todo.append(dep)
            elif any(dep.marker.evaluate({"extra": e}) for e in evaluated):
                todo.append(dep)
    return set(asked)


def module_owners() -> dict[str, set[str]]:
    """Top-level module -> the installed distributions (canonical) providing it."""
    return {
        module: {canonicalize_name(d) for d in dists}
        for module, dists in md.packages_distributions().items()
    }


@functools.cache
def extra_only_modules() -> frozenset[str]:
    """Every top-level module only an extra installs (see the module docstring)."""
    base = closure(Requirement(r) for r in pyproject()["project"]["dependencies"])
    only = closure(r for reqs in extras().values() for r in reqs) - base
    owners = module_owners()
    installed = {d for ds in owners.values() for d in ds}
    return frozenset(
        module
        for module, dists in owners.items()
        if dists <= only and re.fullmatch(r"[A-Za-z_]\w*", module)
    ) | {d.replace("-", "_") for d in only - installed}  # not here: its likely name


def env(
    base: Mapping[str, str] | None = None, *, log: Path | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) as a base install: the extras'
    modules blocked, the blocker first on ``PYTHONPATH`` (then ``ROOT``, then
    ``base``'s own entries), what it did noted in ``log``."""
    out = dict(os.environ if base is None else base)
    paths = [str(SITE), str(ROOT)]
    paths += [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    out[BLOCK_ENV] = ",".join(sorted(extra_only_modules()))
    # measuring children as a user's install starts them, fresh (the warm server,
    # memory.warmstart, is the suite's): each one shows in ``log`` by its target
    out["FLEETFIT_WARM_CHILDREN"] = "0"
    if log is not None:
        out[LOG_ENV] = str(log)
    return out


def reached(log: Path) -> list[str]:
    """The command lines of the processes the blocker was in (``-c`` code shown as
    ``<code>``; each argument cut at 160 characters, the line at 600)."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [line.split(" loaded ", 1)[1] for line in lines if " loaded " in line]
