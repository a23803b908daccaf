"""Central differential privacy for fleetfit's own aggregation (pure functions).

Flower's DP strategy wrappers (``DifferentialPrivacyServerSideFixedClipping`` and the
client-side variant) wrap a Flower ``Strategy``; fleetfit's server is its own loop, so
this module does the same for it, with Flower's formulas and helpers
(``flwr.supercore.differential_privacy``), extended to partial updates:

- every accepted update's change ``update - global`` is clipped to L2 norm
  ``clipping_norm`` over the floating keys it carries (Flower's ``FlatClip``;
  integer buffers such as BatchNorm's step counters are neither counted nor noised);
- per key, the clipped changes are summed, Gaussian noise of standard deviation
  ``noise_multiplier * clipping_norm`` is added to the sum, and the sum is divided by
  the number of nodes *assigned* that key this round (fixed before any reply: a node
  that does not answer contributes a zero change, so the divisor, and with it the
  sensitivity, does not depend on the replies). For ``full`` assignments only this is
  exactly Flower's ``compute_stdv``: ``noise_multiplier * clipping_norm / m`` on the
  average. A key trained by ``m_k`` nodes gets ``... / m_k``: the noisy sum is one
  Gaussian mechanism of sensitivity ``clipping_norm`` (a node's whole clipped change),
  and dividing each key by a count fixed by the assignments is post-processing.
- weights are uniform (Flower's accountant also requires equal weights): example
  counts would let one node's weight, and with it the sensitivity, grow.

Noise comes from the operating system's entropy unless a generator is passed (tests):
seeded noise could be subtracted by anyone who knows the seed, so DP runs are not
bit-for-bit reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from flwr.supercore.differential_privacy import compute_stdv

from server.aggregate import Update

KEY_CLIPPING_NORM = "clipping_norm"  # Flower's key in a train instruction's config


def update_norm(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]
) -> float:
    """L2 norm of ``state - reference`` over ``state``'s floating keys (float64)."""
    total = 0.0
    for key, got in state.items():
        if got.is_floating_point():
            diff = got.to(torch.float64) - reference[key].to(torch.float64)
            total += float(diff.square().sum())
    return total**0.5


def clip_update(
    state: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    clipping_norm: float,
) -> tuple[dict[str, torch.Tensor], float]:
    """The change ``state - reference`` clipped to L2 norm ``clipping_norm`` (float64),
    over ``state``'s floating keys, and the norm before clipping."""
    if not clipping_norm > 0:
        raise ValueError(f"clipping_norm={clipping_norm!r} must be > 0")
    norm = update_norm(state, reference)
    scale = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
    return {
        key: (got.to(torch.float64) - reference[key].to(torch.float64)) * scale
        for key, got in state.items()
        if got.is_floating_point()
    }, norm


def expected_counts(
    assigned: Iterable[frozenset[str] | None], reference: dict[str, torch.Tensor]
) -> dict[str, int]:
    """Per key, how many nodes were assigned to train it this round; ``None`` stands
    for a ``full`` (or plain) node, which trains every key. Leave ``none`` nodes out."""
    counts = dict.fromkeys(reference, 0)
    for keys in assigned:
        for key in reference if keys is None else keys:
            counts[key] += 1
    return counts


def private_average(
    updates: Sequence[Update],
    reference: dict[str, torch.Tensor],
    *,
    clipping_norm: float,
    noise_multiplier: float,
    counts: dict[str, int] | None = None,
    rng: np.random.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The new global state from clipped, noised, uniformly averaged updates.

    ``counts``: per key, the nodes assigned to train it (``expected_counts``); without
    it, the number of updates that carry the key (Flower's behaviour, which
    under-noises when nodes drop out). Returns the state and a record for the
    round's summary: clipping norm, noise multiplier, per-update norms before
    clipping, how many were clipped, and the noise standard deviation on a key
    trained by every assigned node.
    """
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be >= 0")
    rng = rng if rng is not None else np.random.default_rng()
    ordered = sorted(updates, key=lambda u: (u.partition_id, u.node_id))
    clipped = []
    norms = []
    for u in ordered:
        change, norm = clip_update(u.state, reference, clipping_norm)
        clipped.append(change)
        norms.append(norm)
    if counts is None:
        counts = expected_counts((frozenset(u.state) for u in ordered), reference)
    out: dict[str, torch.Tensor] = {}
    for key, ref in reference.items():
        have = [c[key] for c in clipped if key in c]
        m = counts.get(key, 0)
        if not ref.is_floating_point():
            ints = [u.state[key] for u in ordered if key in u.state]
            out[key] = torch.stack(ints).amax(0) if ints else ref.clone()
            continue
        if m == 0 or not have:
            out[key] = ref.clone()  # nobody trained it: nothing about data released
            continue
        m = max(m, len(have))  # never fewer than the updates that carry the key
        total = torch.zeros(ref.shape, dtype=torch.float64)
        for c in have:
            total += c
        if noise_multiplier > 0:
            std = noise_multiplier * clipping_norm
            total += torch.from_numpy(rng.normal(0.0, std, size=tuple(ref.shape)))
        out[key] = (ref.to(torch.float64) + total / m).to(ref.dtype)
    full = max(counts.values(), default=0)
    record = {
        "clipping_norm": clipping_norm,
        "noise_multiplier": noise_multiplier,
        "noise_std": compute_stdv(noise_multiplier, clipping_norm, full)
        if full
        else None,
        "update_norms": [round(n, 6) for n in norms],
        "num_clipped": sum(n > clipping_norm for n in norms),
    }
    return out, record
