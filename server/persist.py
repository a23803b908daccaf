"""The run folder, written atomically (write a temporary file, then ``os.replace``).

Layout (schema version 1, see docs/run-folder.md): ``summary.json``, ``summary.csv``,
``accuracy.png`` and ``model.safetensors`` at the top level.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

SCHEMA_VERSION = 1
MODEL_FILE = "model.safetensors"
SUMMARY_FILE = "summary.json"
CSV_FILE = "summary.csv"
PLOT_FILE = "accuracy.png"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never half."""
    with Staged() as staged:
        staged.bytes(path, data)


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN and infinities become ``None``,
    tuples lists, numpy and torch scalars numbers, bytes a short note, any other
    object its text. fleetfit writes no NaN or Infinity into a file."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", None) == 0:
        return json_safe(item())
    return str(value)[:300]


def json_bytes(value: Any, indent: int | None = 2) -> bytes:
    """Strict JSON (``allow_nan=False``) of ``json_safe(value)``."""
    return json.dumps(json_safe(value), indent=indent, allow_nan=False).encode()


def _temp_beside(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return tmp


def _write_model(
    tmp: str, state: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> None:
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    save_file(tensors, tmp, metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())


def save_model(
    path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> None:
    """Save a state dict as safetensors with string metadata, atomically.

    Tied tensors are written once per key (copies), so any state dict saves.
    """
    with Staged() as staged:
        staged.model(path, state, metadata)


class Staged:
    """Files written together: each is written in full to a temporary file beside
    its target first; only when every one is written are they moved into place
    (``os.replace``, in the order staged). A failure while writing (a value that
    cannot be serialised, a full disk) changes no file.

    >>> with Staged() as s:
    ...     s.bytes(out / "a.json", b"{}")
    ...     s.model(out / "m.safetensors", state, {"round": "3"})
    """

    def __init__(self) -> None:
        self._moves: list[tuple[str, Path]] = []

    def bytes(self, path: str | Path, data: bytes) -> None:
        tmp = _temp_beside(Path(path))
        self._moves.append((tmp, Path(path)))
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def model(
        self, path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> None:
        tmp = _temp_beside(Path(path))
        self._moves.append((tmp, Path(path)))
        _write_model(tmp, state, metadata)

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            for tmp, path in self._moves:
                os.replace(tmp, path)
            self._moves = []
            return
        for tmp, _ in self._moves:
            if os.path.exists(tmp):
                os.unlink(tmp)


class CheckpointError(ValueError):
    """A model or state file that cannot be read; the message names the file."""


def load_model(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A saved state dict and its metadata (no pickle involved).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is not a complete safetensors file (truncated, or
            written by something else, such as ``torch.save``'s pickle).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path)), metadata
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path} ({path.stat().st_size} bytes) is not a complete safetensors "
            f"file: {e}. It is truncated or was written by something else; fleetfit "
            "reads only safetensors (never pickle)"
        ) from e


def write_summary(
    out: str | Path, summary: dict[str, Any], staged: Staged | None = None
) -> None:
    """``summary.json`` (strict JSON: no NaN or Infinity) and ``summary.csv`` (one
    row per round), written with ``staged`` when given (moved into place with it)."""
    out = Path(out)
    if staged is None:
        with Staged() as own:
            write_summary(out, summary, own)
        return
    safe = json_safe(summary)
    staged.bytes(out / SUMMARY_FILE, json_bytes(safe))
    rounds = safe.get("rounds", [])
    columns: list[str] = []
    for r in rounds:
        columns += [
            k
            for k, v in r.items()
            if k not in columns and not isinstance(v, list | dict)
        ]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rounds:
        writer.writerow(r)
    staged.bytes(out / CSV_FILE, buf.getvalue().encode())


def rounds_figure(summary: dict[str, Any]) -> Any:
    """The figure of ``accuracy.png`` (a ``matplotlib.figure.Figure``, no pyplot).

    Left axis: the central metric per round, ``summary["metric_name"]``: accuracy
    (0 to 1) for classifiers, perplexity (log scale while it is positive) for language
    models, the figure the terminal table reports. Right axis: the central loss
    (classifiers only: a language model's is the log of its perplexity) and the
    clients' mean training loss where rounds have one. One legend names every line
    of both axes, below the plot; rounds are whole numbers on the x axis.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter, MaxNLocator

    rounds = summary["rounds"]
    metric = summary.get("metric_name") or "accuracy"
    x = [r["round"] for r in rounds]

    def values(key: str) -> list[float]:  # a missing figure (None) is a gap
        return [math.nan if r.get(key) is None else float(r[key]) for r in rounds]

    fig = Figure(figsize=(6.5, 4.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    ys = values(metric)
    ax.plot(x, ys, marker="o", color="tab:blue", label=f"central {metric}")
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    if metric == "accuracy":
        ax.set_ylim(0, 1)
    elif any(v > 0 for v in ys):
        ax.set_yscale("log")
        # plain numbers (20, 30), not 2x10^1; a narrow range labels minor ticks too
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    if x:  # half a round of margin: one or two rounds still get whole-number ticks
        ax.set_xlim(min(x) - 0.5, max(x) + 0.5)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    if metric == "accuracy":
        ax2.plot(
            x,
            values("loss"),
            color="tab:red",
            ls="--",
            marker="x",
            label="central loss",
        )
    if any(r.get("train_loss") is not None for r in rounds):
        ax2.plot(
            x,
            values("train_loss"),
            color="tab:orange",
            ls=":",
            marker=".",
            label="train loss (clients' mean)",
        )
    ax2.set_ylabel("loss")
    if not ax2.lines:
        ax2.set_axis_off()
    handles = ax.lines + ax2.lines
    fig.legend(
        handles,
        [str(h.get_label()) for h in handles],
        loc="outside lower center",
        ncols=len(handles),
        fontsize=8,
    )
    ax.set_title(f"{summary.get('workload', '')}: central evaluation per round")
    return fig


def plot_rounds(out: str | Path, summary: dict[str, Any]) -> Path:
    """``accuracy.png``: the central metric (and losses) per round; see
    ``rounds_figure``."""
    buf = io.BytesIO()
    rounds_figure(summary).savefig(buf, format="png")
    path = Path(out) / PLOT_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


# ---------------------------------------------------------------- resume state
STATE_DIR = "state"
STATE_FILE = "state.json"
_MODEL_NAME = re.compile(r"^model-[0-9]+\.safetensors$")  # a plain name in state/
_OPT_NAME = re.compile(r"^server-opt-[0-9]+\.safetensors$")


def save_state(
    out: str | Path,
    server_round: int,
    model_state: dict[str, torch.Tensor],
    summary: dict[str, Any],
    strategy: dict[str, Any],
    staged: Staged | None = None,
    server_opt: dict[str, torch.Tensor] | None = None,
) -> None:
    """Save what a resumed run needs after ``server_round``, atomically.

    The model goes to ``state/model-<round>.safetensors`` first (and the server
    optimiser's state, when given, to ``state/server-opt-<round>.safetensors``); then
    ``state.json`` (round, summary, strategy state, the files' names) replaces the old
    one in one ``os.replace``; older files are removed last. A crash at any point
    leaves a consistent set: the old one or the new one. With ``staged``, all are
    moved into place with the caller's other files (``save_round``).
    """
    d = Path(out) / STATE_DIR
    name = f"model-{server_round:06d}.safetensors"
    state = {
        "schema": SCHEMA_VERSION,
        "round": server_round,
        "model": name,
        "summary": summary,
        "strategy": strategy,
    }
    opt_name = f"server-opt-{server_round:06d}.safetensors"
    if server_opt is not None:
        state["server_opt"] = opt_name
    if staged is None:
        with Staged() as own:
            save_state(
                out, server_round, model_state, summary, strategy, own, server_opt
            )
        remove_old_state_models(out, server_round)
        return
    staged.model(d / name, model_state, {"round": str(server_round)})
    if server_opt is not None:
        staged.model(d / opt_name, server_opt, {"round": str(server_round)})
    staged.bytes(d / STATE_FILE, json_bytes(state, indent=1))


def remove_old_state_models(out: str | Path, server_round: int) -> None:
    """Remove the model (and server optimiser) files of ``state/`` other than
    ``server_round``'s."""
    keep = f"-{server_round:06d}.safetensors"
    d = Path(out) / STATE_DIR
    for pattern in ("model-*.safetensors", "server-opt-*.safetensors"):
        for old in d.glob(pattern):
            if not old.name.endswith(keep):
                old.unlink(missing_ok=True)


def save_round(
    out: str | Path,
    server_round: int,
    model_state: dict[str, torch.Tensor],
    model_metadata: dict[str, Any],
    summary: dict[str, Any],
    strategy: dict[str, Any],
    server_opt: dict[str, torch.Tensor] | None = None,
) -> None:
    """The run folder after ``server_round``: the resume state (with the server
    optimiser's, ``server_opt``, when given), ``model.safetensors``,
    ``summary.json`` and ``summary.csv``, all naming that round.

    Every file is written in full before any is moved into place (``Staged``), so a
    fault while writing (a value that cannot be serialised, a full disk) leaves the
    folder at the previous round, all files agreeing. The resume state moves first:
    a crash between the moves leaves it ahead, and the next round rewrites the rest.
    """
    out = Path(out)
    with Staged() as staged:
        save_state(
            out, server_round, model_state, summary, strategy, staged, server_opt
        )
        staged.model(out / MODEL_FILE, model_state, model_metadata)
        write_summary(out, summary, staged)
    remove_old_state_models(out, server_round)


def _read_state_file(out: str | Path) -> tuple[Path, Path, Any, str] | None:
    """``(state folder, state.json, its parsed JSON, the fix for a bad one)``, or None
    where ``out`` has no resume state.

    Raises:
        CheckpointError: state.json is not valid JSON.
    """
    d = Path(out) / STATE_DIR
    path = d / STATE_FILE
    if not path.exists():
        return None
    fix = f"restore {d} from a backup, or move it away to start the run from round 1"
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {fix}") from None
    return d, path, state, fix


def load_state(
    out: str | Path,
) -> tuple[int, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]] | None:
    """``(round, model state, summary, strategy state)`` saved in ``out``, or None."""
    read = _read_state_file(out)
    if read is None:
        return None
    d, path, state, fix = read
    ok = (
        isinstance(state, dict)
        and type(state.get("round")) is int
        and state["round"] >= 1
        and isinstance(state.get("model"), str)
        and _MODEL_NAME.match(state["model"]) is not None
        and isinstance(state.get("summary"), dict)
        and isinstance(state.get("strategy", {}), dict)
    )
    if not ok:
        raise CheckpointError(
            f"{path} is not a fleetfit state file (expected round >= 1, "
            f"model-<round>.safetensors, summary, strategy); {fix}"
        )
    try:
        model, meta = load_model(d / state["model"])
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(f"{e}; {fix}") from e
    if meta.get("round") != str(state["round"]):
        raise CheckpointError(
            f"{d}: state.json says round {state['round']} but its model file says "
            f"{meta.get('round')!r}; the state folder was edited by hand; {fix}"
        )
    return state["round"], model, state["summary"], state.get("strategy", {})


def load_server_opt_state(out: str | Path) -> dict[str, torch.Tensor] | None:
    """The server optimiser's state saved with ``out``'s resume state (exact tensors),
    or None where none was saved (a fedavg run, or a run from before it was kept)."""
    read = _read_state_file(out)
    if read is None:
        return None
    d, path, state, fix = read
    name = state.get("server_opt") if isinstance(state, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or _OPT_NAME.match(name) is None:
        raise CheckpointError(
            f"{path}: server_opt={name!r} is not a server-opt-<round>.safetensors "
            f"name; {fix}"
        )
    try:
        tensors, meta = load_model(d / name)
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(f"{e}; {fix}") from e
    if meta.get("round") != str(state.get("round")):
        raise CheckpointError(
            f"{d}: state.json says round {state.get('round')} but {name} says "
            f"{meta.get('round')!r}; the state folder was edited by hand; {fix}"
        )
    return tensors
