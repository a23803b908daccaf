"""Profile a model run as a chain of blocks: every block's bytes and time, on fake tensors.

``profile_workload_fake(factory, inputs, targets, loss_fn)`` builds the model under
``FakeTensorMode`` (no weight is ever allocated, so a model larger than RAM can be
profiled) and ``profile_blocks`` runs one training step block by block on fake copies
of the blocks (``memory.chain_costs``: state, saved activations, workspace peaks and
FLOPs per block; the loss's belong to the last block).

Every cost is profiled for each number of micro-batches the planner may choose (the
divisors of the batch size) and, for the last block, for each number of loss chunks
(slices of the flattened token dimension).

Time: each block's forward and backward are timed on this machine with real tensors of
the block's shapes when that is affordable (memory and time), otherwise derived from
its FLOPs and a measured matmul rate (``memory.probes.measure_flops_per_s``);
``BlockCosts.time_source`` says which. Disk bandwidth for the planner comes from
``memory.probes.measure_disk_bandwidth``.

Example:
    >>> prof = profile_workload_fake(lambda: GPT(cfg), x, y, lm_loss)  # doctest: +SKIP
    >>> print(prof.table())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import psutil
import torch
from torch import nn

from memory.blocks import Block, as_blocks
from memory.chain_costs import (
    LiveBytes,
    LossFn,
    block_state,
    chain_costs,
    is_batch_dependent,
    storage_key,
)
from memory.probes import measure_flops_per_s
from memory.profile import BlockCosts, BlockProfile, Profile

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- timing
def _real_like(t: torch.Tensor, example: torch.Tensor | None) -> torch.Tensor:
    if (
        example is not None
        and example.shape == t.shape
        and not example.is_floating_point()
    ):
        return example.clone()
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def _time_block(
    mod: nn.Module,
    x_shape: torch.Tensor,
    x_example: torch.Tensor | None,
    y_example: torch.Tensor | None,
    loss_fn: LossFn | None,
    repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds of ``mod`` with real tensors (random values)."""
    state: dict[str, torch.Tensor] = {}
    for name, p in mod.named_parameters(remove_duplicate=False):
        state[name] = nn.Parameter(torch.randn(p.shape, dtype=p.dtype) * 0.02)
    for name, b in mod.named_buffers(remove_duplicate=False):
        state[name] = torch.ones(b.shape, dtype=b.dtype)
    x = _real_like(x_shape, x_example)
    if x.is_floating_point():
        x.requires_grad_(True)

    def run() -> torch.Tensor:
        out = torch.func.functional_call(mod, state, (x,))
        return loss_fn(out, y_example) if loss_fn is not None else out  # type: ignore[arg-type]

    fwd, bwd = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        if out.requires_grad:
            g = None if loss_fn is not None else torch.ones_like(out)
            torch.autograd.backward(out, g)
        t2 = time.perf_counter()
        if i > 1:  # two runs warm up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del out
        for p in state.values():  # type: ignore[assignment]
            p.grad = None
    # the minimum: the other processes of a busy machine only ever add time
    return min(fwd), min(bwd)


