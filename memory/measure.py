"""Measure the real memory peak of a piece of training, in a fresh child process.

The figure a memory budget bounds (CPU): the peak resident set size (``VmHWM``) of the
whole run minus the resident set size right after the run's imports (torch and the
target's module), before the model exists. The child is started with the fixed glibc
setting ``MALLOC_MMAP_THRESHOLD_=65536``: allocations of 64 KiB and more get their own
mappings and go back to the kernel when freed, so a freed activation does not stay
resident and the figures do not mislead. The import baseline is reported separately.

On CUDA the figure is ``torch.cuda.max_memory_allocated()``, reported when the target
used CUDA.

The target is a module-level function (the child imports it by its
``module:qualname``, ``target_name``) or, for callers outside this package, that name
as a string.

Example:
    >>> from mypkg.jobs import train_steps  # doctest: +SKIP
    >>> m = measure_in_child(train_steps, {"steps": 3})  # doctest: +SKIP
    >>> m.peak_bytes, m.baseline_bytes, m.result["losses"]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import psutil

from memory import warmstart
from memory.errors import MeasurementError

MALLOC_MMAP_THRESHOLD = 65536
"""glibc's ``MALLOC_MMAP_THRESHOLD_`` in every measuring child, bytes."""

CHILD_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MALLOC_MMAP_THRESHOLD),
    "MKL_DISABLE_FAST_MM": "1",
}
"""Set in every measuring child unless the caller's ``env`` sets them.

``MKL_DISABLE_FAST_MM=1``: MKL frees its matrix-multiply work buffers when a call
ends instead of keeping them in its own pool. The pool is memory no tensor shows:
on a transformers T5 plan it held 8.4 MiB of a 116.6 MiB step (108.3 MiB without it,
measured side by side; 6% slower step), and how much it keeps depends on the CPU's
MKL code path, so a plan that fit on one machine crossed its budget on another."""


@dataclass(frozen=True)
class Measurement:
    """What one child run measured.

    Attributes:
        baseline_bytes: resident set size right after the imports (torch and the
            target's module), before the target ran.
        peak_bytes: peak resident set size of the process (``VmHWM``) minus
            ``baseline_bytes``: the figure a CPU memory budget bounds.
        result: the dict the target returned.
        wall_s: seconds the target itself ran (imports excluded).
        hwm_bytes: the raw ``VmHWM`` at the end, bytes.
        cuda_peak_bytes: ``torch.cuda.max_memory_allocated()`` when the target used
            CUDA, else None.
        stderr: what the child wrote to standard error (logs, warnings).
        file_baseline_bytes: file-backed resident memory (``RssFile``: code of
            shared libraries, mapped files) at the baseline, bytes.
        file_end_bytes: the same when the target returned, bytes. Its growth over
            the baseline is part of ``peak_bytes``: pages of library code touched
            for the first time and files the target mapped (a diagnostic: how many
            pages a first touch maps depends on the page cache, see
            docs/memory.md).
    """

    baseline_bytes: int
    peak_bytes: int
    result: dict[str, Any]
    wall_s: float
    hwm_bytes: int = 0
    cuda_peak_bytes: int | None = None
    stderr: str = field(default="", repr=False)
    file_baseline_bytes: int = 0
    file_end_bytes: int = 0

    @property
    def file_growth_bytes(self) -> int:
        """Growth of file-backed resident memory over the run, bytes."""
        return self.file_end_bytes - self.file_baseline_bytes


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise MeasurementError(f"/proc/self/status has no {key}: not a Linux process?")


_process: psutil.Process | None = None


