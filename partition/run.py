"""Train a workload for a few steps under a memory plan, or plainly: the function that
``fleetfit memory run`` executes in a measured child process.

The batches are drawn by the caller and handed over in a safetensors file, so the child
holds exactly what a training job holds (model, optimizer state, the batch), not the
dataset they were drawn from.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memory.measure import Measurement, measure_in_child
from memory.overhead import runtime_overhead_bytes
from memory.profile import Profile, measure_disk_bandwidth, profile_workload_fake
from memory.spec import MemoryPlan
from memory.tensorfile import TensorFile
from partition.local import LocalExecutor
from workloads import Workload, get_workload


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


def profile_workload(
    wl: Workload,
    *,
    offload_dir: str | None = None,
    measure_time: bool = True,
    max_microbatches: int = 16,
) -> Profile:
    """The workload's per-block profile (fake tensors) with this disk's bandwidth and
    this machine's runtime overhead (``memory.overhead``)."""
    x, y = wl.example_batch()
    profile = profile_workload_fake(
        wl.factory,
        x,
        y,
        wl.loss_fn,
        measure_time=measure_time,
        max_microbatches=max_microbatches,
    )
    profile = replace(profile, runtime_bytes=runtime_overhead_bytes())
    return profile.with_disk(measure_disk_bandwidth(offload_dir))


def loading_from_file(profile: Profile) -> Profile:
    """The profile of a run that reads its weights block by block from a file
    (``train_workload(init_file=...)``): building the model holds at most the largest
    block's parameters beyond what stays resident, which every step holds anyway."""
    largest = max((b.param_bytes for b in profile.blocks), default=0)
    return replace(profile, construction_peak_bytes=largest)


def measured_run(
    workload: str,
    plan: MemoryPlan | None,
    *,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    offload_dir: str | None = None,
    save: str | None = None,
    timeout_s: float = 3600,
) -> tuple[Measurement, dict[str, Any]]:
    """Train ``steps`` steps in a fresh child process and measure its peak memory.

    Batches are drawn here from the workload's data (seeded) and handed over in a file;
    with a plan, the initial weights are written to a file too and the child reads them
    block by block. Returns the measurement and the child's result.
    """
    wl = get_workload(workload, batch_size=batch_size, seq_len=seq_len)
    batches = wl.batches(wl.items(train=True), seed=seed)
    with tempfile.TemporaryDirectory(prefix="fleetfit-run-", dir=offload_dir) as tmp:
        batches_file = os.path.join(tmp, "batches.safetensors")
        save_batches(batches_file, [next(batches) for _ in range(steps)])
        init_file = None
        if plan is not None:
            init_file = os.path.join(tmp, "init.safetensors")
            save_initial_state(
                workload, init_file, seed=seed, batch_size=batch_size, seq_len=seq_len
            )
        kwargs: dict[str, Any] = dict(
            workload=workload,
            batches_file=batches_file,
            plan=None if plan is None else plan.to_dict(),
            seed=seed,
            lr=lr,
            batch_size=batch_size,
            seq_len=seq_len,
            offload_dir=offload_dir,
            save=save,
            init_file=init_file,
        )
        m = measure_in_child(
            "partition.run:train_workload",
            kwargs,
            timeout_s=timeout_s,
        )
    return m, m.result
