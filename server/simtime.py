"""Time as a simulated device sees it: one round's compute plus its messages.

A simulated device's round time is::

    device_s = local_steps x step_s + down_bytes / downlink + up_bytes / uplink

where ``step_s`` is the memory model's predicted step time of the device's plan,
already scaled to the device (``server.assign``: the plan's time on this machine times
this machine's measured rate over the device's, which is the measured rate times the
fleet's ``speed``), ``down_bytes`` the model the server sent and ``up_bytes`` the
update it got back (a ``part`` device sends only its window). A synchronous round
lasts as long as its slowest accepted device; with a deadline (``round-deadline``,
simulated seconds), a device over it is late: the server does not wait for it, its
update is dropped, and the round lasts the deadline.

Assumptions: the server sends to every device at once and each device's link is its
own (no shared bottleneck at the server); the server's aggregation and evaluation
take no simulated time; nodes that only evaluate (``none``) and nodes that failed do
not hold the round up. A device whose link is unknown (no ``fleet-uplinks`` /
``fleet-downlinks``) has no communication time.

Example:
    >>> t = device_time(steps=10, step_s=0.5, down_bytes=8e6, up_bytes=8e6,
    ...                 downlink_bytes_per_s=4e6, uplink_bytes_per_s=1e6)
    >>> t.compute_s, t.comm_s, t.total_s
    (5.0, 10.0, 15.0)
    >>> round_time([t.total_s, 30.0], deadline_s=20.0)
    (20.0, [False, True])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceTime:
    """One device's simulated round, seconds."""

    compute_s: float  # local_steps x the plan's step time on this device
    down_s: float  # the model, server -> device
    up_s: float  # the update, device -> server

    @property
    def comm_s(self) -> float:
        return self.down_s + self.up_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def device_time(
    *,
    steps: int,
    step_s: float,
    down_bytes: float,
    up_bytes: float,
    downlink_bytes_per_s: float | None,
    uplink_bytes_per_s: float | None,
) -> DeviceTime:
    """A device's simulated round (a link of ``None``: not modelled, 0 s).

    Raises:
        ValueError: a negative count or time, or a link that is not > 0.
    """
    if steps < 0 or not step_s >= 0 or down_bytes < 0 or up_bytes < 0:
        raise ValueError(
            f"steps={steps}, step_s={step_s}, down_bytes={down_bytes}, "
            f"up_bytes={up_bytes}: all must be >= 0"
        )
    for name, link in (
        ("downlink", downlink_bytes_per_s),
        ("uplink", uplink_bytes_per_s),
    ):
        if link is not None and not (link > 0 and math.isfinite(link)):
            raise ValueError(f"{name}={link!r} bytes/s must be a finite number > 0")
    down = down_bytes / downlink_bytes_per_s if downlink_bytes_per_s else 0.0
    up = up_bytes / uplink_bytes_per_s if uplink_bytes_per_s else 0.0
    return DeviceTime(steps * step_s, down, up)


def round_time(
    device_s: Sequence[float], deadline_s: float = 0.0
) -> tuple[float, list[bool]]:
    """A synchronous round's simulated length and which devices were late.

    ``device_s``: the round time of each device that trained and replied.
    ``deadline_s``: 0 for none. The round lasts as long as its slowest device that
    made the deadline; when one was late the server waited until the deadline, so
    the round lasts the deadline. No device: 0 s.
    """
    if deadline_s < 0 or not math.isfinite(deadline_s):
        raise ValueError(f"deadline_s={deadline_s!r} must be >= 0 (0: none)")
    late = [bool(deadline_s) and t > deadline_s for t in device_s]
    if any(late):
        return float(deadline_s), late
    return float(max(device_s, default=0.0)), late


__all__ = ["DeviceTime", "device_time", "round_time"]
