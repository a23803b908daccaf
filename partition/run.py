"""``fleetfit memory run``: profile a workload, then train it for a few steps under a
memory plan, or plainly, in a measured child process.

The run goes through the one measured-training path (``partition.measured``:
``train_in_child``), whose child trains a chain with ``train_chain_job``: plainly
(torch AdamW) or through ``partition.local.LocalExecutor``, the initial weights read
block by block from a file under a plan.

A ``module:function`` workload that takes the any-model path (``uses_units``: dict or
tuple inputs, the model's own loss, or children that do not run as a chain) is
profiled per unit (``profile_any_model``) and trained through the same
``train_in_child`` with ``train_units_job``: its own example batch at every step, the
plan applied per unit (``memory.step.PlannedTrainer``), saving within the plan's
memory.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from memory.chain_profile import profile_workload_fake
from memory.measure import Measurement, target_name
from memory.overhead import runtime_overhead_bytes, workload_runtime_bytes
from memory.probes import measure_disk_bandwidth
from memory.profile import Profile
from memory.spec import MemoryPlan
from partition.local import LocalExecutor
from partition.measured import (  # noqa: F401  (save_batches, load_batches: here too)
    ChildRun,
    load_batches,
    plain_steps,
    save_batches,
    train_child,
    train_in_child,
    write_state,
)
from workloads import Workload, get_workload

Batch = tuple[torch.Tensor, torch.Tensor]


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
    write_state(path, model.state_dict(), tied="copy")


def train_chain_job(run: ChildRun) -> list[float]:
    """The training function of ``fleetfit memory run`` for a chain (``TrainFn``):
    ``run.model`` whole, plainly (``plain_steps``) or under ``run.plan``
    (``LocalExecutor``, the weights read from ``run.init_state`` when the model is on
    ``meta``); each step timed; the final state written to ``run.save_to``, every key
    its own copy."""
    wl = run.workload
    if run.plan is None:
        losses = plain_steps(run.model, wl.loss_fn, run.timed(), lr=run.lr)
        run.write_state(run.model.state_dict(), tied="copy")
        return losses
    source = run.init_state
    with LocalExecutor(
        run.model,
        wl.loss_fn,
        run.plan,
        lr=run.lr,
        offload_dir=run.offload_dir,
        init_state=None if source is None else source.get_tensor,
    ) as ex:
        run.close_init_state()  # every weight is in the model or the store now
        losses = [ex.step(inputs, targets) for inputs, targets in run.timed()]
        if run.save_to:
            run.write_state(ex.state_dict(), tied="copy")
    return losses


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
    """Train ``workload`` on the batches in ``batches_file``, one step per batch, in
    this process: what ``measured_run``'s child does (``train_child`` with
    ``train_chain_job``).

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
        ``{"losses": [...], "step_times_s": [...], "step_s": median after the first}``
        (and ``train_s``).
    """
    return train_child(
        train=target_name(train_chain_job),
        workload=workload,
        batches_file=batches_file,
        plan=plan,
        lr=lr,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        threads=threads,
        init_file=init_file if plan is not None else None,
        init="stream",
        save_to=save,
        offload_dir=offload_dir,
    )


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
    block by block (``partition.measured.train_in_child``, ``train_chain_job``).
    Returns the measurement and the child's result.
    """
    wl = get_workload(workload, batch_size=batch_size, seq_len=seq_len)
    batches = wl.batches(wl.items(train=True), seed=seed)

    def initial(path: str) -> None:  # built and written, not kept here
        save_initial_state(
            workload, path, seed=seed, batch_size=batch_size, seq_len=seq_len
        )

    _, m = train_in_child(
        train_chain_job,
        wl,
        [next(batches) for _ in range(steps)],
        plan=plan,
        lr=lr,
        seed=seed,
        initial_state=None if plan is None else initial,
        init="stream",
        save=save,
        offload_dir=offload_dir,
        tmp_dir=offload_dir,
        timeout_s=timeout_s,
    )
    return m, m.result


# ------------------------------------------------------------ any model, per unit


