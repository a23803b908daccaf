"""``nn.EmbeddingBag`` tables are row-streamed like ``nn.Embedding`` (issue 34, item
10): a two-tower recommender's streamed tables are looked up in their files and get
sparse gradients summed into the store, so their plans are priced by the rows looked
up (they were priced as whole tables streamed with dense gradients, 1.375x over) and
train to plain's losses, gradients and weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.streaming import row_lookups
from memory.unit_profile import profile_units
from memory.units import find_units

USERS, ITEMS, D = 65536, 65536, 32


class TwoTower(nn.Module):
    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        self.users = nn.EmbeddingBag(USERS, D, mode=mode)
        self.items = nn.EmbeddingBag(ITEMS, D, mode="sum")
        self.user_mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.item_mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def forward(self, x: dict) -> torch.Tensor:
        u = self.user_mlp(self.users(x["user_history"]))
        v = self.item_mlp(self.items(x["item_tags"]))
        return (u * v).sum(-1)


def _batch() -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = {
        "user_history": torch.randint(0, USERS, (16, 5), generator=g),
        "item_tags": torch.randint(0, ITEMS, (16, 3), generator=g),
    }
    return x, torch.randint(0, 2, (16,), generator=g).float()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(out, y)


def _train(stream: bool, mode: str = "mean"):
    torch.manual_seed(0)
    model = TwoTower(mode)
    x, y = _batch()
    units = find_units(model, (x,))
    names = [u.name for u in units]
    state = "stream" if stream else "resident"
    plan = MemoryPlan(
        tuple(
            BlockPlan(n, "keep", state if n in ("users", "items") else "resident")
            for n in names
        )
    )
    settings = TrainSettings(lr=1e-2, clip_norm=1.0)  # streamed gradients kept
    losses, grads = [], {}
    with PlannedTrainer(
        model, plan, units=units, loss_fn=_loss, settings=settings
    ) as tr:
        for s in range(3):
            losses.append(tr.backward((x,), y))
            if s == 0:
                grads = {
                    n: g.to_dense() if g.is_sparse else g.clone()
                    for n, g in tr.gradients().items()
                }
            tr._calls += 1
            tr._update()
        tr.close()
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}


def test_bags_are_row_lookups_and_priced_by_rows() -> None:
    torch.manual_seed(0)
    model = TwoTower()
    x, y = _batch()
    units = find_units(model, (x,))
    lookups = row_lookups(units)
    found = {type(m).__name__ for ms in lookups.values() for m in ms}
    assert found == {"EmbeddingBag"}
    profile = profile_units(model, (x,), y, _loss, units=units, max_microbatches=1)
    by = {b.name: b.costs[1] for b in profile.blocks}
    users = USERS * D * 4
    # the rows of 16 x 5 lookups, not the table
    assert 0 < by["users"].row_load_bytes < users / 4
    assert by["users"].row_dense_grad_bytes == users
    max_bag = nn.EmbeddingBag(8, 2, mode="max")
    assert row_lookups([type(units[0])("m", max_bag)]) == {}  # no sparse gradient


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_streamed_bags_train_as_plain(mode: str) -> None:
    """Losses, first gradients and the weights after 3 AdamW steps: bit for bit
    (the store sums a bag's sparse rows in the order the dense backward does)."""
    ref_losses, ref_grads, ref_state = _train(False, mode)
    losses, grads, state = _train(True, mode)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n
    for n, v in ref_state.items():
        assert torch.equal(state[n], v), n
