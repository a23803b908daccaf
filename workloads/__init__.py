"""Built-in models and data, and loading of user workloads (``module:function``).

Knows nothing of the rest of fleetfit: torch, numpy and scikit-learn only.

Example:
    >>> from workloads import get_workload
    >>> wl = get_workload("digits-cnn")
    >>> model = wl.make_model(seed=0)
    >>> inputs, targets = wl.example_batch(seed=0)
    >>> loss = wl.loss_fn(model(inputs), targets)
"""

from workloads.errors import WorkloadError
from workloads.registry import BUILTIN_WORKLOADS, Workload, get_workload

__all__ = ["BUILTIN_WORKLOADS", "Workload", "WorkloadError", "get_workload"]
