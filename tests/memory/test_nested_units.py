"""Units inside containers the forward unpacks, and parameters no unit holds (issue 34,
item 3).

A U-Net-like model as common diffusion code writes it keeps its blocks in a
``ModuleList`` of ``ModuleList`` s and unpacks them in ``forward`` (``for r1, r2,
attn, down in self.downs``): the inner lists are never called, so taking them as units
left most of the model's parameters in no unit and priced nowhere (plans predicted 95
MiB and measured over 145). Now the inner lists are opened to their blocks, a
parameter registered on the model itself is priced as resident with its gradient and
AdamW state, and plans train to plain's losses and gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.unit_profile import outside_state_bytes, profile_units
from memory.units import find_units, outside_parameters


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, c)
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(torch.nn.functional.silu(self.norm(x)))


class Attention(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(c, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        s = x.flatten(2).transpose(1, 2)
        out, _ = self.attn(s, s, s, need_weights=False)
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class UNetish(nn.Module):
    """Blocks in a list of lists, unpacked by ``forward``; ``proj`` is registered on
    the model itself (no unit can hold it)."""

    def __init__(self, c: int = 16, levels: int = 2) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.downs = nn.ModuleList(
            nn.ModuleList(
                [ResBlock(c), ResBlock(c), Attention(c), nn.Conv2d(c, c, 4, 2, 1)]
            )
            for _ in range(levels)
        )
        self.proj = nn.Parameter(torch.randn(c, 1024) / c**0.5)
        self.out = nn.Linear(1024, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for r1, r2, attn, down in self.downs:
            h = down(attn(r2(r1(h))))
        return self.out(h.mean((2, 3)) @ self.proj)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(
        0, 10, (4,), generator=g
    )


def _model() -> UNetish:
    torch.manual_seed(0)
    return UNetish()


def test_blocks_in_unpacked_lists_are_units_and_the_rest_is_priced() -> None:
    model = _model()
    x, y = _batch()
    units = find_units(model, x)
    names = [u.name for u in units]
    assert names[:5] == [
        "inp",
        "downs.0.0",
        "downs.0.1",
        "downs.0.2",
        "downs.0.3",
    ], names
    assert names[-1] == "out" and "downs.1.3" in names
    assert outside_parameters(model, units) == ["proj"]
    proj = model.proj.numel() * model.proj.element_size()
    assert outside_state_bytes(model, units) == 4 * proj  # value, gradient, 2 AdamW
    profile = profile_units(
        model, x, y, nn.functional.cross_entropy, units=units, max_microbatches=1
    )
    inputs = x.numel() * x.element_size() + y.numel() * y.element_size()
    assert profile.batch_bytes == inputs + 4 * proj
    priced = sum(b.param_bytes for b in profile.blocks)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert priced + proj == held  # every parameter: in a block or outside, once


def _train(plan_of) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    x, y = _batch()
    units = find_units(model, x)
    plan = plan_of([u.name for u in units])
    losses, grads = [], {}
    settings = TrainSettings(lr=1e-3, clip_norm=1.0)  # streamed gradients kept
    with PlannedTrainer(
        model, plan, units=units, loss_fn=nn.functional.cross_entropy, settings=settings
    ) as tr:
        for s in range(3):
            losses.append(tr.backward(x, y))
            if s == 0:
                grads = {n: g.clone() for n, g in tr.gradients().items()}
            tr._calls += 1
            tr._update()
    return losses, grads


@pytest.mark.parametrize("how", ["recompute", "stream"])
def test_plans_over_the_opened_units_equal_plain(how: str) -> None:
    ref_losses, ref_grads = _train(MemoryPlan.plain)

    def plan_of(names: list[str]) -> MemoryPlan:
        state = "stream" if how == "stream" else "resident"
        return MemoryPlan(tuple(BlockPlan(n, "recompute", state) for n in names))

    losses, grads = _train(plan_of)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n


def test_a_module_whose_own_code_cannot_run_on_fake_tensors_is_one_unit() -> None:
    """AdaptiveLogSoftmaxWithLoss holds a list of clusters (layers) and selects each
    cluster's rows with ``nonzero`` in its own code, between them: it is not opened
    into its clusters but becomes one unit, which the profile measures on real
    tensors (memory.real_profile); the plan trains like plain."""
    from memory import TrainSettings, plan_training
    from memory.units import find_units

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 32)
            self.head = nn.AdaptiveLogSoftmaxWithLoss(32, 12, cutoffs=[4, 8])

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.head(self.inp(x), y).loss

    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(64, 8), torch.randint(0, 12, (64,))
    assert [u.name for u in find_units(model, (x, y))] == ["inp", "head"]
    ref = Model()
    ref.load_state_dict(model.state_dict())
    ref(x, y).backward()
    planned = plan_training(model, (x, y), None, lambda out, _y: out)
    # clipping defers the update: streamed units' gradients wait to be read
    with planned.trainer(settings=TrainSettings(lr=1e-3, clip_norm=1.0)) as tr:
        loss = tr.backward((x, y), None)
        grads = tr.gradients()
    assert loss == pytest.approx(float(ref(x, y)), rel=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)
