"""The one exception type of ``workloads``."""


class WorkloadError(ValueError):
    """A workload name, loader or data setting is invalid; the message says the fix."""
