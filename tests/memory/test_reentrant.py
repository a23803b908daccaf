"""Blocks the model checkpoints itself are planned like any other (issue 34, item 8b).

A model that calls ``torch.utils.checkpoint.checkpoint(block, h)`` in its own forward
(the layout of transformers' gradient checkpointing) runs each block inside a node of
its own: a reentrant checkpoint runs the block without autograd and saves its input
once the block has returned, a non-reentrant one saves it before calling the block.
Either save happens between units, in the model's glue, so the profile took it for
activations the unit's wrappers could not move and made the unit keep-only (its state
resident); a reentrant block's rerun, inside the backward, was charged to the last
block. Now glue that saves a unit's own input keeps that input (no inputs-to-disk
option, since the glue's copy stays), the rerun is the backward of the block whose
node runs it, and plans stream such blocks with plain's losses and gradients. Blocks
that call ``checkpoint`` inside their own forward are covered the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memory
from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.unit_profile import unit_profiles
from memory.units import find_units

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

D, T, B, C = 64, 32, 16, 8  # hidden, tokens, batch, classes
SETTINGS = TrainSettings(lr=1e-3, clip_norm=1.0)  # clipping: streamed grads wait


class Block(nn.Module):
    def __init__(self, inner: bool | None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.inner = inner  # checkpoint inside forward, with use_reentrant=inner

    def _f(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is None:
            return self._f(x)
        return checkpoint(self._f, x, use_reentrant=self.inner)


class Net(nn.Module):
    """Three blocks checkpointed by the model: by the parent (``outer``) or by each
    block in its forward (``inner``), reentrant or not."""

    def __init__(self, where: str, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        inner = reentrant if where == "inner" else None
        self.blocks = nn.ModuleList(Block(inner) for _ in range(3))
        self.out = nn.Linear(D, C)
        self.outer = where == "outer"
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            if self.outer:
                h = checkpoint(b, h, use_reentrant=self.reentrant)
            else:
                h = b(h)
        return self.out(h)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, T, 16, generator=g), torch.randint(0, C, (B, T), generator=g)


def _model(where: str, reentrant: bool) -> Net:
    torch.manual_seed(0)
    return Net(where, reentrant)


CASES = [("outer", True), ("outer", False), ("inner", True), ("inner", False)]


@pytest.mark.parametrize(("where", "reentrant"), CASES)
def test_self_checkpointed_blocks_are_planned_and_equal_plain(
    where: str, reentrant: bool
) -> None:
    x, y = _batch()
    ref = _model(where, reentrant)
    loss = loss_fn(ref(x), y)
    loss.backward()
    want = float(loss.detach())
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    profiles = unit_profiles(_model(where, reentrant), x, y, loss_fn)
    blocks = profiles[1].blocks[1:4]  # inp, blocks.0-2, out
    for b in blocks:
        assert set(b.options) >= {"K", "R", "O", "S"}, b.options  # not keep-only
        # each block's backward (its rerun, for a reentrant one) is its own
        assert b.costs[1].backward_peak_bytes > 0
    peaks = [b.costs[1].backward_peak_bytes for b in blocks]
    assert max(peaks) <= 1.2 * min(peaks), peaks

    planned = memory.plan_training(_model(where, reentrant), x, y, loss_fn)
    states = {b.name: b.state for b in planned.plan.blocks}
    assert all(states[f"blocks.{i}"] == "stream" for i in range(3)), planned.plan
    names = [u.name for u in find_units(ref, x)]
    to_disk = {n for n, b in zip(names, profiles[1].blocks) if "D" in b.options}
    plans = [
        planned,
        MemoryPlan(  # streamed, the inputs on disk where the profile allows it
            tuple(
                BlockPlan(n, "recompute", "stream", offload_inputs=n in to_disk)
                for n in names
            ),
            num_microbatches=2,
        ),
        MemoryPlan(tuple(BlockPlan(n, "offload") for n in names)),
    ]
    for p in plans:
        if isinstance(p, memory.TrainingPlan):
            tr = p.trainer(settings=SETTINGS)
        else:
            tr = PlannedTrainer(
                _model(where, reentrant), p, x, loss_fn=loss_fn, settings=SETTINGS
            )
        with tr:
            got = tr.backward(x, y)
            g = tr.gradients()
        assert abs(got - want) <= 1e-5 * abs(want)
        assert g.keys() == grads.keys()
        for n, ref_g in grads.items():
            assert float((g[n] - ref_g).norm()) <= 1e-5 * float(ref_g.norm()), n


def test_glue_that_keeps_an_input_rules_out_inputs_on_disk() -> None:
    """The checkpoint's saved input stays in memory whatever the unit's wrapper does:
    a plan that put it on disk would be predicted below what it holds."""
    x, y = _batch()
    for where, reentrant in [("outer", True), ("outer", False)]:
        prof = unit_profiles(_model(where, reentrant), x, y, loss_fn)[1]
        for b in prof.blocks[1:4]:
            assert "D" not in b.options
            assert b.costs[1].saves_input
    plain = unit_profiles(_model("inner", False), x, y, loss_fn)[1]
    assert "D" in plain.blocks[1].options
