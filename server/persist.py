"""The run folder, written atomically (write a temporary file, then ``os.replace``).

Layout (schema version 1, see docs/run-folder.md): ``summary.json``, ``summary.csv``,
``accuracy.png`` and ``model.safetensors`` at the top level.
"""

from __future__ import annotations

import csv
import io
import json
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_model(
    path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> None:
    """Save a state dict as safetensors with string metadata, atomically.

    Tied tensors are written once per key (copies), so any state dict saves.
    """
    tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


def write_summary(out: str | Path, summary: dict[str, Any]) -> None:
    """``summary.json`` and ``summary.csv`` (one row per round)."""
    out = Path(out)
    atomic_write_bytes(out / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    rounds = summary.get("rounds", [])
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
    atomic_write_bytes(out / CSV_FILE, buf.getvalue().encode())


def plot_rounds(out: str | Path, summary: dict[str, Any]) -> Path:
    """``accuracy.png``: central accuracy (and loss) per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = summary["rounds"]
    x = [r["round"] for r in rounds]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(x, [r["accuracy"] for r in rounds], marker="o", label="accuracy")
    ax.set_xlabel("round")
    ax.set_ylabel("central accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r["loss"] for r in rounds], color="tab:red", ls="--", label="loss")
    ax2.set_ylabel("central loss")
    ax.set_title(f"{summary.get('workload', '')}: central evaluation per round")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    path = Path(out) / PLOT_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


# ---------------------------------------------------------------- resume state
STATE_DIR = "state"
STATE_FILE = "state.json"
_MODEL_NAME = re.compile(r"^model-[0-9]+\.safetensors$")  # a plain name in state/


def save_state(
    out: str | Path,
    server_round: int,
    model_state: dict[str, torch.Tensor],
    summary: dict[str, Any],
    strategy: dict[str, Any],
) -> None:
    """Save what a resumed run needs after ``server_round``, atomically.

    The model goes to ``state/model-<round>.safetensors`` first; then ``state.json``
    (round, summary, strategy state, the model's file name) replaces the old one in
    one ``os.replace``; older model files are removed last. A crash at any point
    leaves a consistent pair: the old one or the new one.
    """
    d = Path(out) / STATE_DIR
    name = f"model-{server_round:06d}.safetensors"
    save_model(d / name, model_state, {"round": str(server_round)})
    state = {
        "schema": SCHEMA_VERSION,
        "round": server_round,
        "model": name,
        "summary": summary,
        "strategy": strategy,
    }
    atomic_write_bytes(d / STATE_FILE, json.dumps(state, indent=1).encode())
    for old in d.glob("model-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def load_state(
    out: str | Path,
) -> tuple[int, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]] | None:
    """``(round, model state, summary, strategy state)`` saved in ``out``, or None."""
    d = Path(out) / STATE_DIR
    path = d / STATE_FILE
    if not path.exists():
        return None
    fix = f"restore {d} from a backup, or move it away to start the run from round 1"
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); {fix}") from None
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
