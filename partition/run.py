"""Train a workload for a few steps under a memory plan, or plainly: the function that
``fleetfit memory run`` executes in a measured child process.

The batches are drawn by the caller and handed over in a safetensors file, so the child
holds exactly what a training job holds (model, optimizer state, the batch), not the
dataset they were drawn from. The file (``save_batches``, ``load_batches``) stores each
distinct tensor once and, in its metadata, which two tensors each step trains on: a
custom workload trains its one example batch at every step, and the child then holds
that batch once, as the training job does.

A ``module:function`` workload that takes the any-model path (``uses_units``: dict or
tuple inputs, the model's own loss, or children that do not run as a chain) is
profiled per unit (``profile_any_model``) and trained in the child by
``memory.step.train_measured``, which builds it from its function and applies the plan
per unit (``memory.step.PlannedTrainer``), saving within the plan's memory.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from memory.chain_profile import profile_workload_fake
from memory.measure import Measurement, measure_in_child
from memory.overhead import runtime_overhead_bytes, workload_runtime_bytes
from memory.probes import measure_disk_bandwidth
from memory.profile import Profile
from memory.spec import MemoryPlan
from memory.tensorfile import TensorFile
from partition.local import LocalExecutor
from workloads import Workload, get_workload

Batch = tuple[torch.Tensor, torch.Tensor]


def save_batches(path: str | Path, batches: list[Any]) -> None:
    """Write ``batches`` for ``train_workload`` (and ``load_batches``).

    A batch is ``(inputs, targets)`` of any structure a workload gives: tensors, dicts,
    tuples and lists of them, None and plain numbers (``model(**inputs)`` with
    ``labels``, for a transformers model). The structure goes to the metadata with
    each tensor replaced by its name in the file.

    safetensors refuses tensors that share memory, yet a step's tensors may be ones
    already written (a custom workload's example batch comes back at every step) or
    views of one storage (inputs and targets sliced from one tensor). The same view is
    written once, under one name that every step using it refers to; another view of a
    storage already written is written as a copy of its elements.

    Raises:
        ValueError: a batch holds something other than tensors, containers of them,
            None, numbers or strings (one line naming its type).
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[tuple[Any, ...], str] = {}  # view of a storage -> its name in the file
    storages: set[tuple[torch.device, int]] = set()  # those of the written tensors

    def name_of(t: torch.Tensor) -> str:
        view = (_storage(t), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        name = names.get(view)
        if name is None:
            out = t.detach().contiguous()  # a copy only if not contiguous
            if _storage(out) in storages:
                out = out.clone()
            storages.add(_storage(out))
            name = names[view] = f"tensor.{len(tensors)}"
            tensors[name] = out
        return name

    def encode(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {"t": name_of(x)}
        if isinstance(x, dict):
            return {"d": {str(k): encode(v) for k, v in x.items()}}
        if isinstance(x, tuple | list):
            return {"tuple" if isinstance(x, tuple) else "list": [encode(v) for v in x]}
        if x is None or isinstance(x, bool | int | float | str):
            return {"v": x}
        raise ValueError(
            f"a batch holds a {type(x).__name__}: batches may hold tensors, dicts, "
            "tuples and lists of them, None, numbers and strings"
        )

    steps = [encode(b) for b in batches]
    save_file(tensors, str(path), metadata={"batches": json.dumps(steps)})


def load_batches(path: str | Path) -> list[Any]:
    """The batches written by ``save_batches``, one per step, in their structure;
    steps that trained on the same tensor get the same tensor object (read once)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    def decode(x: dict[str, Any]) -> Any:
        if "t" in x:
            return tensors[x["t"]]
        if "d" in x:
            return {k: decode(v) for k, v in x["d"].items()}
        if "tuple" in x:
            return tuple(decode(v) for v in x["tuple"])
        if "list" in x:
            return [decode(v) for v in x["list"]]
        return x["v"]

    if "batches" in meta:
        return [decode(b) for b in json.loads(meta["batches"])]
    if "steps" in meta:  # an earlier version: pairs of tensor names
        return [(tensors[x], tensors[y]) for x, y in json.loads(meta["steps"])]
    n = sum(k.startswith("inputs.") for k in tensors)  # one tensor per key
    return [(tensors[f"inputs.{i}"], tensors[f"targets.{i}"]) for i in range(n)]


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


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
    batches = load_batches(batches_file)
    if init_file is not None and plan is not None:
        with torch.device("meta"):
            model = wl.make_model(seed)
    else:
        model = wl.make_model(seed)
    losses: list[float] = []
    times: list[float] = []
    if plan is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for inputs, targets in batches:
            t0 = time.perf_counter()
            loss = wl.loss_fn(model(inputs), targets)
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
            for inputs, targets in batches:
                t0 = time.perf_counter()
                losses.append(ex.step(inputs, targets))
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


def measured_any_model_run(
    workload: str,
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
    """``memory.step.train_measured`` of the ``module:function`` ``workload`` in a
    fresh child process, its peak measured; the workload's module is imported before
    the baseline (its libraries, such as transformers, count there as torch does).
    ``init_state``: a safetensors file the child reads the weights from, unit by unit
    (the model built without them: ``memory.materialize``). Returns the measurement
    and the child's result."""
    kwargs: dict[str, Any] = dict(
        factory=workload,
        factory_kwargs={},
        plan=None if plan is None else plan.to_dict(),
        steps=steps,
        lr=lr,
        seed=seed,
        offload_dir=offload_dir,
        save=None if save is None else os.path.abspath(save),
        init_state=None if init_state is None else os.path.abspath(init_state),
    )
    m = measure_in_child(
        "memory.step:train_measured",
        kwargs,
        timeout_s=timeout_s,
        preload=(workload.split(":")[0],),
        warmup=("memory.step:warm_up", {"factory": workload, "factory_kwargs": {}}),
    )
    return m, m.result
