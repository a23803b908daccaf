"""fleetfit: train models on devices that do not have the memory to train them.

The public face: re-exports of the toolkit's main entry points, and the ``fleetfit``
command (``fleetfit.cli``).
"""

from memory import BudgetError, format_bytes, parse_bytes
from simulations.run import SimulationSettings, simulate
from workloads import BUILTIN_WORKLOADS, Workload, WorkloadError, get_workload

__version__ = "0.1.0"

__all__ = [
    "BUILTIN_WORKLOADS",
    "BudgetError",
    "SimulationSettings",
    "Workload",
    "WorkloadError",
    "format_bytes",
    "get_workload",
    "parse_bytes",
    "simulate",
]