def _this_process() -> psutil.Process:
    # Kept between calls (the memory guard samples every few ms), renewed after a fork.
    global _process
    if _process is None or _process.pid != os.getpid():
        _process = psutil.Process()
    return _process


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``), bytes."""
    return int(_this_process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``VmHWM``), bytes."""
    return _status_bytes("VmHWM")


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (writes 5 to clear_refs).

    For studying one step only: ``peak_rss_bytes()`` after the step minus
    ``rss_bytes()`` before it is that step's own peak. Never use it when checking a
    budget, which bounds the peak of the whole run (model construction included):
    a target measured by ``measure_in_child`` that calls it reports as ``peak_bytes``
    only what came after the reset.
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measuring child.

    The caller's environment, plus ``env``, with this process's working directory and
    ``sys.path`` prepended to ``PYTHONPATH`` (so the target imports as it does here)
    and ``CHILD_ENV`` (the allocators' settings) unless ``env`` sets them.
    """
    out = dict(os.environ)
    out.update(CHILD_ENV)
    out.update(env or {})
    paths = [os.getcwd()] + [p for p in sys.path if p]
    old = out.get("PYTHONPATH")
    if old:
        paths.append(old)
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out


Target = str | Callable[..., Any]
"""A measured child's function: a module-level function, or its ``"module:qualname"``."""


def target_name(target: Target) -> str:
    """The ``"module:qualname"`` a child imports ``target`` by.

    Raises:
        ValueError: a malformed name, or a function the child cannot import by name (a
            lambda, a nested function, one defined in ``__main__``, a bound method or
            a ``functools.partial``); one line naming it and the fix.
    """
    if isinstance(target, str):
        if target.count(":") != 1 or not all(target.split(":")):
            raise ValueError(
                f"target must be 'package.module:function', got {target!r}"
            )
        return target
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    fix = "define it at module level in an importable module"
    if not callable(target) or not module or not qualname:
        raise ValueError(
            f"a measuring child's target must be a function, got {target!r}; {fix}"
        )
    if "<lambda>" in qualname or "<locals>" in qualname:
        what = "a lambda" if qualname.endswith("<lambda>") else "a nested function"
        raise ValueError(
            f"the target {qualname} ({module}) is {what}: a measuring child imports "
            f"its target by name; {fix}"
        )
    if module == "__main__":
        raise ValueError(
            f"the target {qualname} is defined in __main__, which a measuring child "
            f"cannot import; {fix}"
        )
    found = _resolve(qualname, sys.modules.get(module))
    if found is None or found != target:
        raise ValueError(
            f"the target {qualname} is not {module}.{qualname} (a bound method, a "
            f"wrapped or replaced function?); {fix}"
        )
    return f"{module}:{qualname}"


def load_target(name: str) -> Callable[..., Any]:
    """The function a ``"module:qualname"`` (``target_name``) names, imported.

    Raises:
        ValueError: a malformed name or no such function (one line).
    """
    import importlib

    module = importlib.import_module(target_name(name).split(":")[0])
    found = _resolve(name.split(":")[1], module)
    if not callable(found):
        raise ValueError(f"{name!r} names no function")
    return found


def _resolve(qualname: str, module: Any) -> Any:
    try:
        return reduce(getattr, qualname.split("."), module)
    except AttributeError:
        return None


# The child: imports, baseline, the call, the peak; the answer goes to a file so that
# whatever the target prints cannot corrupt it.
_CHILD = r"""
import importlib, json, sys, time, traceback
out_path, target, kwargs_json = sys.argv[1], sys.argv[2], sys.argv[3]
preload = [m for m in sys.argv[4].split(",") if m] if len(sys.argv) > 4 else []
warmup = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
try:
    import torch
    import psutil  # memory.measure's: a target importing it counts it in the baseline
    from memory.overhead import preload_runtime
    preload_runtime()  # what the first training step would import lazily
    for name in preload:  # the user's libraries count in the baseline, as torch does
        importlib.import_module(name)
    def load(name):  # "module:qualname" -> the function
        mod, qual = name.split(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    if warmup:  # e.g. what a model's first construction imports lazily
        load(warmup[0])(**warmup[1])
    func = load(target)
    kwargs = json.loads(kwargs_json)
    baseline = status("VmRSS")
    baseline_modules = list(sys.modules)  # what a warm server may import for the next
    file_baseline = status("RssFile")
    t0 = time.perf_counter()
    result = func(**kwargs)
    wall = time.perf_counter() - t0
    if not isinstance(result, dict):
        raise TypeError(f"{target} returned {type(result).__name__}, not a dict")
    hwm = status("VmHWM")
    file_end = status("RssFile")
    cuda_peak = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_peak = int(torch.cuda.max_memory_allocated())
    answer = {"ok": True, "baseline": baseline, "hwm": hwm, "wall": wall,
              "cuda_peak": cuda_peak, "result": result,
              "file_baseline": file_baseline, "file_end": file_end}
    text = json.dumps(answer)
except BaseException:
    text = json.dumps({"ok": False, "traceback": traceback.format_exc()})
with open(out_path, "w") as f:
    f.write(text)
"""


def measure_in_child(
    target: Target,
    kwargs: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
    preload: tuple[str, ...] = (),
    warmup: tuple[Target, dict[str, Any]] | None = None,
) -> Measurement:
    """Run ``function(**kwargs)`` in a fresh Python process and measure its memory.

    The child imports torch and the target's module, records its RSS (the baseline),
    calls the function, then reads ``VmHWM``. Everything the function allocates,
    model construction included, counts in ``peak_bytes``.

    Args:
        target: a module-level function, importable in the child (``target_name``;
            ``"package.module:function"`` is accepted too); it takes JSON values and
            returns a JSON-serialisable dict.
        kwargs: keyword arguments for the function (JSON-serialisable).
        env: extra environment variables for the child (on top of this process's).
        timeout_s: kill the child after this many seconds.
        preload: modules to import before the baseline, like torch (e.g. the
            ``transformers`` a model needs): libraries, not the training.
        warmup: ``(function, kwargs)`` called before the baseline too, for library
            code that loads on first use (``memory.step.warm_up`` builds a model on
            the meta device: what its construction imports).

    Raises:
        ValueError: a target (or warm-up) the child cannot import by name, or
            ``kwargs`` that are not JSON-serialisable.
        MeasurementError: the child raised (its traceback is in the message), crashed,
            was killed, or ran past ``timeout_s``.
    """
    target = target_name(target)
    if warmup is not None:
        warmup = (target_name(warmup[0]), warmup[1])
    try:
        kwargs_json = json.dumps(kwargs or {})
    except TypeError as e:
        raise ValueError(f"kwargs for {target} must be JSON-serialisable: {e}") from e
    with tempfile.TemporaryDirectory(prefix="fleetfit-measure-") as tmp:
        out_path = os.path.join(tmp, "answer.json")
        argv = [out_path, target, kwargs_json, ",".join(preload)]
        argv.append(json.dumps(list(warmup) if warmup else None))
        full_env = child_env(env)
        try:
            kind = (target.split(":")[0], tuple(preload), warmup and warmup[0])
            warm = warmstart.run_warm(_CHILD, argv, full_env, tmp, timeout_s, kind)
        except warmstart.WarmTimeout as e:
            raise MeasurementError(
                f"{target} ran past its timeout of {timeout_s:g} s in the measuring child"
            ) from e
        if warm is not None:
            returncode, stderr = warm.returncode, warm.stderr
        else:
            try:
                proc = subprocess.run(
                    [sys.executable, "-c", _CHILD, *argv],
                    env=full_env,
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                )
            except subprocess.TimeoutExpired as e:
                raise MeasurementError(
                    f"{target} ran past its timeout of {timeout_s:g} s in the "
                    "measuring child"
                ) from e
            returncode, stderr = proc.returncode, proc.stderr or ""
        if not os.path.exists(out_path):
            raise MeasurementError(
                f"the measuring child of {target} exited with code {returncode} "
                f"without an answer (killed, out of memory?); its stderr ends:\n"
                f"{stderr[-4000:]}"
            )
        with open(out_path) as f:
            answer = json.load(f)
    if not answer["ok"]:
        raise MeasurementError(
            f"{target} failed in the measuring child:\n{answer['traceback']}"
        )
    baseline, hwm = int(answer["baseline"]), int(answer["hwm"])
    return Measurement(
        baseline_bytes=baseline,
        peak_bytes=hwm - baseline,
        result=answer["result"],
        wall_s=float(answer["wall"]),
        hwm_bytes=hwm,
        cuda_peak_bytes=answer["cuda_peak"],
        stderr=stderr,
        file_baseline_bytes=int(answer.get("file_baseline", 0)),
        file_end_bytes=int(answer.get("file_end", 0)),
    )
