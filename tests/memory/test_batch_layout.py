"""A model says what its batch is (issue 34, item 7): ``batch_inputs``.

A whole graph as one batch (node features and an edge index) failed even plainly: the
runtime probe cut every tensor whose first dimension equals the batch to its first two
items (the node features, not the edge index: ``IndexError``), and micro-batches would
do the same. ``batch_inputs = ()`` says the batch must never be cut; ``batch_inputs =
("x",)`` names the batch-shaped inputs, so a per-batch table whose first dimension
happens to equal the batch is not cut either.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memory.batch import batch_layout, batch_size_of, first_items, split_batch
from memory.errors import MemoryPlanError
from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings, runtime_probe
from memory.unit_profile import plan_units, unit_profiles
from memory.units import find_units

N, F = 40, 8


class GraphNet(nn.Module):
    """Two rounds of neighbour sums over one graph; the loss is over every node."""

    batch_inputs = ()  # one graph: never cut

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(F, F) for _ in range(2))
        self.out = nn.Linear(F, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            h = lin(x)
            agg = torch.zeros_like(h).index_add(0, edge_index[1], h[edge_index[0]])
            x = torch.relu(h + agg)
        return self.out(x)


class UncutGraph(GraphNet):
    batch_inputs = None  # as a model that says nothing: every batch-sized tensor cut


def graph(cls: type = GraphNet):
    """A ``module:function`` factory: one graph of N nodes, a label per node."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, F, generator=g)
    edges = torch.randint(0, N, (2, 120), generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    return cls(), ((x, edges), y), nn.functional.cross_entropy


def uncut_graph():
    return graph(UncutGraph)


def _train(plan_of, cls: type = GraphNet) -> list[float]:
    model, (x, y), loss = graph(cls)
    units = find_units(model, x)
    plan = plan_of([u.name for u in units])
    with PlannedTrainer(
        model, plan, units=units, loss_fn=loss, settings=TrainSettings()
    ) as tr:
        out = tr.train([(x, y)] * 3)
        tr.close()
    return out


def test_a_graph_batch_is_never_cut() -> None:
    with pytest.raises(IndexError):  # what a model that says nothing met
        runtime_probe("tests.memory.test_batch_layout:uncut_graph", {})
    assert runtime_probe("tests.memory.test_batch_layout:graph", {})["file_bytes"] >= 0
    model, (x, y), loss = graph()
    assert batch_layout(model) == () and batch_size_of(x, ()) == 1
    assert first_items(x, y, 2, ()) == (x, y)
    profiles = unit_profiles(model, x, y, loss)
    assert profiles[1].batch_size == 1 and profiles[1].microbatch_options == (1,)
    plan, _ = plan_units(profiles, None, disk_budget_bytes=2**30)
    assert plan.num_microbatches == 1
    with pytest.raises(MemoryPlanError, match="must not be cut") as e:
        split_batch(x, y, 2, ())
    assert "\n" not in str(e.value)
    plain = _train(MemoryPlan.plain)
    streamed = _train(
        lambda names: MemoryPlan(
            tuple(BlockPlan(n, "recompute", "stream") for n in names)
        )
    )
    assert streamed == plain
    with pytest.raises(MemoryPlanError, match="num_microbatches=1"):
        _train(
            lambda names: MemoryPlan(MemoryPlan.plain(names).blocks, num_microbatches=2)
        )


class WithPrototypes(nn.Module):
    """Scores each example against a table of 4 class prototypes, given as an input
    whose first dimension (4) equals the batch's: only ``x`` is batch-shaped."""

    batch_inputs = ("x",)

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(F, F)
        self.proj = nn.Linear(F, F)

    def forward(self, x: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.enc(x))) @ prototypes.T


def test_only_the_named_inputs_are_cut() -> None:
    g = torch.Generator().manual_seed(2)
    x = {
        "x": torch.randn(4, F, generator=g),
        "prototypes": torch.randn(4, F, generator=g),
    }
    y = torch.randint(0, 4, (4,), generator=g)
    parts = split_batch(x, y, 2, ("x",))
    assert [p[0]["x"].shape[0] for p in parts] == [2, 2]
    assert all(p[0]["prototypes"] is x["prototypes"] for p in parts)
    assert [p[1].shape[0] for p in parts] == [2, 2]

    def run(m: int) -> list[float]:
        torch.manual_seed(0)
        model = WithPrototypes()
        units = find_units(model, x)
        plan = MemoryPlan(
            MemoryPlan.plain([u.name for u in units]).blocks, num_microbatches=m
        )
        with PlannedTrainer(
            model, plan, units=units, loss_fn=nn.functional.cross_entropy
        ) as tr:
            return tr.train([(x, y)] * 2)

    plain, split = run(1), run(2)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(split, plain))


def test_a_malformed_batch_inputs_is_one_line() -> None:
    model = GraphNet()
    model.batch_inputs = "x"  # type: ignore[assignment]
    with pytest.raises(MemoryPlanError, match="batch_inputs is 'x'") as e:
        batch_layout(model)
    assert "\n" not in str(e.value)
    with pytest.raises(MemoryPlanError, match="'nope'"):
        batch_size_of({"x": torch.ones(2)}, ("nope",))
