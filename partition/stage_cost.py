"""What one pipeline stage costs: its memory from the one cost model
(``memory.cost.price_stage``: the events a device's plan is priced by, over the
stage's span of units with its micro-batches in flight), its time per micro-batch on
each device, and the recompute choice that fits a device's memory (``choose_stage``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from memory.cost import KEEP, RECOMPUTE, CostModel, StagePrice, price_stage
from memory.profile import BlockCosts, Profile
from partition.cluster import Cluster
from partition.pipeline import build_schedule
from partition.simulate import StageCost, simulate

COMM_BUFFERS = 2
"""Receive buffers a stage keeps: its input from the previous stage and the gradient
of its output from the next (bytes of one micro-batch each)."""


class StageCosts:
    """The one cost model (``memory.cost``) at one slice size, and per-device time
    scales: a stage's memory is the same events as a device's step, over its span
    of units with its micro-batches in flight."""

    def __init__(
        self,
        profile: Profile,
        cluster: Cluster,
        slices: int,
        overhead_s: float = 0.0,
        update_s_per_byte: float = 0.0,
    ) -> None:
        self.overhead_s = overhead_s
        self.update_s_per_byte = update_s_per_byte
        self.profile = profile
        self.cluster = cluster
        # gradients accumulate over a replica's micro-batches: with slices > 1 the
        # model counts every gradient resident (exact for m > 1, an upper bound for
        # replicas of one micro-batch)
        self.model = CostModel(profile, slices, 1)
        self.c: list[BlockCosts] = self.model.costs
        self.n = len(self.c)
        rate = profile.flops_per_s
        self.scale = [
            (rate / d.flops_per_s) if rate > 0 else 0.0 for d in cluster.devices
        ]
        self.rate = [d.flops_per_s for d in cluster.devices]
        # per micro-batch: what keeping a unit's activations holds, and what
        # recomputing it holds instead (its input); the greedy's ranking
        self.keep_bytes = [
            c.saved_bytes
            + c.saves_input * c.input_bytes
            + c.saves_output * c.output_bytes
            for c in self.c
        ]
        self.rec_bytes = [c.input_bytes for c in self.c]
        self.batch_bytes = profile.batch_bytes // slices
        self.options = [
            tuple(o for o in (KEEP, RECOMPUTE) if o in self.model.options(k))
            or (RECOMPUTE,)
            for k in range(self.n)
        ]

    def base(self, a: int, b: int, in_flight: int, per_rank: int = 1) -> int:
        """Bytes of stage ``a..b-1`` outside its units' events: its share of the
        rank's runtime (torch's first-step cost, counted once per process, as a
        device's plan counts it), its buffers, its receive buffers and the
        micro-batches of the batch it holds (the first stage the inputs of those in
        flight, the last their targets)."""
        comm = COMM_BUFFERS * max(self.c[a].input_bytes, self.c[b - 1].output_bytes)
        batch = 0
        if a == 0 or b == self.n:
            batch = self.batch_bytes * (in_flight if a == 0 else 1)
        buffers = sum(self.profile.blocks[k].buffer_bytes for k in range(a, b))
        runtime = -(-self.profile.runtime_bytes // per_rank)
        return runtime + buffers + comm + batch

    def price(
        self, a: int, b: int, choices: Sequence[str], in_flight: int, per_rank: int = 1
    ) -> StagePrice:
        """``memory.cost``'s price of stage ``a..b-1`` (one of ``per_rank`` stages
        on its rank)."""
        return price_stage(
            self.model,
            (a, b),
            choices,
            in_flight=in_flight,
            base_bytes=self.base(a, b, in_flight, per_rank),
        )

    def overhead(self, dev: int) -> float:
        """Runtime seconds per stage action on ``dev``."""
        if not self.overhead_s:
            return 0.0
        return self.overhead_s * (self.scale[dev] or 1.0)

    def update(self, a: int, b: int, devs: list[int]) -> float:
        """Optimizer update seconds of blocks ``a:b`` on the slowest of ``devs``."""
        if not self.update_s_per_byte:
            return 0.0
        nbytes = sum(self.profile.blocks[k].param_bytes for k in range(a, b))
        return max(
            self.update_s_per_byte * nbytes * (self.scale[d] or 1.0) for d in devs
        )

    def fwd(self, k: int, dev: int) -> float:
        c = self.c[k]
        if self.scale[dev]:
            return c.forward_s * self.scale[dev]
        return c.forward_flops / self.rate[dev]

    def bwd(self, k: int, dev: int) -> float:
        c = self.c[k]
        if self.scale[dev]:
            return c.backward_s * self.scale[dev]
        return c.backward_flops / self.rate[dev]

    def gains(self, a: int, b: int, dev: int) -> list[int]:
        """Units of ``a..b-1`` that recomputing makes smaller, the ones that save
        the most bytes per second of rerun on ``dev`` first."""
        ks = [
            k
            for k in range(a, b)
            if self.keep_bytes[k] > self.rec_bytes[k] and len(self.options[k]) > 1
        ]
        return sorted(
            ks,
            key=lambda k: (
                -(self.keep_bytes[k] - self.rec_bytes[k]) / max(self.fwd(k, dev), 1e-12)
            ),
        )

    def choices(self, a: int, b: int, recompute: Sequence[int]) -> list[str]:
        """Each unit's first option (keep where it may), ``recompute`` recomputed."""
        out = [self.options[k][0] for k in range(a, b)]
        for k in recompute:
            out[k - a] = RECOMPUTE
        return out


