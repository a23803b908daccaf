"""Recompute (activation checkpointing): keep a block's input, rerun its forward in backward.

Two forms, both bit-identical to running the block with autograd:

- ``checkpoint_block(module, x)``: ``torch.utils.checkpoint`` (``use_reentrant=False``)
  around the block; autograd reruns the forward when backward first needs a saved tensor.
- ``RecomputeRecord`` + ``recompute``: the forward runs under ``no_grad`` (nothing saved,
  used for blocks whose parameters are streamed from disk) and backward reruns it with
  autograd once the parameters are loaded again.

Either way the forward runs twice but a step must look like one forward to the module's
state: buffers such as BatchNorm running statistics are updated by the first run only
(the rerun works on throw-away copies, ``frozen_buffers``), and the rerun sees the RNG
state the first run saw, so dropout masks agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class BufferSnapshot:
    """A module's buffers as its forward found them, for a rerun of that forward.

    Taken before the first run (a copy of every buffer); ``settle`` after it keeps the
    copy only where the forward changed a buffer (in place: its version moved; or
    replaced). A unit that updates a buffer it also reads (an exponential moving
    average) is then rerun on the values its first run saw, not on the updated ones;
    one whose buffers did not change (most: BatchNorm's statistics change, but its
    training-mode output does not read them) drops the copy at once.
    """

    def __init__(self, module: nn.Module) -> None:
        self.entries = [
            (sub, name, buf, buf._version)
            for sub in module.modules()
            for name, buf in sub._buffers.items()
            if buf is not None
        ]
        self.values: list[torch.Tensor] | None = [
            buf.detach().clone() for _, _, buf, _ in self.entries
        ]

    def settle(self) -> None:
        if self.values is None:
            return
        changed = any(
            sub._buffers.get(name) is not buf or buf._version != version
            for sub, name, buf, version in self.entries
        )
        if not changed:
            self.values = None


@contextlib.contextmanager
def frozen_buffers(
    module: nn.Module, start: BufferSnapshot | None = None
) -> Iterator[None]:
    """Run ``module`` without changing its buffers.

    Every buffer (BatchNorm ``running_mean``, ``running_var``, ``num_batches_tracked``)
    is swapped for a copy for the duration and the originals are put back afterwards,
    also when the block raises (``torch.utils.checkpoint`` stops a recompute early with
    an exception). The copies are of the buffers as they are now, or, with ``start``
    (a ``BufferSnapshot`` its first run kept), as the first run found them. Outputs do
    not change: in training mode BatchNorm normalises with the batch's statistics, not
    the running ones.
    """
    values = None if start is None else start.values
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    if values is not None and start is not None:
        for (sub, name, _, _), value in zip(start.entries, values):
            buf = sub._buffers[name]
            if buf is not None:
                swapped.append((sub, name, buf))
                sub._buffers[name] = value.clone()
    else:
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is not None:
                    swapped.append((sub, name, buf))
                    sub._buffers[name] = buf.clone()
    try:
        yield
    finally:
        for sub, name, buf in swapped:
            sub._buffers[name] = buf


def has_buffers(module: nn.Module) -> bool:
    """True when the module keeps state besides parameters (e.g. BatchNorm statistics)."""
    return any(True for _ in module.buffers())


def checkpoint_block(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, module: nn.Module
) -> torch.Tensor:
    """``fn(x)`` under ``torch.utils.checkpoint``: only ``x`` is kept for backward.

    Args:
        fn: the block's forward (``module`` itself, or a closure that also applies a
            loss); it must only use ``module``'s parameters and buffers.
        x: the block's input.
        module: the module whose buffers the recompute must leave alone.

    Example:
        >>> y = checkpoint_block(layer, x, layer)  # doctest: +SKIP
        >>> y.sum().backward()  # reruns layer's forward, then backprops  # doctest: +SKIP
    """
    if not has_buffers(module):
        return checkpoint(fn, x, use_reentrant=False)
    snap = BufferSnapshot(module)
    out = checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), frozen_buffers(module, snap)),
    )
    snap.settle()
    return out


@dataclass
class RecomputeRecord:
    """What a ``no_grad`` forward keeps so that backward can rerun it.

    Attributes:
        inputs: the block's input.
        rng_state: the CPU RNG state before the forward.
        cuda_rng_state: the current CUDA device's RNG state, when CUDA was in use.
        buffers: the buffers the forward changed, as it found them (``module`` given).
    """

    inputs: torch.Tensor
    rng_state: torch.Tensor
    cuda_rng_state: torch.Tensor | None = None
    buffers: BufferSnapshot | None = None


def forward_no_grad(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    module: nn.Module | None = None,
) -> tuple[torch.Tensor, RecomputeRecord]:
    """Run ``fn(x)`` without autograd, keeping what ``recompute`` needs (with
    ``module``, the buffers its forward changed, as the forward found them)."""
    cuda = x.is_cuda
    record = RecomputeRecord(
        x,
        torch.get_rng_state(),
        torch.cuda.get_rng_state() if cuda else None,
        BufferSnapshot(module) if module is not None and has_buffers(module) else None,
    )
    with torch.no_grad():
        out = fn(x)
    if record.buffers is not None:
        record.buffers.settle()
    return out, record


def recompute(
    fn: Callable[[torch.Tensor], torch.Tensor],
    record: RecomputeRecord,
    module: nn.Module,
    *,
    input_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rerun a ``forward_no_grad`` with autograd, as the first run did it.

    Returns:
        ``(leaf, out)``: the input as a fresh autograd leaf (its ``.grad`` is the input
        gradient after backward) and the output with its graph.
    """
    leaf = record.inputs.detach()
    if input_requires_grad:
        leaf.requires_grad_(True)
    devices = [torch.cuda.current_device()] if record.cuda_rng_state is not None else []
    with (
        torch.random.fork_rng(devices=devices),
        frozen_buffers(module, record.buffers),
    ):
        torch.set_rng_state(record.rng_state)
        if record.cuda_rng_state is not None:
            torch.cuda.set_rng_state(record.cuda_rng_state)
        with torch.enable_grad():
            out = fn(leaf)
    return leaf, out
