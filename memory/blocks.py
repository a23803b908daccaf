"""A model as a sequence of blocks: the unit that memory plans and partitions cut.

``as_blocks`` accepts
- an ``nn.Sequential``: its children are the blocks;
- a model whose children run in registration order, where children that are an
  ``nn.ModuleList`` (or ``nn.Sequential``) of layers are expanded into one block per
  layer: prefix modules, a list of layers, suffix modules (GPT-style models).

Each block is named by its path in the model (``"layers.3"``), so plans and pipeline
stages can be written as lists of module names. ``check_blocks`` runs the block chain
and the model on an example input and insists they agree, since the second form relies
on the model's ``forward`` running its children in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memory.errors import MemoryPlanError


@dataclass(frozen=True)
class Block:
    """One block: its module path and the module."""

    name: str
    module: nn.Module


def as_blocks(model: nn.Module) -> list[Block]:
    """The model's blocks, in the order its forward runs them.

    Raises:
        MemoryPlanError: a model without children.
    """
    blocks: list[Block] = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.Sequential) and not isinstance(
            model, nn.Sequential
        ):
            blocks += [
                Block(f"{name}.{i}", layer) for i, layer in child.named_children()
            ]
        else:
            blocks.append(Block(name, child))
    if not blocks:
        raise MemoryPlanError(
            f"{type(model).__name__} has no child modules to plan over: build it as an "
            "nn.Sequential, or as prefix modules, an nn.ModuleList of layers and suffix "
            "modules run in that order"
        )
    return blocks


def run_blocks(blocks: list[Block], inputs: torch.Tensor) -> torch.Tensor:
    """The output of the block chain on ``inputs``."""
    x = inputs
    for b in blocks:
        x = b.module(x)
    return x


@torch.no_grad()
def check_blocks(model: nn.Module, inputs: torch.Tensor) -> list[Block]:
    """``as_blocks(model)``, checked to reproduce ``model(inputs)`` exactly.

    Raises:
        MemoryPlanError: the chain of children does not compute what the model does.
    """
    blocks = as_blocks(model)
    was_training = model.training
    model.eval()  # no dropout / batch statistics during the check
    try:
        want = model(inputs)
        got = run_blocks(blocks, inputs)
    except Exception as e:  # a child that needs more than the previous output
        raise MemoryPlanError(
            f"{type(model).__name__}'s children cannot run as a chain ({e}); write the "
            "model so that each child takes the previous child's output"
        ) from e
    finally:
        model.train(was_training)
    if (
        not isinstance(want, torch.Tensor)
        or want.shape != got.shape
        or not torch.equal(want, got)
    ):
        raise MemoryPlanError(
            f"{type(model).__name__}'s children run in order do not reproduce its "
            "forward: its blocks must run in registration order, each on the previous "
            "output"
        )
    return blocks
