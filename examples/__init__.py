"""Example workloads: user code as fleetfit takes it (``module:function``)."""
