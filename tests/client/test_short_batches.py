"""A client with fewer items than a batch trains short batches; a plan with
micro-batches still runs, in equal micro-batches no larger than the plan's."""

from __future__ import annotations

import pytest
import torch

from client.train import short_batch_microbatches, train_chain
from memory.spec import MemoryPlan
from workloads import get_workload


@pytest.mark.parametrize(
    "m, planned, actual, want",
    [
        (1, 256, 140, 1),
        (4, 256, 128, 4),  # divides: kept
        (16, 1024, 140, 4),  # 140 / 4 = 35 <= 64
        (16, 140, 140, 20),  # 140 / 20 = 7 <= 8
        (4, 8, 7, 7),  # prime: one example each
    ],
)
def test_short_batch_microbatches(m, planned, actual, want):
    k = short_batch_microbatches(m, planned=planned, actual=actual)
    assert k == want
    assert actual % k == 0 and actual // k <= max(1, planned // m)


def test_a_short_batch_trains_under_a_microbatched_plan():
    wl = get_workload("digits-cnn")
    items = wl.items().subset(torch.arange(30).numpy())  # a tiny client: 30 items
    stream = wl.batches(items, seed=0)
    batches = [next(stream) for _ in range(2)]
    assert batches[0][0].shape[0] == 30
    model = wl.make_model(0)
    names = [str(i) for i in range(4)]
    plan = MemoryPlan.plain(names)
    plan = MemoryPlan(plan.blocks, num_microbatches=4)  # 30 does not split into 4
    losses, keys = train_chain(
        model, wl.loss_fn, batches, plan=plan, window=None, lr=0.003
    )
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert keys
