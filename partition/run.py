"""Train a workload for a few steps under a memory plan, or plainly: the function that
``fleetfit memory run`` executes in a measured child process.

The batches are drawn by the caller and handed over in a safetensors file, so the child
holds exactly what a training job holds (model, optimizer state, the batch), not the
dataset they were drawn from.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memory.spec import MemoryPlan
from memory.tensorfile import TensorFile
from partition.local import LocalExecutor
from workloads import get_workload


def save_batches(
    path: str | Path, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Write ``batches`` for ``train_workload``."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (x, y) in enumerate(batches):
        tensors[f"inputs.{i}"] = x.contiguous()
        tensors[f"targets.{i}"] = y.contiguous()
    save_file(tensors, str(path))


def save_initial_state(
    workload: str,
    path: str | Path,
    *,
    seed: int = 0,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Write ``make_model(seed)``'s parameters and buffers for ``init_file``."""
    model = get_workload(workload, batch_size=batch_size, seq_len=seq_len).make_model(
        seed
    )
    _save(str(path), model.state_dict())


def train_workload(
    workload: str,
    batches_file: str,
    *,
    plan: dict[str, Any] | None = None,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    offload_dir: str | None = None,
    save: str | None = None,
    threads: int | None = None,
    init_file: str | None = None,
) -> dict[str, Any]:
    """Train ``workload`` on the batches in ``batches_file``, one step per batch.

    Args:
        workload: built-in name or ``module:function``.
        batches_file: safetensors file from ``save_batches``.
        plan: a ``MemoryPlan.to_dict()``; None trains plainly (torch AdamW).
        seed: model initialisation seed.
        lr: AdamW learning rate (other AdamW settings: torch's defaults).
        offload_dir: where a plan's files go (default: the system temporary directory).
        save: write the final parameters and buffers to this safetensors file.
        threads: torch intra-op threads (None: torch's default).
        init_file: with a plan, load the initial weights block by block from this
            safetensors file (``save_initial_state``) instead of building them: the model
            is built on the meta device, so streamed blocks never exist in memory all at
            once. The weights equal ``make_model(seed)``'s.

    Returns:
        ``{"losses": [...], "step_times_s": [...], "step_s": median after the first}``.
    """
    if threads:
        torch.set_num_threads(threads)
    wl = get_workload(workload, batch_size=batch_size, seq_len=seq_len)
    data = load_file(batches_file)
    steps = sum(1 for k in data if k.startswith("inputs."))
    if init_file is not None and plan is not None:
        with torch.device("meta"):
            model = wl.make_model(seed)
    else:
        model = wl.make_model(seed)
    losses: list[float] = []
    times: list[float] = []
    if plan is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for i in range(steps):
            t0 = time.perf_counter()
            loss = wl.loss_fn(model(data[f"inputs.{i}"]), data[f"targets.{i}"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        state = model.state_dict()
        _save(save, state)
    else:
        mplan = MemoryPlan.from_dict(plan)
        source = TensorFile(init_file) if init_file else None
        with LocalExecutor(
            model,
            wl.loss_fn,
            mplan,
            lr=lr,
            offload_dir=offload_dir,
            init_state=None if source is None else source.get_tensor,
        ) as ex:
            if source is not None:
                source.close()  # every weight is in the model or the store now
            for i in range(steps):
                t0 = time.perf_counter()
                losses.append(ex.step(data[f"inputs.{i}"], data[f"targets.{i}"]))
                times.append(time.perf_counter() - t0)
            if save:
                _save(save, ex.state_dict())
    later = times[1:] or times
    return {"losses": losses, "step_times_s": times, "step_s": statistics.median(later)}


def _save(path: str | None, state: dict[str, torch.Tensor]) -> None:
    if path:
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, path)
