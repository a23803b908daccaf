"""The held-out data of each device class, where the split follows the classes.

With ``split = "natural"`` and ``fleet-classes``, a class's devices own data groups
that other classes lack (``workloads.splits.class_groups``); its own held-out data is
the test items of those groups (a language model's first ``CLASS_EVAL_WINDOWS``). The
server measures the global model on each class's data every round, and a comparison
measures the final model the same way, so the last round's figure and the final one
agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from workloads.data import Items
from workloads.registry import Workload
from workloads.splits import class_groups

CLASS_EVAL_WINDOWS = 64
"""Held-out items per device class for a language model's per-class metric."""


def class_test_items(
    workload: Workload,
    classes: Sequence[int],
    *,
    public_share: float = 0.0,
    eval_windows: int = CLASS_EVAL_WINDOWS,
) -> dict[int, Items]:
    """Each class's own held-out items, by class index (classes without any: left
    out). ``public_share``: the run's, so that groups are dealt as the clients' split
    deals them."""
    train = workload.private_items(public_share)
    owner = class_groups(train.groups, classes)
    test = workload.items(train=False)
    out: dict[int, Items] = {}
    for c in sorted(set(owner.values())):
        mine = [g for g, o in owner.items() if o == c]
        idx = np.flatnonzero(np.isin(test.groups, mine))
        if workload.kind == "lm":
            idx = idx[: min(CLASS_EVAL_WINDOWS, eval_windows)]
        if len(idx):
            out[c] = test.subset(idx)
    return out


def class_metrics(
    workload: Workload, model: nn.Module, items: dict[int, Items]
) -> dict[str, float]:
    """The workload's metric of ``model`` on each class's items, keyed by the class
    index as text (JSON keys)."""
    metric = workload.metric_name
    return {
        str(c): float(workload.evaluate(model, it)[metric]) for c, it in items.items()
    }


__all__ = ["CLASS_EVAL_WINDOWS", "class_metrics", "class_test_items"]
