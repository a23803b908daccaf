"""The public one-device API (memory.api): plan, then train, equal to plain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memory
from memory import BudgetError, TrainSettings, plan_training


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8)
    )


def _grads(model: nn.Module, plan_budget: int | None, x, y) -> tuple[float, dict]:
    planned = plan_training(
        model,
        x,
        y,
        nn.functional.cross_entropy,
        budget_bytes=plan_budget,
        disk_budget_bytes=0,
    )
    with planned.trainer(settings=TrainSettings(lr=1e-3)) as tr:
        loss = tr.backward(x, y)
        grads = {n: g.clone() for n, g in tr.gradients().items()}
    return loss, grads, planned


def test_plan_then_train_matches_plain() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 64, generator=g)
    y = torch.randint(0, 8, (2048,), generator=g)
    model = _model()
    ref = _model()
    loss_ref = nn.functional.cross_entropy(ref(x), y)
    loss_ref.backward()
    loss, grads, planned = _grads(model, None, x, y)  # the smallest plan
    assert not planned.plan.is_plain
    assert planned.plan.predicted_peak_bytes < planned.plain_peak_bytes
    assert loss == pytest.approx(loss_ref.item(), rel=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


def test_budget_below_the_smallest_plan_is_refused() -> None:
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    with pytest.raises(BudgetError, match="smallest"):
        plan_training(
            _model(),
            x,
            y,
            nn.functional.cross_entropy,
            budget_bytes=1024,
            disk_budget_bytes=0,
        )


def test_public_names() -> None:
    for name in memory.__all__:
        assert getattr(memory, name) is not None
    with pytest.raises(AttributeError):
        memory.not_a_name  # noqa: B018
