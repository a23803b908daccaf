"""A ``module:function`` workload whose nodes misbehave on request, for fault tests.

``FLEETFIT_TEST_FAULT`` in a node's environment: ``hang`` makes every forward pass
sleep ``FLEETFIT_TEST_HANG_S`` seconds (a node past the round's deadline), ``nan``
makes the model's output NaN (a node that returns garbage). The server, without the
variable, builds and evaluates the same model normally. Nodes must allow it:
``fleetfit client --allow-workloads tests.reliability.faulty:build``.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

SPEC = "tests.reliability.faulty:build"


class Fault(nn.Module):
    """Identity, unless this process's ``FLEETFIT_TEST_FAULT`` says otherwise (a layer,
    not the model's forward, so that block-wise plans run it too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = os.environ.get("FLEETFIT_TEST_FAULT", "")
        if fault == "hang":
            time.sleep(float(os.environ.get("FLEETFIT_TEST_HANG_S", "60")))
        return x * float("nan") if fault == "nan" else x


def build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), Fault(), nn.ReLU(), nn.Linear(32, 10)
    )
    return model, (x, y), nn.functional.cross_entropy
