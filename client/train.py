"""Local training on a client's share of the data, under the server's assignment.

- ``full``: the whole model, under a ``MemoryPlan`` (``partition.local.LocalExecutor``)
  or plainly (torch AdamW) when the instruction carries no plan.
- ``part``: successive layer training. Blocks ``[0, start)`` are frozen and run under
  ``no_grad`` in eval mode (no activation is stored, no batch statistic changes); the
  window ``[start, stop)`` and the head (the last block, which holds the loss) are
  trained; blocks ``[stop, last)`` are frozen but still run forward and backward, so
  that the loss's gradient reaches the window (their activations are kept or
  recomputed as the plan says; they have no gradients and no optimizer state). A tied
  parameter is trained only when the block that owns it (the first block using it) is
  trained: GPT-2's head projection is the token embedding, so it trains only in
  windows that start at block 0. The chain ``[start, last]`` runs under the plan.

An ``any_model`` workload (a transformers model, dict inputs, the model's own loss) trains the same way over its units
(``memory.units.find_units``, in execution order, the last one its head) through
``memory.step.PlannedTrainer``: the model's own forward runs, frozen units have
``requires_grad`` off and run in eval mode, so the frozen prefix stores no activation.
Its batches are the node's own (``Workload.node_batches``: ``load_data``).

Measuring the peak (what a budget bounds: the training work's peak resident memory):

- ``child`` (default): the work runs in a fresh process through
  ``memory.measure.measure_in_child`` (``MALLOC_MMAP_THRESHOLD_=65536``): the peak is
  its ``VmHWM`` minus its RSS right after imports (for a ``module:function``
  workload: its module, and what its model's construction imports lazily, found by
  building it on ``meta`` first: ``memory.step.warm_up``). The child builds the model, reads
  the received arrays from a file one tensor at a time, trains on batches drawn by the
  parent and written to a file (so it never holds the dataset) and writes the trained
  arrays back. Everything the training holds counts.
- ``inline``: in this process: ``VmHWM`` is reset (``/proc/self/clear_refs``) before
  the work and the peak is ``VmHWM`` after it minus the RSS before it. Cheaper (no
  process start), but glibc may reuse memory freed earlier, so it can read low: use it
  for tests and trusted fleets, not to check budgets.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (AdamW's first step imports it: ~80 MB, an import)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from memory.blocks import Block, as_blocks
from memory.materialize import StateSource, params_on_meta
from memory.measure import measure_in_child, peak_rss_bytes, reset_peak, rss_bytes
from memory.spec import MemoryPlan
from memory.tensorfile import TensorFile
from partition.local import LocalExecutor
from partition.run import load_batches, save_batches
from wire.windows import trained_keys
from workloads import Workload, get_workload

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class TrainResult:
    num_examples: int  # items in the client's share (images, or corpus chunks)
    mean_loss: float  # mean training loss over the local steps
    train_s: float  # wall time of the local steps, seconds
    state: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    peak_bytes: int = 0  # measured peak of the training work above its baseline
    baseline_bytes: int = 0  # RSS the peak is measured from
    method: str = "inline"  # child | inline | inline-unreset
    steps: int = 0


def draw_batches(
    workload: Workload,
    partition_id: int,
    num_partitions: int,
    *,
    split: str,
    alpha: float,
    seed: int,
    server_round: int,
    local_steps: int,
    classes: Sequence[int] | None = None,
) -> tuple[list[Batch], int, int]:
    """This round's batches, the share's item count, and the torch seed of the steps.

    The batch order derives from (seed, round, partition), so a rerun draws the same.
    A workload with its own data (``Workload.own_data``) gives its batches itself.
    """
    if workload.own_data:
        torch_seed = np.random.SeedSequence([seed, server_round, partition_id])
        batches, n = workload.node_batches(
            partition_id,
            num_partitions,
            server_round=server_round,
            local_steps=local_steps,
        )
        return batches, n, int(torch_seed.generate_state(1)[0])
    items = workload.client_items(
        partition_id, num_partitions, split, seed=seed, alpha=alpha, classes=classes
    )
    data_seed, torch_seed = np.random.SeedSequence(
        [seed, server_round, partition_id]
    ).generate_state(2)
    stream = workload.batches(items, seed=int(data_seed))
    return [next(stream) for _ in range(local_steps)], len(items), int(torch_seed)


def freeze_for_window(
    model: nn.Module,
    window: tuple[int, int] | None,
    blocks: Sequence[Block] | None = None,
) -> list[str]:
    """Set ``requires_grad`` for a window; return the state-dict keys it trains
    (``wire.windows.trained_keys``: the keys the server expects back). ``blocks``:
    the model's blocks or units (default: ``as_blocks(model)``)."""
    keys = trained_keys(model, window, blocks)
    train = set(keys)
    for name, p in model.named_parameters(remove_duplicate=False):
        p.requires_grad_(name in train)  # a tied parameter's names agree
    return keys