# --------------------------------------------------------------------------- entry
def profile_blocks(
    blocks: list[Block],
    example_inputs: torch.Tensor,
    example_targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    optimizer: str = "adamw",
    fake: bool = True,
    measure_time: bool = True,
    max_microbatches: int = 16,
    max_loss_chunks: int = 64,
    construction_peak_bytes: int | None = None,
    max_real_bytes: int | None = None,
    max_time_s: float = 2.0,
) -> Profile:
    """Profile a training step of a model given as blocks.

    Args:
        blocks: the model as ``as_blocks`` gives it (real, fake or meta-free modules).
        example_inputs: a batch of inputs (real tensors: their shapes and, for integer
            inputs such as tokens, their values are used).
        example_targets: the batch's targets.
        loss_fn: ``loss_fn(output, targets)``, a scalar.
        optimizer: ``adamw`` (its state is 2 x the trainable parameter bytes).
        fake: trace on fake copies of the blocks (no activation is allocated); with
            False the step runs on real copies.
        measure_time: time blocks with real tensors when affordable; otherwise every
            time is FLOPs over the measured matmul rate.
        max_microbatches: profile micro-batch counts up to this (divisors of the batch).
        max_loss_chunks: profile loss chunk counts (powers of two) up to this.
        construction_peak_bytes: peak bytes of building the model (default: its
            parameters and buffers).
        max_real_bytes: largest block (state and activations) timed with real tensors
            (default: a quarter of the available memory, at most 2 GiB).
        max_time_s: blocks whose FLOPs predict a longer forward plus backward are not
            timed but derived from FLOPs.

    Returns:
        The ``Profile``; its ``disk`` is unset (see ``measure_disk_bandwidth``).
    """
    if not blocks:
        raise ValueError("profile_blocks needs at least one block")
    holder = nn.ModuleList([b.module for b in blocks])
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

        if _is_fake_module(holder):
            fake_mode = _fake_mode_of(holder)
        else:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            with FakeCopyMode(fake_mode):
                holder = copy.deepcopy(holder)
    else:
        holder = copy.deepcopy(holder)
    names = [b.name for b in blocks]
    work_blocks = [Block(n, m) for n, m in zip(names, holder)]
    state = block_state(work_blocks, optimizer)
    params = list(holder.parameters())
    batch = int(example_inputs.shape[0]) if example_inputs.dim() else 1
    tracker = LiveBytes()

    def fakeify(t: torch.Tensor) -> torch.Tensor:
        if fake_mode is None:
            return t
        if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
            return t
        return fake_mode.from_tensor(t)

    x_all, y_all = fakeify(example_inputs), fakeify(example_targets)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    costs_by_m: dict[int, list[BlockCosts]] = {}
    chunk_costs: dict[tuple[int, int], BlockCosts] = {}
    chunk_options = [1]
    with ctx, tracker:
        param_keys = {storage_key(p) for p in params}
        for m in _divisors(batch, max_microbatches):
            x, y = _slice_rows(x_all, m), _slice_rows(y_all, m)
            costs_by_m[m] = chain_costs(
                list(holder), x, y, loss_fn, tracker, param_keys
            )
            for p in params:
                p.grad = None
        # loss chunks: the last block on a slice of the flattened token rows
        last_in_shape = _last_input_shape(list(holder), x_all)
        if last_in_shape is not None and tuple(last_in_shape[:-1]) == tuple(
            y_all.shape
        ):
            rows_all = int(torch.Size(last_in_shape[:-1]).numel())
            for m in costs_by_m:
                rows = rows_all // m
                c = 2
                while c <= max_loss_chunks and rows % c == 0:
                    xin = torch.empty(
                        (rows // c, last_in_shape[-1]), dtype=torch.float32
                    )
                    yc = y_all.reshape(-1)[: rows // c]
                    cc = chain_costs(
                        [holder[-1]], xin, yc, loss_fn, tracker, param_keys
                    )
                    chunk_costs[(m, c)] = cc[0]
                    chunk_options.append(c)
                    for p in params:
                        p.grad = None
                    c *= 2
    rate = measure_flops_per_s()
    sources: set[str] = set()
    profiles: list[BlockProfile] = []
    n = len(holder)
    budget_real = (
        max_real_bytes if max_real_bytes is not None else _default_real_bytes()
    )
    input_shapes = _input_shapes(list(holder), x_all, fake_mode)
    for j, st in enumerate(state):
        by_m: dict[int, BlockCosts] = {}
        full = costs_by_m[1][j]
        t_fwd = t_bwd = None
        src = "flops"
        est_s = (full.forward_flops + full.backward_flops) / rate
        real_bytes = (
            2 * (st.param_bytes + st.shared_param_bytes)
            + full.forward_peak_bytes
            + full.backward_peak_bytes
            + full.input_bytes
        )
        if measure_time and real_bytes <= budget_real and est_s <= max_time_s:
            try:
                t_fwd, t_bwd = _time_block(
                    holder[j],
                    input_shapes[j],
                    example_inputs if j == 0 else None,
                    example_targets if j == n - 1 else None,
                    loss_fn if j == n - 1 else None,
                    repeats=3 if est_s < 0.2 else 1,
                )
                src = "measured"
            except Exception as e:  # a block that will not run on random values
                logger.info(
                    "timing %s with real tensors failed (%s); using FLOPs",
                    st.name,
                    e,
                )
        for m, cs in costs_by_m.items():
            by_m[m] = _with_time(cs[j], full, t_fwd, t_bwd, rate, src)
        sources.add(src)
        chunked: dict[tuple[int, int], BlockCosts] = {}
        if j == n - 1:
            chunked = {
                k: _with_time(v, full, t_fwd, t_bwd, rate, src)
                for k, v in chunk_costs.items()
            }
        profiles.append(BlockProfile(costs=by_m, chunk_costs=chunked, **asdict(st)))
    construction = construction_peak_bytes
    if construction is None:
        construction = sum(p.numel() * p.element_size() for p in params) + sum(
            b.numel() * b.element_size() for b in holder.buffers()
        )
    return Profile(
        blocks=tuple(profiles),
        batch_size=batch,
        batch_dependent=is_batch_dependent(holder),
        batch_bytes=_nbytes_real(example_inputs) + _nbytes_real(example_targets),
        construction_peak_bytes=int(construction),
        optimizer=optimizer,
        flops_per_s=rate,
        time_source=sources.pop() if len(sources) == 1 else "mixed",
        loss_chunk_options=tuple(sorted(set(chunk_options))),
    )


def _nbytes_real(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _default_real_bytes() -> int:
    """A quarter of the memory available now (``MemAvailable``), at most 2 GiB."""
    try:
        available = int(psutil.virtual_memory().available)
    except OSError:
        return 2**30
    return min(2 * 2**30, available // 4)


def _with_time(
    c: BlockCosts,
    full: BlockCosts,
    t_fwd: float | None,
    t_bwd: float | None,
    rate: float,
    src: str,
) -> BlockCosts:
    """Times for a slice: measured whole-batch time scaled by the slice's FLOPs."""
    if t_fwd is None or t_bwd is None:
        return replace(
            c,
            forward_s=c.forward_flops / rate,
            backward_s=c.backward_flops / rate,
            time_source="flops",
        )
    fr = c.forward_flops / full.forward_flops if full.forward_flops else 1.0
    br = c.backward_flops / full.backward_flops if full.backward_flops else 1.0
    return replace(c, forward_s=t_fwd * fr, backward_s=t_bwd * br, time_source=src)


def _is_fake_module(mod: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in mod.parameters())


def _fake_mode_of(mod: nn.Module):  # noqa: ANN202
    for p in mod.parameters():
        return p.fake_mode  # type: ignore[attr-defined]
    return None


@torch.no_grad()
def _input_shapes(
    modules: list[nn.Module], x: torch.Tensor, fake_mode: object
) -> list[torch.Tensor]:
    """Each block's input (fake tensors, for their shapes and dtypes)."""
    ctx: Any = fake_mode if fake_mode is not None else contextlib.nullcontext()
    shapes = []
    with ctx:
        for mod in modules:
            shapes.append(x)
            x = mod(x)
    return shapes


@torch.no_grad()
def _last_input_shape(modules: list[nn.Module], x: torch.Tensor) -> torch.Size | None:
    for mod in modules[:-1]:
        x = mod(x)
    return x.shape if x.is_floating_point() and x.dim() >= 2 else None


def profile_workload_fake(
    factory: Callable[[], nn.Module],
    example_inputs: torch.Tensor,
    example_targets: torch.Tensor,
    loss_fn: LossFn,
    **kwargs: object,
) -> Profile:
    """Profile a model that is never built for real.

    ``factory()`` runs under ``FakeTensorMode``: its parameters are fake tensors (shapes
    and dtypes, no storage), so profiling a model larger than memory costs a few MB.
    Its construction peak (parameters plus anything built and dropped, such as a head
    projection replaced by a tied embedding) is tracked as it runs.

    Args:
        factory: builds the model (e.g. ``lambda: GPT(cfg)``).
        example_inputs, example_targets, loss_fn: as for ``profile_blocks``.
        **kwargs: passed to ``profile_blocks``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = LiveBytes()
    with mode, tracker:
        model = factory()
        kept = [t for t in (*model.parameters(), *model.buffers())]  # noqa: C416
        construction = tracker.peak
    del kept
    blocks = as_blocks(model)
    kwargs.setdefault("construction_peak_bytes", construction)
    return profile_blocks(blocks, example_inputs, example_targets, loss_fn, **kwargs)  # type: ignore[arg-type]


def _slice_rows(t: torch.Tensor, parts: int) -> torch.Tensor:
    return t[: t.shape[0] // parts]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
