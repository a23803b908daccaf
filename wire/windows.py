"""Which blocks a model is assigned over and which state-dict keys a window trains.

The client freezes by ``trained_keys`` and sends back exactly those keys; the server
checks every reply against the same list. A ``part`` assignment trains the window
``[start, stop)`` and the head (the last block); a tied parameter is trained only with
the block that owns it (the first block using it): GPT-2's head projection is the
token embedding, so it trains only in windows that start at block 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from memory.blocks import Block, as_blocks
from memory.chain_profile import profile_workload_fake
from memory.profile import Profile
from memory.unit_profile import unit_profiles
from memory.units import find_units
from workloads import Workload

_profiles: dict[tuple[str, int, int], dict[int, Profile]] = {}  # per process


def model_blocks(workload: Workload, model: nn.Module) -> list[Block]:
    """The blocks assignments are made over: the model's units for an ``any_model``
    workload (``memory.units.find_units``), else its chain blocks (a tensor workload
    keeps the chain path; decided from the workload alone)."""
    if workload.any_model:
        assert workload.example is not None
        return list(find_units(model, workload.example[0]))
    return list(as_blocks(model))


def workload_profiles(workload: Workload) -> dict[int, Profile]:
    """The whole model's profiles by loss chunk count over ``model_blocks``' blocks
    (``{1: ...}`` for a chain), traced on fake tensors: nothing of the model's size is
    allocated. Both the server's assigner and a node planning for itself plan over
    these; cached per process by workload name and shape."""
    key = (workload.name, workload.batch_size, workload.seq_len or 0)
    if key not in _profiles:
        if workload.any_model:
            assert workload.example is not None
            x, y, loss_fn = workload.example
            _profiles[key] = unit_profiles(workload.make_model(0), x, y, loss_fn)
        else:
            x, y = workload.example_batch()
            _profiles[key] = {
                1: profile_workload_fake(
                    lambda: workload.make_model(0),
                    x,
                    y,
                    workload.loss_fn,
                    measure_time=False,
                )
            }
    return _profiles[key]


def trainable_blocks(num_blocks: int, window: tuple[int, int] | None) -> list[int]:
    """Indices of the blocks a window trains (all blocks for ``None``).

    Raises:
        ValueError: a window outside the blocks before the head.
    """
    if window is None:
        return list(range(num_blocks))
    start, stop = window
    if not 0 <= start <= stop <= num_blocks - 1:
        raise ValueError(
            f"window [{start}, {stop}) is outside the model's {num_blocks - 1} "
            "blocks before the head"
        )
    return [*range(start, stop), num_blocks - 1]


def trained_keys(
    model: nn.Module,
    window: tuple[int, int] | None,
    blocks: Sequence[Block] | None = None,
) -> list[str]:
    """State-dict keys an assignment trains: the parameters of trained blocks (a tied
    one follows its owner, every name it has) and the buffers of trained blocks.

    ``blocks``: the model's blocks or units (default ``as_blocks(model)``).
    """
    blocks = as_blocks(model) if blocks is None else blocks
    train = set(trainable_blocks(len(blocks), window))
    owner: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.module.parameters():
            owner.setdefault(id(p), i)
    keys = [
        k
        for k, p in model.named_parameters(remove_duplicate=False)
        if owner.get(id(p), -1) in train
    ]
    prefixes = tuple(b.name + "." for i, b in enumerate(blocks) if i in train)
    keys += [k for k, _ in model.named_buffers() if k.startswith(prefixes)]
    return keys