@dataclass(frozen=True)
class StageChoice:
    recompute: tuple[bool, ...]
    fwd_s: float
    bwd_s: float
    act_bytes: int
    static_bytes: int
    peak_bytes: int  # slack included: what the device's memory must hold


def choose_stage(
    costs: StageCosts,
    a: int,
    b: int,
    devs: list[int],
    in_flight: int,
    limit: int,
    recompute_ok: bool,
    per_rank: int = 1,
) -> StageChoice | None:
    """Blocks a..b-1 on ``devs`` (one per replica): the fastest recompute choice that
    fits ``limit`` bytes with ``in_flight`` micro-batches held, or None.

    Recompute goes to the blocks that save the most bytes per second of rerun first,
    as few as fit (the peak falls as more are recomputed: found by bisection)."""
    ks = range(a, b)
    fwd = {d: sum(costs.fwd(k, d) for k in ks) + costs.overhead(d) for d in devs}
    bwd = {d: sum(costs.bwd(k, d) for k in ks) + costs.overhead(d) for d in devs}
    slow = max(devs, key=lambda d: fwd[d] + bwd[d])
    gains = costs.gains(a, b, slow) if recompute_ok else []
    choices = costs.choices(a, b, ())
    price = costs.price(a, b, choices, in_flight, per_rank)
    if price.peak_bytes > limit and gains:
        full = costs.choices(a, b, gains)
        price = costs.price(a, b, full, in_flight, per_rank)
        if price.peak_bytes > limit:
            return None
        lo, hi = 1, len(gains)  # the fewest recomputed blocks that fit
        best = (full, price)
        while lo < hi:
            mid = (lo + hi) // 2
            ch = costs.choices(a, b, gains[:mid])
            pr = costs.price(a, b, ch, in_flight, per_rank)
            if pr.peak_bytes <= limit:
                hi, best = mid, (ch, pr)
            else:
                lo = mid + 1
        choices, price = best
    if price.peak_bytes > limit:
        return None
    rec = tuple(c == RECOMPUTE for c in choices)
    f = max(fwd.values())
    bw = max(bwd[d] + sum(costs.fwd(k, d) for k in ks if rec[k - a]) for d in devs)
    return StageChoice(
        rec, f, bw, price.activation_bytes, price.static_bytes, price.peak_bytes
    )


@lru_cache(maxsize=256)
def max_in_flight(schedule: str, ranks: int, m: int, v: int) -> tuple[int, ...]:
    """The most micro-batches each stage holds, from a unit-time simulation."""
    s = build_schedule(schedule, ranks, m, v)
    r = simulate(s, [StageCost(1.0, 2.0, activation_bytes=1)] * (ranks * v))
    return tuple(r.max_in_flight)
