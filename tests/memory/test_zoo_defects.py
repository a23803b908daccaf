"""Defect classes the architecture zoo found (benchmarks/zoo.py), each pinned on a
small model of that class built here: a head that is not a plain Linear, a model
that feeds its head another input without labels, model code that reads a unit's
parameter (a streamed unit's would be a placeholder), an embedding called with a
shape, and data-dependent code in a module that holds no unit."""

from __future__ import annotations

import torch
from torch import nn

from memory import TrainSettings, plan_training
from memory.head import _head_extra
from memory.units import find_units

SETTINGS = TrainSettings(lr=1e-3, clip_norm=1.0)  # streamed gradients wait


def _plain(model: nn.Module, x, y, loss_fn) -> tuple[float, dict]:
    loss = loss_fn(model(*x), y)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _planned(model: nn.Module, x, y, loss_fn, **kw) -> tuple[float, dict, object]:
    planned = plan_training(model, x, y, loss_fn, **kw)
    with planned.trainer(settings=SETTINGS) as tr:
        loss = tr.backward(x, y)
        grads = {n: g.clone() for n, g in tr.gradients().items()}
    return loss, grads, planned


def _equal(got, want) -> None:
    assert abs(got[0] - want[0]) <= 1e-5 * abs(want[0])
    for n, g in want[1].items():
        assert float((got[1][n] - g).norm()) <= 1e-5 * max(float(g.norm()), 1e-6), n


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class ScaledHead(nn.Linear):
    """A head with a learnable logit scale of its own (Dory's)."""

    def __init__(self, d: int, v: int) -> None:
        super().__init__(d, v, bias=False)
        self.logit_scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.logit_scale


def test_a_head_that_is_not_a_plain_linear_gets_no_loss_chunks() -> None:
    assert _head_extra(nn.Linear(4, 8)) is None
    why = _head_extra(ScaledHead(4, 8))
    assert why is not None and "logit_scale" in why and "\n" not in why


class Glue(nn.Module):
    """A learned query the model's own code reads (Perceiver's latents, a class
    token): its unit must stay resident, or the code would read a placeholder."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.latents = nn.Sequential(nn.Linear(64, 64))
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.latents(h) + self.latents[0].weight.sum(0)  # a unit's parameter
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_a_unit_whose_parameters_the_model_reads_is_not_streamed() -> None:
    torch.manual_seed(0)
    model = Glue()
    x, y = (torch.randn(256, 8),), torch.randint(0, 5, (256,))
    ref = Glue()
    ref.load_state_dict(model.state_dict())
    want = _plain(ref, x, y, nn.functional.cross_entropy)
    got = _planned(model, x, y, nn.functional.cross_entropy, disk_budget_bytes=2**30)
    names = [b.name for b in got[2].profile.blocks]
    k = names.index("latents")
    assert "S" not in got[2].profile.blocks[k].options
    assert "S" in got[2].profile.blocks[names.index("blocks.1")].options
    _equal(got[:2], want)


class Positions(nn.Embedding):
    """Learned positions called with the input's shape (Blenderbot's)."""

    def forward(self, shape: torch.Size) -> torch.Tensor:  # type: ignore[override]
        return super().forward(torch.arange(shape[1]))


class Sinusoid(nn.Module):
    """Positions without parameters whose length is read with ``.item()``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = int((ids >= 0).sum(1).max().item())
        pos = torch.arange(n, dtype=torch.float32)[:, None]
        return torch.sin(pos / 10 ** (torch.arange(32) / 32))


class Shapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.pos = Positions(16, 32)
        self.sin = Sinusoid()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos(ids.shape) + self.sin(ids)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def test_an_embedding_called_with_a_shape_and_item_in_a_module_without_units() -> None:
    torch.manual_seed(0)
    model = Shapes()
    ids = torch.randint(0, 50, (8, 16))
    names = [u.name for u in find_units(model, (ids,))]
    assert "sin" in names  # its .item() cannot run on fake tensors: a unit
    ref = Shapes()
    ref.load_state_dict(model.state_dict())
    want = _plain(ref, (ids,), ids, _ce)
    got = _planned(model, (ids,), ids, _ce, disk_budget_bytes=2**30)
    _equal(got[:2], want)
