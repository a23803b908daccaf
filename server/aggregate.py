"""Validating client updates and averaging them, parameter by parameter.

Every update is checked before it counts: the keys its assignment trains (all of the
model for ``full``, the window and head for ``part``), shapes and dtypes, finite
values, and a norm bound: an update whose relative change
``||update - global|| / ||global||`` (over its keys) exceeds ``norm_factor`` times the
round's median (the lower median, so two updates suffice) is rejected. A rejected
update is logged with its reason and changes nothing.

Influence: every accepted update's change ``update - global`` is clipped
(``clip_changes``, run config ``update-clip``) to the norm a median update would have
over the entries it trained: per key, the lower median over the updates that carry it
of their root-mean-square change per trained entry, ``m_k``; an update that trained
``n_k`` entries of key ``k`` may change them by at most
``sqrt(sum_k n_k * m_k**2)``. Its direction is kept. For a round of whole-model
updates of a one-key model this is the lower median of the updates' norms; per key
(not per set of trained keys) so that a node alone on its window or sub-model is
still measured against the other nodes that trained the same keys, and per entry so
that a sub-model covering half of a key is held to half of its squared norm.

Weights: a reply's claimed example count is capped (run config ``max-examples``),
then clipped to ``weight-clip`` times the round's lower median count
(``clip_weights``), so a node cannot decide the average by claiming 10**15 examples.
With both, a reply's contribution to the average's change has an L2 norm of at most
``(its weight / the weight on each of its keys) x its clip norm``: with whole-model
updates, ``w / W`` of a median update's norm.

Averaging is per key: a weighted mean (by example count) over the updates that carry
the key; keys nobody trained keep the global value. It runs in a fixed order (by
partition id), so two runs with the same seed aggregate to the same bits. The robust
alternatives (``robust_average``: a coordinate-wise median or trimmed mean, Flower's
FedMedian and FedTrimmedAvg) are unweighted, as Flower's are, over the same per-key
sets of updates; weight-clip does not apply to them (the change clip does).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from wire.reply import key_list

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
            f"keys differ: missing {key_list(missing)}, unexpected {key_list(extra)}"
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


@dataclass(frozen=True)
class ChangeClip:
    """How ``clip_changes`` treated one update's change (over its floating entries)."""

    norm: float  # L2 norm of update - global before the clip
    bound: float  # what a median update would change over the same entries

    @property
    def scale(self) -> float:
        """The factor on the change: 1.0 where it was within its bound (to a relative
        1e-9: equal updates' norm and bound differ by float rounding)."""
        if self.norm <= self.bound * (1 + 1e-9):
            return 1.0
        return self.bound / self.norm


def _change_stats(
    update: Update, reference: dict[str, torch.Tensor]
) -> dict[str, tuple[float, int]]:
    """Per floating key the update trained: (squared L2 norm of its change over the
    entries it trained, how many entries that is). A sub-model's masked key counts
    only the entries it covers."""
    out: dict[str, tuple[float, int]] = {}
    for key, got in update.state.items():
        ref = reference[key]
        if not ref.is_floating_point():
            continue
        diff = got.to(torch.float64) - ref.to(torch.float64)
        if _masked(update, key):
            assert update.coverage is not None
            mask = update.coverage[key].to(torch.bool)
            entries, squared = int(mask.sum()), float(diff[mask].square().sum())
        else:
            entries, squared = diff.numel(), float(diff.square().sum())
        if entries:
            out[key] = (squared, entries)
    return out


def clip_changes(
    updates: list[Update], reference: dict[str, torch.Tensor]
) -> tuple[list[Update], list[ChangeClip]]:
    """Every update with its change ``update - reference`` clipped to the norm a
    median update of this round has over the entries it trained (module docstring),
    and how each was clipped, in the order given.

    Per key ``k``, ``m_k`` is the lower median, over the updates that trained ``k``,
    of ``||change_k|| / sqrt(entries trained)``; an update's bound is
    ``sqrt(sum over its keys of entries_k * m_k**2)``, and a change above it is scaled
    down to it (direction kept; computed in float64, cast back). Integer buffers are
    neither measured nor changed. An update within its bound is returned as it is
    (the same object, bit for bit). With one update, nothing is clipped (the lower
    median is its own).
    """
    stats = [_change_stats(u, reference) for u in updates]
    per_entry: dict[str, list[float]] = {}
    for st in stats:
        for key, (squared, entries) in st.items():
            per_entry.setdefault(key, []).append(squared / entries)
    median = {
        key: sorted(values)[(len(values) - 1) // 2] for key, values in per_entry.items()
    }
    clipped: list[Update] = []
    clips: list[ChangeClip] = []
    for u, st in zip(updates, stats, strict=True):
        norm = math.sqrt(sum(squared for squared, _ in st.values()))
        bound = math.sqrt(sum(n * median[key] for key, (_, n) in st.items()))
        clip = ChangeClip(norm, bound)
        clips.append(clip)
        if clip.scale >= 1.0:
            clipped.append(u)
            continue
        state = dict(u.state)
        for key in st:
            ref = reference[key].to(torch.float64)
            change = u.state[key].to(torch.float64) - ref
            state[key] = (ref + clip.scale * change).to(reference[key].dtype)
        clipped.append(replace(u, state=state))
        log.debug(  # about half of the honest updates, every round: not news
            "update of node %s (partition %s): change %.3g clipped to %.3g "
            "(the round's median over the entries it trained)",
            u.node_id,
            u.partition_id,
            norm,
            bound,
        )
    return clipped, clips


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
