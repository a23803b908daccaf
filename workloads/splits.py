"""Dividing items across clients: IID, Dirichlet(alpha) label skew, and natural.

All three work on the items' group labels (a digit class, a corpus package family):

- ``iid``: a seeded shuffle dealt out evenly.
- ``dirichlet``: per group, shares drawn from Dirichlet(alpha) over clients (small alpha,
  strong skew); redrawn until every client has at least one item.
- ``natural``: whole groups go to one client each (largest group first, to the client
  with the fewest items), so a client owns data that others lack: one package family
  per client on the corpus, one digit class per client on digits with ten clients.
"""

from __future__ import annotations

import numpy as np

from workloads.errors import WorkloadError

SPLITS = ("iid", "dirichlet", "natural")


def split_indices(
    groups: np.ndarray,
    num_partitions: int,
    kind: str = "iid",
    *,
    seed: int = 0,
    alpha: float = 0.5,
) -> list[np.ndarray]:
    """Indices of each partition's items.

    Args:
        groups: (N,) group label of each item.
        num_partitions: number of clients.
        kind: ``iid``, ``dirichlet`` or ``natural``.
        seed: all randomness derives from it.
        alpha: Dirichlet concentration (``dirichlet`` only); must be > 0.

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
