"""A measuring child's training target whose workload and batch load at import time
(so the import baseline holds the data and libraries, as for a real run's imports).

The workload is named by the environment variable FLEETFIT_CAL_WORKLOAD."""

from __future__ import annotations

import os

import torch
from torch.utils.checkpoint import checkpoint

from memory.blocks import as_blocks
from workloads import get_workload

_WL = get_workload(os.environ.get("FLEETFIT_CAL_WORKLOAD", "gpt-tiny"))
_BATCH = _WL.example_batch(0)
# one tiny op, so that torch's lazily built kernels are part of the baseline
torch.ones(4, 4) @ torch.ones(4, 4)


def train(steps: int = 3, recompute: bool = False) -> dict:
    """Plain training (or every block under torch.utils.checkpoint)."""
    x, y = _BATCH
    model = _WL.make_model(0)
    blocks = as_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        h = x
        for b in blocks:
            h = (
                checkpoint(b.module, h, use_reentrant=False)
                if recompute
                else b.module(h)
            )
        loss = _WL.loss_fn(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        del h, loss
    return {"losses": losses}
