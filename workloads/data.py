"""Data that ships with the installation: scikit-learn's digits and a byte-level corpus
made from the Python standard library's own ``.py`` sources. Nothing is downloaded.

Both are returned as *items* with a *group* label, so that ``splits`` can divide them
across clients the same way: a digit image grouped by its class, or a corpus chunk
grouped by its standard-library package family (``email``, ``asyncio``, ...).
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

CHUNK_BYTES = 1024  # corpus chunk: the unit split across clients and held out for test
TEST_EVERY = 10  # every 10th chunk (digits: 1 in 5 images) is held out for central test


@dataclass(frozen=True)
class Items:
    """Training or test items with one group label each."""

    inputs: torch.Tensor  # digits: (N, 1, 8, 8) float32; corpus: (N, CHUNK_BYTES) uint8
    targets: torch.Tensor | None  # digits: (N,) int64; corpus: None (next bytes)
    groups: np.ndarray  # (N,) int64: class (digits) or package family (corpus)
    group_names: tuple[str, ...]

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def subset(self, index: np.ndarray) -> Items:
        idx = torch.as_tensor(index, dtype=torch.long)
        return Items(
            self.inputs[idx],
            None if self.targets is None else self.targets[idx],
            self.groups[index],
            self.group_names,
        )


@functools.cache
def digits() -> tuple[Items, Items]:
    """scikit-learn's 1,797 digits as (train, test); the same 20% is always held out."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    groups = bunch.target.astype(np.int64)
    # Fixed, seed-independent hold-out: every 5th image of each class.
    rank = np.zeros(len(y), dtype=np.int64)
    for c in range(10):
        members = np.flatnonzero(groups == c)
        rank[members] = np.arange(len(members))
    test = rank % 5 == 4
    names = tuple(str(c) for c in range(10))
    full = Items(x, y, groups, names)
    return full.subset(np.flatnonzero(~test)), full.subset(np.flatnonzero(test))


def stdlib_sources() -> list[tuple[str, str]]:
    """(family, path) of every ``.py`` file of the standard library, sorted by path.

    The family is the top-level package or module name (``email`` for
    ``email/mime/text.py``); site-packages is excluded.
    """
    root = sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "__pycache__")
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            top = rel.split(os.sep)[0]
            family = top[:-3] if top.endswith(".py") else top
            found.append((family, path))
    found.sort(key=lambda fp: fp[1])
    if not found:
        raise FileNotFoundError(f"no .py sources found under {root}")
    return found


@functools.cache
def corpus(max_bytes: int | None = None) -> tuple[Items, Items]:
    """The standard-library corpus as 1 KiB byte chunks, grouped by package family.

    Args:
        max_bytes: stop after this many bytes of source (all by default).

    Returns:
        (train, test): every 10th chunk of each family is held out for test.
    """
    per_family: dict[str, list[bytes]] = {}
    total = 0
    for family, path in stdlib_sources():
        with open(path, "rb") as f:
            data = f.read()
        per_family.setdefault(family, []).append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    names = tuple(sorted(per_family))
    chunks: list[np.ndarray] = []
    groups: list[int] = []
    is_test: list[bool] = []
    for g, family in enumerate(names):
        blob = np.frombuffer(b"\n".join(per_family[family]), dtype=np.uint8)
        n = len(blob) // CHUNK_BYTES
        for i in range(n):
            chunks.append(blob[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES])
            groups.append(g)
            is_test.append(i % TEST_EVERY == TEST_EVERY - 1)
    inputs = torch.from_numpy(np.stack(chunks).copy())
    full = Items(inputs, None, np.asarray(groups, dtype=np.int64), names)
    mask = np.asarray(is_test)
    return full.subset(np.flatnonzero(~mask)), full.subset(np.flatnonzero(mask))
