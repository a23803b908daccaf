"""What a run starts from: the run config's ``init-model`` and a resumed run's saved
state, read and checked in one place.

The ServerApp (``server.loop.Federation``) loads both with these functions, and
``fleetfit server`` (and ``fleetfit simulate``, before Ray) calls ``check_start`` first,
so that a missing or damaged file, a model of another workload, a NaN weight or a
resume under other settings is one line naming the file and the fix before the
SuperLink starts, not a ServerApp traceback after the run has begun::

    cfg = check_run_config(run_config)      # keys, values, the workload
    check_start(cfg)                        # init-model and --resume, same code as the app
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server import persist
from server.config import ServerConfig
from server.fedopt import ServerOptimizer

log = logging.getLogger(__name__)

RESUME_KEYS = ("workload", "seed", "batch-size", "seq-len", "server-opt")
"""Run-config keys a resumed run must share with the run it continues."""


def read_init_model(path: str) -> dict[str, torch.Tensor]:
    """The tensors of run-config ``init-model=path``: a complete safetensors file
    whose floating-point values are all finite.

    Raises:
        ValueError: no such file, not safetensors, or a NaN or infinite value (one
            line naming the file, the tensor and the fix).
    """
    try:
        state, _ = persist.load_model(path)
    except (FileNotFoundError, persist.CheckpointError) as e:
        raise ValueError(
            f"run-config init-model={path!r} is invalid: {e}; give a safetensors "
            "file of this workload's model, or '' to start from scratch"
        ) from None
    for key, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"run-config init-model={path!r}: tensor {key!r} holds {bad} NaN or "
                f"infinite value(s) of {t.numel()}; a model trained from it would be "
                "NaN too: give a finite model (an earlier round's), or '' to start "
                "from scratch"
            )
    return state


def load_init_model(model: nn.Module, path: str, workload: str) -> None:
    """Start ``model`` from the weights in ``path`` (run-config ``init-model``).

    Raises:
        ValueError: as ``read_init_model``, or another model's keys or shapes
            (naming the file and the fix).
    """
    state = read_init_model(path)
    _load(
        model,
        state,
        f"run-config init-model={path!r} does not fit {workload}",
        ": give a model of this workload",
    )
    log.info("model starts from %s", path)


def load_resume(
    cfg: ServerConfig, model: nn.Module, server_opt: ServerOptimizer
) -> tuple[int, dict[str, Any]] | None:
    """Load ``cfg.out``'s resume state into ``model`` and ``server_opt``:
    ``(saved round, saved summary)``, or None where the folder holds no state.

    Raises:
        CheckpointError: the state folder is damaged (naming the file and the fix).
        ValueError: the saved run had another workload, seed, batch shape or server
            optimiser, or its model does not fit this one.
    """
    out = Path(cfg.out)
    saved = persist.load_state(out)
    if saved is None:
        return None
    server_round, state, summary, _strategy = saved
    old = summary.get("config", {})
    new = cfg.to_run_config()
    fix = "run with the settings it was started with, or give another --out"
    for key in RESUME_KEYS:
        if isinstance(old, dict) and key in old and old[key] != new[key]:
            raise ValueError(
                f"cannot resume {out}: it was run with {key}={old[key]!r}, this run "
                f"has {key}={new[key]!r}; {fix}"
            )
    _load(
        model,
        state,
        f"cannot resume {out}: its saved model does not fit {cfg.shape.workload}",
        f"; {fix}",
    )
    if server_opt.active:
        opt_state = persist.load_server_opt_state(out)
        if opt_state is None:
            log.warning(
                "resume: %s holds no server optimiser state; %s starts afresh",
                out,
                cfg.server_opt.name,
            )
        else:
            try:
                server_opt.load_state_dict(opt_state)
            except ValueError as e:
                raise ValueError(f"cannot resume {out}: {e}; {fix}") from None
    return server_round, summary


def check_start(cfg: ServerConfig) -> None:
    """Read and check what the run starts from (``init-model``, the resume state) as
    the ServerApp will, on a model skeleton (a built-in's on the ``meta`` device: no
    weights are made); nothing is written.

    Raises:
        ValueError: as ``load_init_model`` and ``load_resume``.
    """
    if not cfg.init_model and not cfg.resume:
        return
    workload = cfg.load_workload()
    if workload.kind == "custom":
        model = workload.make_model(cfg.shape.seed)  # user code: not on meta
    else:
        with torch.device("meta"):
            model = workload.factory()
    if cfg.init_model:
        load_init_model(model, cfg.init_model, cfg.shape.workload)
    if cfg.resume:
        names = (
            n
            for n, p in model.named_parameters(remove_duplicate=False)
            if p.is_floating_point()
        )
        load_resume(cfg, model, ServerOptimizer(cfg.server_opt, names))


def _load(
    model: nn.Module, state: dict[str, torch.Tensor], mismatch: str, fix: str
) -> None:
    """``load_state_dict`` (strict); a skeleton on ``meta`` takes the tensors as
    they are (same checks of keys and shapes, nothing copied).

    Raises:
        ValueError: another model's keys or shapes: ``mismatch (what differs)fix``.
    """
    on_meta = any(t.is_meta for t in model.state_dict().values())
    try:
        model.load_state_dict(state, assign=on_meta)
    except RuntimeError as e:
        raise ValueError(f"{mismatch} ({_one_line(e)}){fix}") from None


def _one_line(e: BaseException) -> str:
    """``load_state_dict``'s message (a header line, then one per fault) as one line."""
    lines = str(e).splitlines()
    text = " ".join(" ".join(lines[1:] or lines).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