def train_chain(
    model: nn.Module,
    loss_fn: Any,
    batches: list[Batch],
    *,
    plan: MemoryPlan | None,
    window: tuple[int, int] | None,
    lr: float,
    offload_dir: str | None = None,
) -> tuple[list[float], list[str]]:
    """Train ``model`` in place on ``batches``; return the losses and trained keys."""
    keys = freeze_for_window(model, window)
    losses: list[float] = []
    if window is None and plan is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model.train()
        for inputs, targets in batches:
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses, keys
    blocks = as_blocks(model)
    start = 0 if window is None else window[0]
    stop = len(blocks) - 1 if window is None else window[1]
    prefix = [b.module for b in blocks[:start]]
    chain = nn.Sequential(*[b.module for b in blocks[start:]])
    model.train()
    for i, b in enumerate(blocks):
        if i < start or stop <= i < len(blocks) - 1:
            b.module.eval()  # frozen: no batch statistics change
    if plan is None:
        plan = MemoryPlan.plain([str(i) for i in range(len(chain))])
    elif len(plan.blocks) != len(chain):
        raise ValueError(
            f"the plan has {len(plan.blocks)} blocks but the trained chain has "
            f"{len(chain)} (blocks {start}..{len(blocks) - 1})"
        )
    plan = replace(
        plan,
        blocks=tuple(replace(bp, name=str(i)) for i, bp in enumerate(plan.blocks)),
        num_microbatches=short_batch_microbatches(
            plan.num_microbatches,
            planned=max(b[0].shape[0] for b in batches),
            actual=min(b[0].shape[0] for b in batches),
        )
        if batches
        else plan.num_microbatches,
    )
    with LocalExecutor(chain, loss_fn, plan, lr=lr, offload_dir=offload_dir) as ex:
        for inputs, targets in batches:
            x = inputs
            if prefix:
                with torch.no_grad():
                    for m in prefix:
                        x = m(x)
            losses.append(ex.step(x, targets))
        ex.close(restore=True)
    return losses, keys


def train_units(
    model: nn.Module,
    workload: Workload,
    batches: list[Any],
    *,
    plan: MemoryPlan | None,
    window: tuple[int, int] | None,
    lr: float,
    offload_dir: str | None = None,
    init_state: StateSource | None = None,
    save_to: str | None = None,
) -> tuple[list[float], list[str]]:
    """``train_chain`` for a workload planned per unit: train ``model`` in place on
    ``batches`` (``(inputs, targets)`` of any structure) through
    ``memory.step.PlannedTrainer``; return the losses and trained keys.

    ``init_state``: for a model built without its weights
    (``memory.materialize.params_on_meta``), the file they are read from, unit by
    unit within the plan. ``save_to``: write the trained keys there (safetensors, tied
    keys once with ``aliases``) one tensor at a time, streamed ones from the store,
    and leave the model's streamed parameters as placeholders: the update never
    exists whole in memory."""
    from memory.step import PlannedTrainer, TrainSettings
    from memory.units import find_units

    assert workload.example is not None
    example_inputs, _, loss_fn = workload.example
    units = find_units(model, example_inputs)
    keys = freeze_for_window(model, window, units)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"window {window} of units {[u.name for u in units]} trains no parameter "
            "(its head's weights belong to a frozen unit); assign a wider window"
        )
    model.train()
    if window is not None:
        start, stop = window
        for i, u in enumerate(units):
            if i < start or stop <= i < len(units) - 1:
                u.module.eval()  # frozen: no dropout, no batch statistics change
    if plan is None:
        plan = MemoryPlan.plain([u.name for u in units])
    planned = max(_batch_size(b) for b in batches) if batches else 1
    losses: list[float] = []
    trainer = PlannedTrainer(
        model,
        plan,
        units=units,
        loss_fn=loss_fn,
        settings=TrainSettings(lr=lr),
        offload_dir=offload_dir,
        init_state=init_state,
    )
    try:
        for inputs, targets in batches:
            m = short_batch_microbatches(
                plan.num_microbatches, planned=planned, actual=_batch_size((inputs,))
            )
            losses.append(trainer.step(inputs, targets, num_microbatches=m))
        if save_to is not None:
            trainer.save(save_to, keys=keys)
    finally:
        trainer.close(restore=save_to is None)
    return losses, keys