def uses_units(wl: Workload) -> bool:
    """Whether ``fleetfit memory`` plans ``wl`` per unit (``memory.units``).

    True for an ``any_model`` workload (tuple, list or dict inputs, no targets, or the
    model's own loss) and for a ``module:function`` one whose children do not run as a
    chain (``memory.blocks.check_blocks``: one forward of a model built here); built-in
    workloads and custom chains keep the block path.
    """
    if wl.any_model:
        return True
    if wl.kind != "custom" or wl.custom_batch is None:
        return False
    if wl.name not in _CHAIN_CHECKED:  # one model built per process and workload
        from memory.blocks import check_blocks
        from memory.errors import MemoryPlanError

        try:
            check_blocks(wl.make_model(0), wl.custom_batch[0])
        except MemoryPlanError:
            _CHAIN_CHECKED[wl.name] = True
        else:
            _CHAIN_CHECKED[wl.name] = False
    return _CHAIN_CHECKED[wl.name]


_CHAIN_CHECKED: dict[str, bool] = {}  # custom workload -> planned per unit


def profile_any_model(
    wl: Workload, *, offload_dir: str | None = None
) -> dict[int, Profile]:
    """The per-unit profiles of a ``module:function`` workload (``uses_units``), one
    per loss chunk count its head allows (``memory.unit_profile.unit_profiles``: from
    its own forward on fake tensors), with this disk's bandwidth and the runtime's
    cost measured for this workload (``memory.overhead.workload_runtime_bytes``).
    The profiles' blocks are the model's units, in execution order; ``[1]`` is the
    model's own loss."""
    from memory.unit_profile import unit_profiles

    assert wl.example is not None, f"{wl.name} is not a module:function workload"
    inputs, targets, loss_fn = wl.example
    model = wl.make_model(0)
    runtime = workload_runtime_bytes(wl.name, offload_dir=offload_dir)
    profiles = unit_profiles(model, inputs, targets, loss_fn, runtime_bytes=runtime)
    del model
    disk = measure_disk_bandwidth(offload_dir)
    return {c: p.with_disk(disk) for c, p in profiles.items()}


def train_units_job(run: ChildRun) -> list[float]:
    """The training function of ``fleetfit memory run`` for a workload planned per
    unit (``uses_units``; ``TrainFn``): the whole model through
    ``memory.step.PlannedTrainer``, plainly (a plan of plain units) or under
    ``run.plan``, guarded at the plan's budget (``memory.guard.MemoryGuard``); the
    weights read unit by unit from ``run.init_state`` when given; each step timed; the
    trained state written to ``run.save_to`` within the plan's memory
    (``PlannedTrainer.save``)."""
    from memory.step import whole_model_trainer

    wl = run.workload
    assert wl.example is not None, f"{wl.name} is not a module:function workload"
    inputs, _, loss_fn = wl.example
    trainer = whole_model_trainer(
        run.model,
        inputs,
        loss_fn,
        run.plan,
        lr=run.lr,
        offload_dir=run.offload_dir,
        init_state=run.init_state,
        baseline_bytes=run.baseline_bytes,
    )
    run.close_init_state()  # every weight is in the model or the store now
    try:
        losses = trainer.train(run.timed())
        if run.save_to:
            trainer.save(run.save_to)
    finally:
        trainer.close(restore=False)  # the state is saved: nothing to bring back
    return losses


def measured_any_model_run(
    wl: Workload,
    plan: MemoryPlan | None,
    *,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    offload_dir: str | None = None,
    save: str | None = None,
    timeout_s: float = 3600,
    init_state: str | None = None,
) -> tuple[Measurement, dict[str, Any]]:
    """Train the ``module:function`` workload ``wl`` (planned per unit: ``uses_units``)
    for ``steps`` steps on its example batch in a fresh child process, its peak
    measured: the one measured-training path (``partition.measured.train_in_child``)
    with ``train_units_job``. ``init_state``: a safetensors file the child reads the
    weights from, unit by unit (the model built without them: ``memory.materialize``).
    Returns the measurement and the child's result (``losses``, ``step_times_s``,
    ``step_s``)."""
    assert wl.example is not None, f"{wl.name} is not a module:function workload"
    inputs, targets, _ = wl.example
    _, m = train_in_child(
        train_units_job,
        wl,
        [(inputs, targets)] * steps,
        plan=plan,
        lr=lr,
        seed=seed,
        torch_seed=seed + 1,
        initial_state=init_state,
        init="stream",
        save=None if save is None else os.path.abspath(save),
        offload_dir=offload_dir,
        options={"per-unit": True},
        timeout_s=timeout_s,
    )
    return m, m.result
