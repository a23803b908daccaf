"""A unit that reads and updates a buffer in its forward (an exponential moving
average) under recompute (issue 34, item 10): its rerun in backward starts from the
buffer its first run saw, not the updated one, so the gradients are plain's; the
buffer itself is updated once per forward, as in plain training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memory.recompute import checkpoint_block
from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.units import find_units


class EMACentred(nn.Module):
    """Subtracts a running mean of its own output, then updates it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("ema", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = torch.tanh(h - self.ema)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(EMACentred(16) for _ in range(4)), nn.Linear(16, 3))


def _train(kind: str):
    model = _model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
    units = find_units(model, x)
    names = [u.name for u in units]
    if kind == "plain":
        plan = MemoryPlan.plain(names)
    else:
        state = "stream" if kind == "stream" else "resident"
        plan = MemoryPlan(tuple(BlockPlan(n, "recompute", state) for n in names))
    settings = TrainSettings(lr=1e-2, clip_norm=1.0)
    losses, grads = [], []
    with PlannedTrainer(
        model,
        plan,
        units=units,
        loss_fn=nn.functional.cross_entropy,
        settings=settings,
    ) as tr:
        for _ in range(3):
            losses.append(tr.backward(x, y))
            grads.append({n: g.clone() for n, g in tr.gradients().items()})
            tr._calls += 1
            tr._update()
        tr.close()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return losses, grads, buffers


@pytest.mark.parametrize("kind", ["recompute", "stream"])
def test_an_ema_unit_recomputed_trains_as_plain(kind: str) -> None:
    ref = _train("plain")
    got = _train(kind)
    assert got[0] == ref[0]
    for step, (a, b) in enumerate(zip(got[1], ref[1])):
        assert a.keys() == b.keys()
        for n in b:
            assert torch.equal(a[n], b[n]), (step, n)
    for n, b in ref[2].items():
        assert torch.equal(got[2][n], b), n
    assert any(bool(b.abs().sum() > 0) for b in ref[2].values())  # it did update


def test_checkpoint_block_reruns_from_the_buffer_the_forward_saw() -> None:
    torch.manual_seed(0)
    a, b = EMACentred(8), EMACentred(8)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8, requires_grad=True)
    a(x).sum().backward()
    checkpoint_block(b, x.detach().requires_grad_(True), b).sum().backward()
    assert torch.equal(a.lin.weight.grad, b.lin.weight.grad)
    assert torch.equal(a.ema, b.ema)  # updated once, by the first run
