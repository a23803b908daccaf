"""A ``module:function`` workload whose nodes misbehave on request, for fault tests.

``FLEETFIT_TEST_FAULT`` in a node's environment: ``hang`` makes every forward pass
sleep ``FLEETFIT_TEST_HANG_S`` seconds (a node past the round's deadline), ``nan``
makes the model's output NaN (a node that returns garbage), ``oversize`` makes every
train reply carry one more array of ``OVERSIZE_BYTES`` random bytes beside the
trained ones (a device running modified code: imported into the ClientApp's
process, this module wraps ``wire.reply.TrainReply.to_content``, which builds the
reply). The server, without the variable, builds and evaluates the same model
normally. Nodes must allow it:
``fleetfit client --allow-workloads tests.reliability.faulty:build``.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from torch import nn

from wire.reply import TrainReply

SPEC = "tests.reliability.faulty:build"
OVERSIZE_KEY = "oversize"
OVERSIZE_BYTES = 64 * 2**20  # far above this model's "auto" max-reply-bytes (~1 MiB)


class Fault(nn.Module):
    """Identity, unless this process's ``FLEETFIT_TEST_FAULT`` says otherwise (a layer,
    not the model's forward, so that block-wise plans run it too)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = os.environ.get("FLEETFIT_TEST_FAULT", "")
        if fault == "hang":
            time.sleep(float(os.environ.get("FLEETFIT_TEST_HANG_S", "60")))
        return x * float("nan") if fault == "nan" else x


def _oversize(to_content: Any) -> Any:
    """``TrainReply.to_content`` that adds ``OVERSIZE_BYTES`` of random float32s
    under ``OVERSIZE_KEY`` to every reply with arrays (random: Flower sends each
    distinct 5 MiB chunk once, so repeated bytes would cross the link smaller)."""

    @functools.wraps(to_content)
    def wrapped(self: TrainReply, arrays: ArrayRecord | None = None) -> RecordDict:
        if arrays is not None:
            big = np.random.default_rng().random(OVERSIZE_BYTES // 4, np.float32)
            arrays[OVERSIZE_KEY] = Array(big)
        return to_content(self, arrays)

    wrapped.oversize = True  # type: ignore[attr-defined]
    return wrapped


if os.environ.get("FLEETFIT_TEST_FAULT") == "oversize" and not getattr(
    TrainReply.to_content, "oversize", False
):
    TrainReply.to_content = _oversize(TrainReply.to_content)  # type: ignore[method-assign]


def build() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), Fault(), nn.ReLU(), nn.Linear(32, 10)
    )
    return model, (x, y), nn.functional.cross_entropy