def _batch_size(batch: Any) -> int:
    from workloads.node_data import batch_size_of

    return batch_size_of(batch[0])


def train_model(
    model: nn.Module,
    workload: Workload,
    batches: list[Any],
    *,
    plan: MemoryPlan | None,
    window: tuple[int, int] | None,
    lr: float,
    offload_dir: str | None = None,
) -> tuple[list[float], list[str]]:
    """``train_units`` for an ``any_model`` workload, else ``train_chain``.

    Decided from the workload alone, as the server decides (``server.assign``): never
    from running the model here, whose behaviour a node may change (a node whose
    forward fails must not take another path than the plan it was sent)."""
    if workload.any_model:
        return train_units(
            model,
            workload,
            batches,
            plan=plan,
            window=window,
            lr=lr,
            offload_dir=offload_dir,
        )
    return train_chain(
        model,
        workload.loss_fn,
        batches,
        plan=plan,
        window=window,
        lr=lr,
        offload_dir=offload_dir,
    )


def short_batch_microbatches(m: int, *, planned: int, actual: int) -> int:
    """Micro-batches for batches of ``actual`` examples under a plan that cuts
    ``planned``-example batches into ``m``.

    A client with fewer items than a batch trains short batches (all of one size),
    which need not split into the plan's ``m`` equal micro-batches; the smallest
    divisor ``k`` of ``actual`` with ``actual / k <= planned // m`` (at worst ``actual``
    micro-batches of one example) gives equal micro-batches no larger than the plan's,
    so its memory bound holds. ``planned`` is the largest batch of the round (the
    plan's batch or less, which only makes the bound safer).
    """
    if m <= 1 or actual % m == 0:
        return m
    per = max(1, planned // m)
    for k in range(1, actual + 1):
        if actual % k == 0 and actual // k <= per:
            return k
    return actual


def _load_into(model: nn.Module, arrays_file: str) -> None:
    """Copy tensors from a safetensors file into ``model``, one at a time (plain
    reads: a mapped file would stay resident until closed)."""
    own = model.state_dict(keep_vars=True)
    with TensorFile(arrays_file) as f, torch.no_grad():
        for key in f.keys():
            own[key].copy_(f.get_tensor(key))


def train_in_child(
    workload: str,
    arrays_file: str,
    batches_file: str,
    out_file: str,
    *,
    plan: dict[str, Any] | None,
    window: list[int] | None,
    lr: float,
    torch_seed: int,
    batch_size: int | None = None,
    seq_len: int | None = None,
    offload_dir: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The measured child's work: build, load, train, write the trained arrays."""
    if threads:
        torch.set_num_threads(threads)
    custom = ":" in workload
    # a module:function workload is built to read its example batch: without weights
    with params_on_meta() if custom else contextlib.nullcontext():
        wl = get_workload(workload, batch_size=batch_size, seq_len=seq_len)
    batches = load_batches(batches_file)
    kwargs: dict[str, Any] = dict(
        plan=None if plan is None else MemoryPlan.from_dict(plan),
        window=None if window is None else (window[0], window[1]),
        lr=lr,
        offload_dir=offload_dir,
    )
    if wl.any_model:  # weights read unit by unit within the plan, update written so
        with params_on_meta():
            model = wl.make_model(0)
        with TensorFile(arrays_file) as source:
            torch.manual_seed(torch_seed)
            t0 = time.perf_counter()
            losses, _ = train_units(
                model, wl, batches, init_state=source, save_to=out_file, **kwargs
            )
            train_s = time.perf_counter() - t0
        return {"losses": losses, "train_s": train_s}
    model = wl.make_model(0)
    _load_into(model, arrays_file)
    torch.manual_seed(torch_seed)
    t0 = time.perf_counter()
    losses, keys = train_model(model, wl, batches, **kwargs)
    train_s = time.perf_counter() - t0
    state = model.state_dict()
    trained = {k: state[k].detach().contiguous() for k in keys}
    kept = _untied(trained)  # tied keys (a head sharing the embedding) written once
    aliases = {k: _first_with(kept, v) for k, v in trained.items() if k not in kept}
    save_file(kept, out_file, metadata={"aliases": json.dumps(aliases)})
    return {"losses": losses, "train_s": train_s}


def _first_with(kept: dict[str, torch.Tensor], t: torch.Tensor) -> str:
    ptr = t.untyped_storage().data_ptr()
    return next(k for k, v in kept.items() if v.untyped_storage().data_ptr() == ptr)


def _load_trained(path: str) -> dict[str, torch.Tensor]:
    """``train_in_child``'s output: the trained tensors, tied keys restored."""
    with safe_open(path, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    state = load_file(path)
    for k, first in aliases.items():
        state[k] = state[first]
    return state


def train_assigned(
    model_state: dict[str, torch.Tensor],
    workload: Workload,
    batches: list[Batch],
    *,
    num_examples: int,
    torch_seed: int,
    plan: MemoryPlan | None,
    window: tuple[int, int] | None,
    lr: float,
    measure: str,
    offload_dir: str | None = None,
) -> TrainResult:
    """Train under an assignment and measure the peak of the work (see module doc)."""
    if measure == "child":
        return _train_child(
            model_state,
            workload,
            batches,
            num_examples=num_examples,
            torch_seed=torch_seed,
            plan=plan,
            window=window,
            lr=lr,
            offload_dir=offload_dir,
        )
    method = "inline"
    try:
        reset_peak()
    except OSError:
        method = "inline-unreset"  # VmHWM then includes this process's earlier peak
    rss0 = rss_bytes()
    model = workload.make_model(0)
    model.load_state_dict(model_state)
    torch.manual_seed(torch_seed)
    t0 = time.perf_counter()
    losses, keys = train_model(
        model,
        workload,
        batches,
        plan=plan,
        window=window,
        lr=lr,
        offload_dir=offload_dir,
    )
    train_s = time.perf_counter() - t0
    peak = max(0, peak_rss_bytes() - rss0)
    state = model.state_dict()
    return TrainResult(
        num_examples,
        float(np.mean(losses)),
        train_s,
        {k: state[k].detach().clone() for k in keys},
        peak,
        rss0,
        method,
        len(losses),
    )


def _train_child(
    model_state: dict[str, torch.Tensor],
    workload: Workload,
    batches: list[Batch],
    *,
    num_examples: int,
    torch_seed: int,
    plan: MemoryPlan | None,
    window: tuple[int, int] | None,
    lr: float,
    offload_dir: str | None,
) -> TrainResult:
    custom = workload.kind == "custom"
    with tempfile.TemporaryDirectory(prefix="fleetfit-client-") as tmp:
        arrays_file = os.path.join(tmp, "arrays.safetensors")
        batches_file = os.path.join(tmp, "batches.safetensors")
        out_file = os.path.join(tmp, "trained.safetensors")
        save_file(
            {k: v.detach().contiguous() for k, v in _untied(model_state).items()},
            arrays_file,
        )
        save_batches(batches_file, batches)
        m = measure_in_child(
            "client.train:train_in_child",
            {
                "workload": workload.name,
                "arrays_file": arrays_file,
                "batches_file": batches_file,
                "out_file": out_file,
                "plan": None if plan is None else plan.to_dict(),
                "window": None if window is None else list(window),
                "lr": lr,
                "torch_seed": torch_seed,
                "batch_size": workload.batch_size
                if workload.kind != "custom"
                else None,
                "seq_len": workload.seq_len,
                "offload_dir": offload_dir,
                "threads": torch.get_num_threads(),
            },
            # a custom workload's module (and what it imports: transformers) is
            # library code, imported before the baseline as torch is; so is what
            # its model's construction imports lazily (transformers' modeling code:
            # 62 MiB for the example GPT-2), as in `fleetfit memory run`
            preload=(workload.name.split(":")[0],) if custom else (),
            warmup=(
                (
                    "memory.step:warm_up",
                    {"factory": workload.name, "factory_kwargs": {}},
                )
                if custom
                else None
            ),
        )
        state = _load_trained(out_file)
    losses = m.result["losses"]
    return TrainResult(
        num_examples,
        float(np.mean(losses)),
        float(m.result["train_s"]),
        state,
        m.peak_bytes,
        m.baseline_bytes,
        "child",
        len(losses),
    )


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory: keep the first key of each."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        if ptr in seen and ptr != -1:
            continue
        seen.add(ptr)
        out[k] = v
    return out
