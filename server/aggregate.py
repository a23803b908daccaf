"""Validating client updates and averaging them.

Every update is checked before it counts: the expected keys, shapes and dtypes, and
finite values. A rejected update is logged with its reason and changes nothing.
Averaging is weighted by each client's example count and runs in a fixed order (by
partition id), so two runs with the same seed aggregate to the same bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class UpdateRejected(ValueError):
    """A client update failed validation; the message says why."""


@dataclass(frozen=True)
class Update:
    """One client's reply: its state dict, weight and identity."""

    partition_id: int
    node_id: int
    num_examples: int
    state: dict[str, torch.Tensor]


def validate_update(update: Update, reference: dict[str, torch.Tensor]) -> None:
    """Raise ``UpdateRejected`` unless ``update`` matches ``reference`` and is finite."""
    missing = sorted(set(reference) - set(update.state))
    extra = sorted(set(update.state) - set(reference))
    if missing or extra:
        raise UpdateRejected(
            f"keys differ: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    if update.num_examples <= 0:
        raise UpdateRejected(f"num-examples is {update.num_examples}, must be > 0")
    for key, ref in reference.items():
        got = update.state[key]
        if got.shape != ref.shape:
            raise UpdateRejected(
                f"{key}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
            )
        if got.dtype != ref.dtype:
            raise UpdateRejected(f"{key}: dtype {got.dtype} != {ref.dtype}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise UpdateRejected(f"{key}: contains NaN or Inf")


def weighted_average(
    updates: list[Update], reference: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Example-weighted mean of valid updates, in partition-id order.

    Floating tensors are accumulated in float64 and cast back; integer buffers (such
    as BatchNorm's ``num_batches_tracked``) take the largest value. Keys nobody sent
    keep the reference value.
    """
    if not updates:
        return {k: v.clone() for k, v in reference.items()}
    ordered = sorted(updates, key=lambda u: (u.partition_id, u.node_id))
    total = sum(u.num_examples for u in ordered)
    out: dict[str, torch.Tensor] = {}
    for key, ref in reference.items():
        if ref.is_floating_point():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for u in ordered:
                acc += u.state[key].to(torch.float64) * (u.num_examples / total)
            out[key] = acc.to(ref.dtype)
        else:
            out[key] = torch.stack([u.state[key] for u in ordered]).amax(0)
    return out


def accept_updates(
    updates: list[Update], reference: dict[str, torch.Tensor]
) -> tuple[list[Update], list[tuple[Update, str]]]:
    """Split updates into accepted and (rejected, reason), logging each rejection."""
    accepted: list[Update] = []
    rejected: list[tuple[Update, str]] = []
    for u in updates:
        try:
            validate_update(u, reference)
        except UpdateRejected as e:
            log.warning(
                "rejected update of node %s (partition %s): %s",
                u.node_id,
                u.partition_id,
                e,
            )
            rejected.append((u, str(e)))
        else:
            accepted.append(u)
    return accepted, rejected
