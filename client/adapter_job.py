"""The measured child's training function for an ``adapter`` assignment.

A module of its own so that the child preloads peft with it (``partition.measured``
preloads the training function's module before it takes its baseline): peft is
library code, counted in the baseline as torch is, not in the training's peak.
"""

from __future__ import annotations

from typing import Any

import peft  # noqa: F401  (imported before the measuring child's baseline)

from client.train import adapter_factors, train_model
from memory.lora import LoraSpec
from partition.measured import ChildRun


def train_adapter_job(run: ChildRun) -> list[float]:
    """Train the adapters ``run.options["adapters"]`` (``memory.lora.LoraSpec`` as a
    dict) on ``run.model`` under ``run.plan``; write the factors (wire keys) to
    ``run.save_to``."""
    spec: dict[str, Any] = run.options["adapters"]
    adapters = LoraSpec(**{**spec, "targets": tuple(spec["targets"])})
    losses, keys = train_model(
        run.model,
        run.workload,
        run.batches,
        plan=run.plan,
        window=None,
        lr=run.lr,
        offload_dir=run.offload_dir,
        proximal_mu=float(run.options.get("proximal-mu", 0.0)),
        adapters=adapters,
    )
    run.write_state(adapter_factors(run.model, keys))
    return losses
