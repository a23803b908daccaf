"""Checks of the ``fleetfit`` commands' values: each names the bad value and the fix.

The options themselves, with their types and defaults, are in ``fleetfit.options``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def positive_float(text: str) -> float:
    """A finite number above zero (``ValueError`` naming the value otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{value:g} must be a positive number")
    return value


# Paths: checked before any work or process starts; each raises ValueError naming the
# flag, the path and the fix (``fleetfit.cli`` prints it as one line, exit 2).


def _write_problem(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder`` (None: it can). A probe file is
    created and removed: root writes through mode bits, a read-only mount or /proc
    does not."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".fleetfit-probe-", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return None


def output_dir(flag: str, path: str | Path) -> Path:
    """Folder ``path`` made (parents too) and checked writable.

    Raises:
        ValueError: it is a file, cannot be made, or cannot be written.
    """
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{flag} {str(path)!r} cannot be created ({e.strerror or e}); give a "
            "folder you can write, e.g. under your home or /tmp"
        ) from None
    problem = _write_problem(folder)
    if problem is not None:
        raise ValueError(
            f"{flag} {str(path)!r} is not writable ({problem}); give a folder you "
            "can write, e.g. under your home or /tmp"
        )
    return folder


def output_file(flag: str, path: str | Path, example: str) -> Path:
    """File ``path`` to be written: not a folder, in a folder that can be written,
    made if missing (``example``: a file name for the fix, e.g.
    ``"model.safetensors"``).

    Raises:
        ValueError: it is a folder, or its folder cannot be made or written.
    """
    file = Path(path).expanduser()
    if file.is_dir():
        raise ValueError(
            f"{flag} {str(path)!r} is a folder; give a file path, e.g. {file / example}"
        )
    folder = file.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{flag} {str(path)!r}: folder {str(folder)!r} cannot be made "
            f"({e.strerror or e}); give a path in a folder you can write"
        ) from None
    problem = _write_problem(folder)
    if problem is not None:
        raise ValueError(
            f"{flag} {str(path)!r}: folder {str(folder)!r} is not writable "
            f"({problem}); give a path in a folder you can write"
        )
    return file


def input_file(flag: str, path: str | Path, what: str) -> bytes:
    """The bytes of file ``path`` (``what`` it should be, for the message).

    Raises:
        ValueError: it is missing, a folder, or cannot be read.
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(
            f"{flag} {str(path)!r} does not exist; give the path of {what}"
        )
    if file.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give the path of {what}")
    try:
        return file.read_bytes()
    except OSError as e:
        raise ValueError(
            f"{flag} {str(path)!r} cannot be read ({e.strerror or e}); give {what} "
            "that this user can read (check its permissions)"
        ) from None
