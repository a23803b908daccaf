"""Dividing items across clients: IID, Dirichlet(alpha) label skew, and natural.

All three work on the items' group labels (a digit class, a corpus package family):

- ``iid``: a seeded shuffle dealt out evenly.
- ``dirichlet``: per group, shares drawn from Dirichlet(alpha) over clients (small alpha,
  strong skew); redrawn until every client has at least one item.
- ``natural``: whole groups go to one client each (largest group first, to the client
  with the fewest items), so a client owns data that others lack: one package family
  per client on the corpus, one digit class per client on digits with ten clients.

A natural split can also follow device classes (``classes``: the class index of each
client, as in a fleet where a class's devices hold data that other classes lack): the
groups are first dealt to the classes (largest first, to the class with the fewest items
per client), then each class's items to its clients, whole groups per client where the
class has at least as many groups as clients, else evenly in a seeded shuffle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from workloads.errors import WorkloadError

SPLITS = ("iid", "dirichlet", "natural")
PUBLIC_SEED = 7919  # the public hold-out does not depend on the run's seed


def public_indices(groups: np.ndarray, share: float) -> np.ndarray:
    """The items held out from every client as public data (sorted indices).

    ``floor(share x n)`` items of every group of ``n`` items, drawn with a fixed seed:
    the same items for every run seed, so one pretrained model serves them all; every
    group keeps at least ``n - floor(share x n)`` items for the clients. ``share`` 0:
    none.

    Raises:
        WorkloadError: ``share`` outside [0, 0.5].
    """
    if not 0 <= share <= 0.5:
        raise WorkloadError(f"public share {share!r} must be in [0, 0.5]")
    if share == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(PUBLIC_SEED)
    picked: list[np.ndarray] = []
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        take = int(math.floor(share * len(members)))
        picked.append(rng.permutation(members)[:take])
    return np.sort(np.concatenate(picked)).astype(np.int64)


def private_indices(groups: np.ndarray, share: float) -> np.ndarray:
    """The items left to the clients: every index not in ``public_indices``."""
    keep = np.ones(len(groups), dtype=bool)
    keep[public_indices(groups, share)] = False
    return np.flatnonzero(keep)


def split_indices(
    groups: np.ndarray,
    num_partitions: int,
    kind: str = "iid",
    *,
    seed: int = 0,
    alpha: float = 0.5,
    classes: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Indices of each partition's items.

    Args:
        groups: (N,) group label of each item.
        num_partitions: number of clients.
        kind: ``iid``, ``dirichlet`` or ``natural``.
        seed: all randomness derives from it.
        alpha: Dirichlet concentration (``dirichlet`` only); must be > 0.
        classes: ``natural`` only: the device class (0, 1, ...) of each partition; a
            class's partitions share the groups dealt to that class.

    Raises:
        WorkloadError: an unknown kind, a bad count, or more partitions than the data
            can give one item (or, for ``natural``, one group) each.
    """
    n = len(groups)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int):
        raise WorkloadError(
            f"num_partitions must be an integer, got {num_partitions!r}"
        )
    if num_partitions < 1:
        raise WorkloadError(f"num_partitions must be at least 1, got {num_partitions}")
    if num_partitions > n:
        raise WorkloadError(
            f"{num_partitions} clients but only {n} items: use at most {n} clients"
        )
    rng = np.random.default_rng(seed)
    if kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(n), num_partitions)]
    if kind == "dirichlet":
        if not alpha > 0:
            raise WorkloadError(f"dirichlet alpha must be > 0, got {alpha}")
        return _dirichlet(groups, num_partitions, rng, alpha)
    if kind == "natural":
        if classes is not None:
            return _by_class(groups, num_partitions, classes, seed)
        return _natural(groups, num_partitions)
    raise WorkloadError(f"unknown split {kind!r}: choose one of {', '.join(SPLITS)}")


