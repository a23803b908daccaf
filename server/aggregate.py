"""Validating client updates and averaging them, parameter by parameter.

Every update is checked before it counts: the keys its assignment trains (all of the
model for ``full``, the window and head for ``part``), shapes and dtypes, finite
values, and a norm bound: an update whose relative change
``||update - global|| / ||global||`` (over its keys) exceeds ``norm_factor`` times the
round's median (the lower median, so two updates suffice) is rejected. A rejected
update is logged with its reason and changes nothing.

Weights: a reply's claimed example count is capped (run config ``max-examples``),
then clipped to ``weight-clip`` times the round's lower median count
(``clip_weights``), so a node cannot decide the average by claiming 10**15 examples.

Averaging is per key: a weighted mean (by example count) over the updates that carry
the key; keys nobody trained keep the global value. It runs in a fixed order (by
partition id), so two runs with the same seed aggregate to the same bits. The robust
alternatives (``robust_average``: a coordinate-wise median or trimmed mean, Flower's
FedMedian and FedTrimmedAvg) are unweighted, as Flower's are, over the same per-key
sets of updates; weight-clip does not apply to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

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
    expected: frozenset[str] | None = None  # keys its assignment trains (None: all)
    coverage: dict[str, torch.Tensor] | None = None  # a sub-model's update
    #   (server.submodel): per key it covers only partly, a boolean mask of the
    #   entries it trained; the rest of that key holds the global values


def validate_update(update: Update, reference: dict[str, torch.Tensor]) -> None:
    """Raise ``UpdateRejected`` unless ``update`` carries exactly the keys it was
    assigned, with ``reference``'s shapes and dtypes, and finite values."""
    want = set(reference) if update.expected is None else set(update.expected)
    missing = sorted(want - set(update.state))
    extra = sorted(set(update.state) - want)
    if missing or extra:
        raise UpdateRejected(
            f"keys differ: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    if update.num_examples <= 0:
        raise UpdateRejected(f"num-examples is {update.num_examples}, must be > 0")
    for key in sorted(want):
        ref, got = reference[key], update.state[key]
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
    """Per-key example-weighted mean of valid updates, in partition-id order.

    Each key is averaged over the updates that carry it; where an update's
    ``coverage`` masks a key (a HeteroFL/FedRolex sub-model), each entry is
    averaged over the updates that cover it, and entries nobody covered keep the
    reference value. Floating tensors are accumulated in float64 and cast back;
    integer buffers (such as BatchNorm's ``num_batches_tracked``) take the largest
    value. Keys nobody sent keep the reference value.
    """
    ordered = sorted(updates, key=lambda u: (u.partition_id, u.node_id))
    out: dict[str, torch.Tensor] = {}
    for key, ref in reference.items():
        have = [u for u in ordered if key in u.state]
        if not have:
            out[key] = ref.clone()
        elif ref.is_floating_point() and any(_masked(u, key) for u in have):
            out[key] = _masked_average(have, key, ref)
        elif ref.is_floating_point():
            total = sum(u.num_examples for u in have)
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for u in have:
                acc += u.state[key].to(torch.float64) * (u.num_examples / total)
            out[key] = acc.to(ref.dtype)
        else:
            out[key] = torch.stack([u.state[key] for u in have]).amax(0)
    return out


def _masked(u: Update, key: str) -> bool:
    return u.coverage is not None and key in u.coverage


def _masked_average(have: list[Update], key: str, ref: torch.Tensor) -> torch.Tensor:
    """Per entry, the example-weighted mean over the updates covering it (an update
    without a mask for ``key`` covers all of it); uncovered entries keep ``ref``."""
    acc = torch.zeros(ref.shape, dtype=torch.float64)
    total = torch.zeros(ref.shape, dtype=torch.float64)
    for u in have:
        w = float(u.num_examples)
        value = u.state[key].to(torch.float64)
        if _masked(u, key):
            assert u.coverage is not None
            mask = u.coverage[key].to(torch.float64)
            acc += w * mask * value
            total += w * mask
        else:
            acc += w * value
            total += w
    covered = total > 0
    out = ref.to(torch.float64).clone()
    out[covered] = acc[covered] / total[covered]
    return out.to(ref.dtype)


def robust_average(
    updates: list[Update],
    reference: dict[str, torch.Tensor],
    *,
    how: str,
    trim_fraction: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Per-key coordinate-wise ``median`` or ``trimmed-mean`` of valid updates,
    unweighted (example counts do not enter), over the updates that carry the key.

    ``median``: of an even number of values, the mean of the two middle ones (numpy's
    and Flower's FedMedian). ``trimmed-mean``: ``int(trim_fraction * n)`` values cut
    at each end, the rest averaged (Flower's FedTrimmedAvg with ``beta``). Computed in
    float64 and cast back; integer buffers take the largest value and keys nobody
    sent keep the reference value, as in ``weighted_average``.
    """
    assert how in ("median", "trimmed-mean"), how
    ordered = sorted(updates, key=lambda u: (u.partition_id, u.node_id))
    out: dict[str, torch.Tensor] = {}
    for key, ref in reference.items():
        have = [u.state[key] for u in ordered if key in u.state]
        if not have:
            out[key] = ref.clone()
            continue
        if not ref.is_floating_point():
            out[key] = torch.stack(have).amax(0)
            continue
        values = torch.stack([v.to(torch.float64) for v in have]).sort(dim=0).values
        n = len(have)
        if how == "median":
            lo, hi = (n - 1) // 2, n // 2
            mid = (values[lo] + values[hi]) / 2 if lo != hi else values[lo]
        else:
            cut = int(trim_fraction * n)
            mid = values[cut : n - cut].mean(0)
        out[key] = mid.to(ref.dtype)
    return out


def clip_weights(updates: list[Update], factor: float) -> list[Update]:
    """Updates whose example counts are at most ``factor`` times the (lower) median
    count of ``updates``: a node's claim bounds its weight, it cannot decide the
    average by claiming more examples. ``factor`` 0 leaves the counts."""
    if factor <= 0 or len(updates) < 2:
        return list(updates)
    counts = sorted(u.num_examples for u in updates)
    cap = max(1, int(factor * counts[(len(counts) - 1) // 2]))
    return [
        u if u.num_examples <= cap else replace(u, num_examples=cap) for u in updates
    ]


def relative_change(update: Update, reference: dict[str, torch.Tensor]) -> float:
    """``||update - reference|| / ||reference||`` over the update's floating keys."""
    num = den = 0.0
    for key, got in update.state.items():
        ref = reference[key]
        if not ref.is_floating_point():
            continue
        num += float((got.to(torch.float64) - ref.to(torch.float64)).square().sum())
        den += float(ref.to(torch.float64).square().sum())
    return (num**0.5) / max(den**0.5, 1e-12)


def accept_updates(
    updates: list[Update],
    reference: dict[str, torch.Tensor],
    *,
    norm_factor: float = 0.0,
) -> tuple[list[Update], list[tuple[Update, str]]]:
    """Split updates into accepted and (rejected, reason), logging each rejection.

    ``norm_factor > 0`` also rejects updates whose relative change exceeds that many
    times the (lower) median relative change of the round's otherwise valid updates.
    """
    valid: list[Update] = []
    rejected: list[tuple[Update, str]] = []

    def reject(u: Update, reason: str) -> None:
        log.warning(
            "rejected update of node %s (partition %s): %s",
            u.node_id,
            u.partition_id,
            reason,
        )
        rejected.append((u, reason))

    for u in updates:
        try:
            validate_update(u, reference)
        except UpdateRejected as e:
            reject(u, str(e))
        else:
            valid.append(u)
    if norm_factor <= 0 or len(valid) < 2:
        return valid, rejected
    changes = [relative_change(u, reference) for u in valid]
    median = sorted(changes)[(len(changes) - 1) // 2]
    bound = norm_factor * median
    accepted = []
    for u, c in zip(valid, changes):
        if median > 0 and c > bound:
            reject(
                u,
                f"norm: relative change {c:.3g} exceeds {norm_factor:g} x the "
                f"round's median {median:.3g}",
            )
        else:
            accepted.append(u)
    return accepted, rejected
