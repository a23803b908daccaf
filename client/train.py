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

- ``child`` (default): the work runs in a fresh process through the one
  measured-training path (``partition.measured.train_in_child``, with
  ``train_window_job``; ``MALLOC_MMAP_THRESHOLD_=65536``): the peak is its ``VmHWM``
  minus its RSS right after imports (for a ``module:function`` workload: its module,
  and what its model's construction imports lazily, found by building it on ``meta``
  first: ``memory.step.warm_up``). The child builds the model, reads the received
  arrays from a file one tensor at a time (an ``any_model`` one: unit by unit within
  the plan), trains on batches drawn by the parent and written to a file (so it never
  holds the dataset) and writes the trained keys back. Everything the training holds
  counts.
- ``inline``: in this process: ``VmHWM`` is reset (``/proc/self/clear_refs``) before
  the work and the peak is ``VmHWM`` after it minus the RSS before it. Cheaper (no
  process start), but glibc may reuse memory freed earlier, so it can read low: use it
  for tests and trusted fleets, not to check budgets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (AdamW's first step imports it: ~80 MB, an import)
from torch import nn

from memory.batch import short_batch_microbatches
from memory.blocks import Block, as_blocks
from memory.lora import (
    LoraSpec,
    adapter_state,
    add_adapters,
    autocast_for,
    factor_keys,
)
from memory.materialize import StateSource
from memory.measure import peak_rss_bytes, reset_peak, rss_bytes
from memory.spec import MemoryPlan
from partition.local import LocalExecutor
from partition.measured import ChildRun, TrainFn, plain_steps, train_in_child
from wire.windows import trained_keys
from workloads import Workload

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
    public_share: float = 0.0,
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
        partition_id,
        num_partitions,
        split,
        seed=seed,
        alpha=alpha,
        classes=classes,
        public_share=public_share,
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
    proximal_mu: float = 0.0,
    adapters: LoraSpec | None = None,
) -> tuple[list[float], list[str]]:
    """Train ``model`` in place on ``batches``; return the losses and trained keys.
    ``proximal_mu`` > 0: FedProx's term towards the received weights, on every path
    (``memory.proximal``; refused for parameters streamed from disk).

    ``adapters``: an ``adapter`` assignment (``memory.lora``): LoRA adapters are
    added to blocks ``[adapters.start, last)``, only they train, the blocks before
    run under ``no_grad``; the trained keys returned are the factors' wire keys
    (``adapter_factors`` reads them)."""
    if adapters is not None:
        keys = _add_adapters(model, adapters, as_blocks(model))
        window = (adapters.start, adapters.start)
    else:
        keys = freeze_for_window(model, window)
    if window is None and plan is None:
        return plain_steps(
            model, loss_fn, batches, lr=lr, proximal_mu=proximal_mu
        ), keys
    losses: list[float] = []
    blocks = as_blocks(model)
    start = 0 if window is None else window[0]
    stop = len(blocks) - 1 if window is None else window[1]
    prefix = [b.module for b in blocks[:start]]
    chain = nn.Sequential(*[b.module for b in blocks[start:]])
    model.train()
    for i, b in enumerate(blocks):
        if i < start or (adapters is None and stop <= i < len(blocks) - 1):
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
    with (
        _autocast(adapters),
        LocalExecutor(
            chain,
            loss_fn,
            plan,
            lr=lr,
            offload_dir=offload_dir,
            proximal_mu=proximal_mu,
        ) as ex,
    ):
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
    proximal_mu: float = 0.0,
    adapters: LoraSpec | None = None,
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
    if adapters is not None:  # only the adapters train; the base's units stay
        if init_state is not None or save_to is not None:
            raise ValueError("adapters train on a model loaded whole (init copy)")
        keys = _add_adapters(model, adapters, units)
        window = (adapters.start, adapters.start)
    else:
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
            if i < start or (adapters is None and stop <= i < len(units) - 1):
                u.module.eval()  # frozen: no dropout, no batch statistics change
    if plan is None:
        plan = MemoryPlan.plain([u.name for u in units])
    planned = max(_batch_size(b) for b in batches) if batches else 1
    trainer = PlannedTrainer(
        model,
        plan,
        units=units,
        loss_fn=loss_fn,
        settings=TrainSettings(lr=lr, proximal_mu=proximal_mu),
        offload_dir=offload_dir,
        init_state=init_state,
    )
    try:
        with _autocast(adapters):
            losses = trainer.train(batches, planned_size=planned)
        if save_to is not None:
            trainer.save(save_to, keys=keys)
    finally:
        trainer.close(restore=save_to is None)
    return losses, keys