def _dirichlet(
    groups: np.ndarray, k: int, rng: np.random.Generator, alpha: float
) -> list[np.ndarray]:
    labels = np.unique(groups)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(k)]
        for g in labels:
            members = rng.permutation(np.flatnonzero(groups == g))
            shares = rng.dirichlet(np.full(k, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for i, piece in enumerate(np.split(members, cuts)):
                parts[i].extend(piece.tolist())
        if min(len(p) for p in parts) > 0:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise WorkloadError(
        f"dirichlet(alpha={alpha}) left a client empty in 100 draws for {k} clients: "
        "raise alpha or use fewer clients"
    )


def _natural(groups: np.ndarray, k: int) -> list[np.ndarray]:
    labels, counts = np.unique(groups, return_counts=True)
    if len(labels) < k:
        raise WorkloadError(
            f"a natural split needs a group per client, but the data has {len(labels)} "
            f"groups for {k} clients: use at most {len(labels)} clients, or iid/dirichlet"
        )
    order = sorted(range(len(labels)), key=lambda i: (-counts[i], labels[i]))
    sizes = np.zeros(k, dtype=np.int64)
    owned: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        c = int(np.argmin(sizes))  # ties go to the lowest client index
        owned[c].append(int(labels[i]))
        sizes[c] += counts[i]
    return [np.flatnonzero(np.isin(groups, own)) for own in owned]


def class_groups(groups: np.ndarray, classes: Sequence[int]) -> dict[int, int]:
    """Which device class owns each group of a class-following natural split.

    Largest group first, to the class with the fewest items per client (ties: lowest
    class index); every class gets at least one group.

    Raises:
        WorkloadError: a class index that is not an integer >= 0, a class with no
            client, or fewer groups than classes.
    """
    counts_per_class = _class_sizes(classes)
    labels, counts = np.unique(groups, return_counts=True)
    k = len(counts_per_class)
    if len(labels) < k:
        raise WorkloadError(
            f"a natural split by device class needs a group per class, but the data "
            f"has {len(labels)} groups for {k} classes: use fewer classes or iid"
        )
    order = sorted(range(len(labels)), key=lambda i: (-counts[i], labels[i]))
    load = np.zeros(k, dtype=np.float64)
    owner: dict[int, int] = {}
    for rank, i in enumerate(order):
        if rank < k:  # every class gets one group first, the largest to the first
            c = rank
        else:
            c = int(np.argmin(load / counts_per_class))
        owner[int(labels[i])] = c
        load[c] += counts[i]
    return owner


def _class_sizes(classes: Sequence[int]) -> np.ndarray:
    if not len(classes):
        raise WorkloadError("classes must name the device class of every partition")
    for c in classes:
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
            raise WorkloadError(
                f"device class {c!r} must be an integer >= 0 (one per partition)"
            )
    sizes = np.bincount(np.asarray(classes, dtype=np.int64))
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        raise WorkloadError(
            f"device class {int(empty[0])} has no partition: number the classes "
            f"0..{len(sizes) - 1} without gaps"
        )
    return sizes


def _by_class(
    groups: np.ndarray, k: int, classes: Sequence[int], seed: int
) -> list[np.ndarray]:
    if len(classes) != k:
        raise WorkloadError(
            f"classes has {len(classes)} entries for {k} partitions: give one per "
            "partition"
        )
    owner = class_groups(groups, classes)
    cls = np.asarray(classes, dtype=np.int64)
    parts: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * k
    for c in range(int(cls.max()) + 1):
        members = np.flatnonzero(cls == c)
        mine = [g for g, o in owner.items() if o == c]
        idx = np.flatnonzero(np.isin(groups, mine))
        if len(idx) < len(members):
            raise WorkloadError(
                f"device class {c} has {len(members)} clients but its groups hold only "
                f"{len(idx)} items: use fewer clients in that class"
            )
        if len(mine) >= len(members):
            pieces = [idx[p] for p in _natural(groups[idx], len(members))]
        else:
            rng = np.random.default_rng([seed, c])
            pieces = [
                np.sort(p) for p in np.array_split(rng.permutation(idx), len(members))
            ]
        for m, piece in zip(members, pieces, strict=True):
            parts[int(m)] = piece
    return parts
