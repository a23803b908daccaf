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


@contextlib.contextmanager
def frozen_buffers(module: nn.Module) -> Iterator[None]:
    """Run ``module`` without changing its buffers.

    Every buffer (BatchNorm ``running_mean``, ``running_var``, ``num_batches_tracked``)
    is swapped for a copy for the duration and the originals are put back afterwards,
    also when the block raises (``torch.utils.checkpoint`` stops a recompute early with
    an exception). Outputs do not change: in training mode BatchNorm normalises with the
    batch's statistics, not the running ones.
    """
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
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
    return checkpoint(
        fn,
        x,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), frozen_buffers(module)),
    )


@dataclass
class RecomputeRecord:
    """What a ``no_grad`` forward keeps so that backward can rerun it.

    Attributes:
        inputs: the block's input.
        rng_state: the CPU RNG state before the forward.
        cuda_rng_state: the current CUDA device's RNG state, when CUDA was in use.
    """

    inputs: torch.Tensor
    rng_state: torch.Tensor
    cuda_rng_state: torch.Tensor | None = None


def forward_no_grad(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, RecomputeRecord]:
    """Run ``fn(x)`` without autograd, keeping what ``recompute`` needs."""
    cuda = x.is_cuda
    record = RecomputeRecord(
        x, torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
    )
    with torch.no_grad():
        out = fn(x)
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
    with torch.random.fork_rng(devices=devices), frozen_buffers(module):
        torch.set_rng_state(record.rng_state)
        if record.cuda_rng_state is not None:
            torch.cuda.set_rng_state(record.cuda_rng_state)
        with torch.enable_grad():
            out = fn(leaf)
    return leaf, out