def _add_adapters(
    model: nn.Module, spec: LoraSpec, blocks: Sequence[Block]
) -> list[str]:
    """Add the adapters (``memory.lora.add_adapters``); their factors' wire keys."""
    paths = add_adapters(model, spec, blocks)
    return [k for p in paths for k in factor_keys(p)]


def adapter_factors(model: nn.Module, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The trained factors of a model ``train_model(adapters=...)`` trained, by the
    wire keys it returned."""
    paths = [k.removesuffix(".lora_A") for k in keys if k.endswith(".lora_A")]
    return adapter_state(model, paths)


def _autocast(spec: LoraSpec | None) -> contextlib.AbstractContextManager:
    return autocast_for(spec) or contextlib.nullcontext()


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
    proximal_mu: float = 0.0,
    adapters: LoraSpec | None = None,
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
            proximal_mu=proximal_mu,
            adapters=adapters,
        )
    return train_chain(
        model,
        workload.loss_fn,
        batches,
        plan=plan,
        window=window,
        lr=lr,
        offload_dir=offload_dir,
        proximal_mu=proximal_mu,
        adapters=adapters,
    )


def train_window_job(run: ChildRun) -> list[float]:
    """The measured child's training function (``partition.measured.TrainFn``): the
    window ``run.options["window"]`` (None: the whole model) under ``run.plan``; the
    trained keys written to ``run.save_to``, tied keys once (an ``any_model``
    workload's unit by unit, from its plan's store: ``train_units``)."""
    window = run.options.get("window")
    kwargs: dict[str, Any] = dict(
        plan=run.plan,
        window=None if window is None else (window[0], window[1]),
        lr=run.lr,
        offload_dir=run.offload_dir,
        proximal_mu=float(run.options.get("proximal-mu", 0.0)),
    )
    if run.workload.any_model:  # weights read unit by unit within the plan
        losses, _ = train_units(
            run.model,
            run.workload,
            run.batches,
            init_state=run.init_state,
            save_to=run.save_to,
            **kwargs,
        )
        return losses
    losses, keys = train_model(run.model, run.workload, run.batches, **kwargs)
    run.write_state(run.model.state_dict(), keys=keys, tied="alias")
    return losses


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
    proximal_mu: float = 0.0,
    adapters: LoraSpec | None = None,
) -> TrainResult:
    """Train under an assignment and measure the peak of the work (see module doc).
    ``proximal_mu``: FedProx's term towards ``model_state`` (0: none).
    ``adapters``: an ``adapter`` assignment; the result's state holds the factors
    (wire keys, ``memory.lora.factor_keys``), the model built and loaded whole."""
    if measure == "child":
        job: TrainFn = train_window_job
        if adapters is not None:  # peft: only an adapter assignment needs it
            from client.adapter_job import train_adapter_job

            job = train_adapter_job
        state, m = train_in_child(
            job,
            workload,
            batches,
            plan=plan,
            lr=lr,
            torch_seed=torch_seed,
            threads=torch.get_num_threads(),
            initial_state=model_state,
            init="stream" if workload.any_model and adapters is None else "copy",
            read_back=True,
            options={
                "window": None if window is None else list(window),
                "proximal-mu": proximal_mu,
                "adapters": None if adapters is None else asdict(adapters),
            },
            offload_dir=offload_dir,
            timeout_s=600,
        )
        assert state is not None
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
        proximal_mu=proximal_mu,
        adapters=adapters,
    )
    train_s = time.perf_counter() - t0
    peak = max(0, peak_rss_bytes() - rss0)
    if adapters is not None:
        trained = adapter_factors(model, keys)
    else:
        state = model.state_dict()
        trained = {k: state[k].detach().clone() for k in keys}
    return TrainResult(
        num_examples,
        float(np.mean(losses)),
        train_s,
        trained,
        peak,
        rss0,
        method,
        len(losses),
    )
