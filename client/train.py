"""Local training on a client's share of the data."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from workloads import Workload


@dataclass(frozen=True)
class TrainResult:
    num_examples: int  # items in the client's share (images, or corpus chunks)
    mean_loss: float  # mean training loss over the local steps
    train_s: float  # wall time of the local steps, seconds


def train_local(
    model: nn.Module,
    workload: Workload,
    partition_id: int,
    num_partitions: int,
    *,
    split: str,
    alpha: float,
    seed: int,
    server_round: int,
    local_steps: int,
    lr: float,
) -> TrainResult:
    """``local_steps`` AdamW steps on this client's share; batch order from the seeds."""
    items = workload.client_items(
        partition_id, num_partitions, split, seed=seed, alpha=alpha
    )
    data_seed, torch_seed = np.random.SeedSequence(
        [seed, server_round, partition_id]
    ).generate_state(2)
    batches = workload.batches(items, seed=int(data_seed))
    torch.manual_seed(int(torch_seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    total = 0.0
    t0 = time.monotonic()
    for _ in range(local_steps):
        inputs, targets = next(batches)
        loss = workload.loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += float(loss.detach())
    return TrainResult(len(items), total / local_steps, time.monotonic() - t0)
