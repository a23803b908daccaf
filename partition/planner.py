"""The stage planner: cut a profiled model across a cluster's devices.

A ``PartitionPlan`` says which devices run which contiguous blocks (stages as lists of
module names), how many micro-batches, which schedule (GPipe, 1F1B, Interleaved1F1B,
InterleavedZeroBubble), each stage's memory plan (``memory.spec.MemoryPlan``: keep or
recompute per block), how many data-parallel replicas, and the per-rank action lists
(``partition.schedule.Schedule``). It is plain data: printable (``table()``), JSON
(``to_dict``) and checkable without processes (``partition.schedule.validate``).

One device is the one-stage case of the same plan: its memory plan comes from
``memory.plan.plan_memory`` (recompute, offload, streaming from disk) and its schedule is
``compile_plan`` of it.

The search: for every device order (distinct permutations of unequal devices), number
of replicas d, pipeline ranks p, stages per rank v, schedule and micro-batch count m, a
dynamic programme over contiguous boundaries finds, for each of a ladder of
bottleneck limits T, the boundaries with the least total stage time whose every stage
takes at most T and fits its device's memory (recomputing blocks, the ones that save
the most bytes per second first, until it fits). The best few candidates are run in the
event simulator (``partition.simulate``) and the fastest simulated plan wins. Tests
compare it with exhaustive search over all boundaries.

Example:
    >>> plan = plan_partition(profile, load_cluster("partition/clusters/unequal-4.toml"))  # doctest: +SKIP
    >>> print(plan.table())  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from memory.cost import KEEP, RECOMPUTE, CostModel, StagePrice, price_stage, slack
from memory.errors import BudgetError
from memory.profile import BlockCosts, Profile
from memory.sizes import format_bytes
from memory.spec import BlockPlan, MemoryPlan
from partition.cluster import Cluster, Device
from partition.pipeline import SCHEDULES, build_schedule, check_schedule_args
from partition.schedule import Action, Schedule, compile_plan
from partition.simulate import SimResult, StageCost, simulate

logger = logging.getLogger(__name__)

COMM_BUFFERS = 2
"""Receive buffers a stage keeps: its input from the previous stage and the gradient
of its output from the next (bytes of one micro-batch each)."""


class PartitionError(ValueError):
    """No plan fits the cluster.

    Attributes:
        min_memory_bytes: the smallest per-device memory with which the model would
            fit on this many devices (every device given that much).
    """

    def __init__(self, message: str, *, min_memory_bytes: int | None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner may choose.

    Attributes:
        schedules: schedules to consider (names from ``partition.pipeline.SCHEDULES``).
        max_microbatches: the most micro-batches per replica step.
        max_stages_per_rank: the most stages per rank for interleaved schedules.
        replicas: allow data-parallel replicas of the pipeline.
        recompute: allow recomputing blocks' activations to fit memory.
        disk_budget_bytes: disk a one-device plan may use (offload, streaming); 0
            forbids it. Pipelined stages keep state resident.
        max_orders: device orders to try (distinct permutations, then heuristics).
        candidates: boundary sets per setting checked in the simulator.
        action_overhead_s: seconds of runtime work per stage action (forward or
            backward of one micro-batch) at the profile's rate, beyond the blocks'
            own time: the pipelining runtime's bookkeeping, posting sends and
            receives; scaled by each device's speed like the blocks.
        update_s_per_byte: seconds of optimizer update per byte of trainable
            parameters at the profile's rate (0: not modelled); scaled by each
            device's speed. Each rank steps its own stages after its last action.
    """

    schedules: tuple[str, ...] = SCHEDULES
    max_microbatches: int = 16
    max_stages_per_rank: int = 2
    replicas: bool = True
    recompute: bool = True
    disk_budget_bytes: int = 0
    max_orders: int = 24
    candidates: int = 3
    action_overhead_s: float = 0.0
    update_s_per_byte: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    """One stage of the plan.

    Attributes:
        stage_index: position in the pipeline.
        rank: the pipeline rank that runs it (stage_index % ranks).
        devices: the devices running it, one per replica.
        blocks: the module names it owns, in order.
        memory: its memory plan (one ``BlockPlan`` per block).
        peak_bytes: predicted peak on its device (its rank's other stages included
            for interleaved schedules).
        memory_bytes: the smallest memory among its devices.
        forward_s: seconds per micro-batch forward on its slowest device.
        backward_s: seconds per micro-batch backward (recompute included).
    """

    stage_index: int
    rank: int
    devices: tuple[str, ...]
    blocks: tuple[str, ...]
    memory: MemoryPlan
    peak_bytes: int
    memory_bytes: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class PartitionPlan:
    """A training step cut across devices, as data.

    Attributes:
        schedule_name: ``GPipe``, ``1F1B``, ``Interleaved1F1B``,
            ``InterleavedZeroBubble``, or ``local`` for the one-device plan.
        num_microbatches: micro-batches per replica step.
        num_ranks: pipeline ranks per replica.
        stages_per_rank: stages on each rank.
        num_replicas: data-parallel replicas (gradients averaged after the step).
        batch_size: examples per step, all replicas together.
        stages: the stages.
        schedule: per-rank actions of one replica.
        predicted_step_s: predicted seconds per step.
        predicted_bubble: idle share of device time in the pipeline.
        allreduce_s: of the step, seconds of data-parallel gradient reduction.
        cluster: the cluster's name.
        notes: what else the planner found worth saying.
    """

    schedule_name: str
    num_microbatches: int
    num_ranks: int
    stages_per_rank: int
    num_replicas: int
    batch_size: int
    stages: tuple[StagePlan, ...]
    schedule: Schedule = field(repr=False)
    predicted_step_s: float
    predicted_bubble: float
    allreduce_s: float = 0.0
    cluster: str = ""
    notes: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def throughput(self) -> float:
        """Examples per second."""
        return self.batch_size / self.predicted_step_s

    def stage_modules(self) -> list[list[str]]:
        """Each stage's module names (torchtitan's form)."""
        return [list(s.blocks) for s in self.stages]

    def table(self) -> str:
        """The plan for people: one row per stage, then the schedule's summary."""
        head = (
            f"{'stage':>5} {'rank':>4}  {'devices':<18}{'blocks':<24}"
            f"{'recompute':>9}{'peak':>12}{'memory':>12}{'fwd ms':>9}{'bwd ms':>9}"
        )
        rows = [head]
        for s in self.stages:
            names = (
                f"{s.blocks[0]}..{s.blocks[-1]}" if len(s.blocks) > 1 else s.blocks[0]
            )
            rec = sum(b.activations != "keep" for b in s.memory.blocks)
            rows.append(
                f"{s.stage_index:>5} {s.rank:>4}  {','.join(s.devices):<18}"
                f"{names:<24}{rec:>9}{format_bytes(s.peak_bytes):>12}"
                f"{format_bytes(s.memory_bytes):>12}{s.forward_s * 1e3:>9.1f}"
                f"{s.backward_s * 1e3:>9.1f}"
            )
        rows.append(
            f"schedule {self.schedule_name}, {self.num_stages} stage(s) on "
            f"{self.num_ranks} rank(s) x {self.num_replicas} replica(s), "
            f"{self.num_microbatches} micro-batch(es) of "
            f"{self.batch_size // (self.num_replicas * self.num_microbatches)}"
        )
        rows.append(
            f"predicted step {self.predicted_step_s:.4f} s "
            f"({self.throughput:.2f} examples/s), bubble {self.predicted_bubble:.1%}"
            + (f", all-reduce {self.allreduce_s:.4f} s" if self.allreduce_s else "")
        )
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["schedule"] = {
            "ranks": [[str(a) for a in acts] for acts in self.schedule.ranks],
            "stage_ranks": list(self.schedule.stage_ranks),
        }
        d["stages"] = [dict(asdict(s), memory=s.memory.to_dict()) for s in self.stages]
        d["num_stages"] = self.num_stages
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> PartitionPlan:
        d = dict(d)
        d.pop("num_stages", None)
        stages = tuple(
            StagePlan(
                **{
                    **s,
                    "devices": tuple(s["devices"]),
                    "blocks": tuple(s["blocks"]),
                    "memory": MemoryPlan.from_dict(s["memory"]),
                }
            )
            for s in d["stages"]
        )
        sd = d["schedule"]
        ranks = [[Action.parse(t) for t in acts] for acts in sd["ranks"]]
        names = tuple(b for s in stages for b in s.blocks)
        if d["schedule_name"] == "local":
            sched = compile_plan(stages[0].memory)
        else:
            idx = _stage_block_indices(stages)
            sched = Schedule(
                ranks=ranks,
                num_blocks=len(names),
                num_microbatches=d["num_microbatches"],
                names=names,
                num_stages=len(stages),
                stage_ranks=tuple(sd["stage_ranks"]),
                stage_blocks=idx,
                schedule_name=d["schedule_name"],
            )
        d["stages"] = stages
        d["schedule"] = sched
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


def _stage_block_indices(stages: tuple[StagePlan, ...]) -> tuple[tuple[int, ...], ...]:
    out, i = [], 0
    for s in stages:
        out.append(tuple(range(i, i + len(s.blocks))))
        i += len(s.blocks)
    return tuple(out)


# --------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class _Setting:
    """One point of the outer search."""

    order: tuple[int, ...]  # device indices; replica g rank r = order[g * p + r]
    replicas: int
    ranks: int
    per_rank: int
    schedule: str
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.ranks * self.per_rank

    def devices_of(self, stage: int) -> list[int]:
        r = stage % self.ranks
        return [self.order[g * self.ranks + r] for g in range(self.replicas)]


class _Costs:
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
class _StageChoice:
    recompute: tuple[bool, ...]
    fwd_s: float
    bwd_s: float
    act_bytes: int
    static_bytes: int
    peak_bytes: int  # slack included: what the device's memory must hold


def _stage(
    costs: _Costs,
    a: int,
    b: int,
    devs: list[int],
    in_flight: int,
    limit: int,
    recompute_ok: bool,
    per_rank: int = 1,
) -> _StageChoice | None:
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
    return _StageChoice(
        rec, f, bw, price.activation_bytes, price.static_bytes, price.peak_bytes
    )


@lru_cache(maxsize=256)
def _in_flight(schedule: str, ranks: int, m: int, v: int) -> tuple[int, ...]:
    """The most micro-batches each stage holds, from a unit-time simulation."""
    s = build_schedule(schedule, ranks, m, v)
    r = simulate(s, [StageCost(1.0, 2.0, activation_bytes=1)] * (ranks * v))
    return tuple(r.max_in_flight)


# --------------------------------------------------------------------------- search
def _link_s(cluster: Cluster, a: int, b: int, nbytes: int) -> float:
    if a == b:
        return 0.0
    return cluster.link(a, b).transfer_s(nbytes)


def _boundaries_dp(
    costs: _Costs,
    st: _Setting,
    limits: list[int],
    flights: tuple[int, ...],
    cfg: PlannerConfig,
) -> list[tuple[int, ...]]:
    """Candidate boundary tuples (P+1 cut points) for one setting."""
    n, P = costs.n, st.num_stages
    if P > n:
        return []
    cluster = costs.cluster
    # stage time for (stage j, blocks a..b-1), with the link to the next stage
    memo: dict[tuple[int, int, int], tuple[float, _StageChoice | None]] = {}

    def cost(j: int, a: int, b: int) -> tuple[float, _StageChoice | None]:
        key = (j, a, b)
        if key not in memo:
            devs = st.devices_of(j)
            ch = _stage(
                costs, a, b, devs, flights[j], limits[j], cfg.recompute, st.per_rank
            )
            if ch is None:
                memo[key] = (math.inf, None)
            else:
                t = ch.fwd_s + ch.bwd_s
                if j + 1 < P:
                    nxt = st.devices_of(j + 1)
                    t += 2 * max(
                        _link_s(cluster, d0, d1, costs.c[b - 1].output_bytes)
                        for d0, d1 in zip(devs, nxt)
                    )
                memo[key] = (t, ch)
        return memo[key]

    def solve(cap: float) -> tuple[float, tuple[int, ...]] | None:
        # best[j][b]: least total time for stages 0..j-1 covering blocks 0..b-1
        inf = (math.inf, ())
        best: list[list[tuple[float, tuple[int, ...]]]] = [
            [inf] * (n + 1) for _ in range(P + 1)
        ]
        best[0][0] = (0.0, (0,))
        for j in range(P):
            for a in range(j, n - (P - j) + 1):
                tot, cuts = best[j][a]
                if tot == math.inf:
                    continue
                for b in range(a + 1, n - (P - j - 1) + 1):
                    t, _ = cost(j, a, b)
                    if t > cap:
                        continue
                    cand = tot + t
                    if cand < best[j + 1][b][0]:
                        best[j + 1][b] = (cand, (*cuts, b))
        tot, cuts = best[P][n]
        return None if tot == math.inf else (tot, cuts)

    # the least achievable bottleneck, then a ladder of caps above it
    times = sorted(
        {
            cost(j, a, b)[0]
            for j in range(P)
            for a in range(j, n - (P - j) + 1)
            for b in range(a + 1, n - (P - j - 1) + 1)
        }
        - {math.inf}
    )
    if not times:
        return []
    lo, hi = 0, len(times) - 1
    while lo < hi:  # smallest cap with a feasible cut
        mid = (lo + hi) // 2
        if solve(times[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    if solve(times[lo]) is None:
        return []
    ladder = times[lo:]
    if len(ladder) > 12:
        step = (len(ladder) - 1) / 11
        ladder = [ladder[round(i * step)] for i in range(12)]
    found: dict[tuple[int, ...], float] = {}
    m = st.microbatches
    for cap in ladder:
        r = solve(cap)
        if r is None:
            continue
        tot, cuts = r
        worst = max(cost(j, cuts[j], cuts[j + 1])[0] for j in range(P))
        est = tot + (m * st.per_rank - 1) * worst / st.per_rank
        found.setdefault(cuts, est)
    return [c for c, _ in sorted(found.items(), key=lambda kv: kv[1])]


def _evaluate(
    costs: _Costs,
    st: _Setting,
    cuts: tuple[int, ...],
    limits: list[int],
    flights: tuple[int, ...],
    cfg: PlannerConfig,
) -> tuple[SimResult, list[_StageChoice], float] | None:
    """Simulate one boundary choice; (result, stage choices, all-reduce seconds)."""
    P = st.num_stages
    choices = []
    for j in range(P):
        ch = _stage(
            costs,
            cuts[j],
            cuts[j + 1],
            st.devices_of(j),
            flights[j],
            limits[j],
            cfg.recompute,
            st.per_rank,
        )
        if ch is None:
            return None
        choices.append(ch)
    sched = build_schedule(st.schedule, st.ranks, st.microbatches, st.per_rank)
    stage_costs = [
        StageCost(
            ch.fwd_s,
            ch.bwd_s,
            activation_bytes=ch.act_bytes,
            static_bytes=ch.static_bytes,
            output_bytes=costs.c[cuts[j + 1] - 1].output_bytes if j + 1 < P else 0,
            update_s=costs.update(cuts[j], cuts[j + 1], st.devices_of(j)),
        )
        for j, ch in enumerate(choices)
    ]
    cluster = costs.cluster

    def transfer(ra: int, rb: int, nbytes: int) -> float:
        # the slowest replica's link between these ranks
        return max(
            _link_s(
                cluster,
                st.order[g * st.ranks + ra],
                st.order[g * st.ranks + rb],
                nbytes,
            )
            for g in range(st.replicas)
        )

    allreduce = _allreduce_s(costs, st, cuts)
    res = simulate(sched, stage_costs, transfer, allreduce_s=allreduce)
    return res, choices, allreduce


_Eval = tuple[SimResult, list[_StageChoice], float]


def _search_cuts(
    costs: _Costs,
    st: _Setting,
    limits: list[int],
    flights: tuple[int, ...],
    cfg: PlannerConfig,
) -> tuple[tuple[int, ...], _Eval] | None:
    """The best boundaries for one setting, by simulation: every boundary set when
    there are few, else the dynamic programme's candidates improved by moving one
    boundary at a time while the simulated step gets shorter."""
    n, P = costs.n, st.num_stages
    if P > n:
        return None
    cache: dict[tuple[int, ...], _Eval | None] = {}

    def ev(cuts: tuple[int, ...]) -> _Eval | None:
        if cuts not in cache:
            cache[cuts] = _evaluate(costs, st, cuts, limits, flights, cfg)
        return cache[cuts]

    if math.comb(n - 1, P - 1) <= EXHAUSTIVE_LIMIT:
        starts = [(0, *c, n) for c in itertools.combinations(range(1, n), P - 1)]
    else:
        starts = _boundaries_dp(costs, st, limits, flights, cfg)[: cfg.candidates]
    best: tuple[tuple[int, ...], _Eval] | None = None
    for cuts in starts:
        e = ev(cuts)
        if e is not None and (best is None or e[0].step_s < best[1][0].step_s):
            best = (cuts, e)
    if best is None or math.comb(n - 1, P - 1) <= EXHAUSTIVE_LIMIT:
        return best
    for _ in range(4 * n):  # hill-climb on single boundary moves
        cuts0, e0 = best
        improved = False
        for i in range(1, P):
            for delta in (-1, 1):
                c = list(cuts0)
                c[i] += delta
                if not c[i - 1] < c[i] < c[i + 1]:
                    continue
                e = ev(tuple(c))
                if e is not None and e[0].step_s < best[1][0].step_s - 1e-12:
                    best = (tuple(c), e)
                    improved = True
        if not improved:
            break
    return best


EXHAUSTIVE_LIMIT = 64
"""Settings with at most this many boundary sets are searched exhaustively."""


def _allreduce_s(costs: _Costs, st: _Setting, cuts: tuple[int, ...]) -> float:
    """Ring all-reduce of each rank's gradients across replicas, the slowest rank."""
    d = st.replicas
    if d == 1:
        return 0.0
    per_rank = [0.0] * st.ranks
    for j in range(st.num_stages):
        grads = sum(
            costs.profile.blocks[k].grad_bytes for k in range(cuts[j], cuts[j + 1])
        )
        devs = st.devices_of(j)
        link = min(
            (costs.cluster.link(devs[g], devs[(g + 1) % d]) for g in range(d)),
            key=lambda lk: lk.bandwidth_bytes_per_s,
        )
        per_rank[j % st.ranks] += (
            2 * (d - 1) * (grads / d / link.bandwidth_bytes_per_s + link.latency_s)
        )
    return max(per_rank)


def _orders(cluster: Cluster, limit: int) -> list[tuple[int, ...]]:
    """Device orders to try: distinct permutations of unequal devices, else a few."""
    devs = cluster.devices
    kinds = [(d.host, d.memory_bytes, d.flops_per_s) for d in devs]
    sig = [(d.memory_bytes, d.flops_per_s) for d in devs]
    n = len(devs)
    if len(set(sig)) == 1:
        return [tuple(range(n))]
    if math.factorial(n) <= 5040:
        seen: set[tuple] = set()
        out = []
        for perm in itertools.permutations(range(n)):
            key = tuple(sig[i] for i in perm)
            if key in seen:
                continue
            seen.add(key)
            out.append(perm)
            if len(out) >= limit:
                break
        if len(out) < limit:
            return out
    base = list(range(n))
    cands = [
        tuple(base),
        tuple(sorted(base, key=lambda i: -devs[i].flops_per_s)),
        tuple(sorted(base, key=lambda i: -devs[i].memory_bytes)),
        tuple(sorted(base, key=lambda i: (kinds[i][0], -devs[i].flops_per_s))),
    ]
    return list(dict.fromkeys(cands))


def _settings(profile: Profile, cluster: Cluster, cfg: PlannerConfig) -> list[_Setting]:
    N, n = cluster.num_devices, len(profile.blocks)
    B = profile.batch_size
    opts = set(profile.microbatch_options)
    out = []
    for order in _orders(cluster, cfg.max_orders):
        for d in range(1, N + 1) if cfg.replicas else [1]:
            if B % d:
                continue
            for p in range(1, N // d + 1):
                for sched in cfg.schedules:
                    vs = (
                        range(2, cfg.max_stages_per_rank + 1)
                        if sched.startswith("Interleaved")
                        else [1]
                    )
                    if sched == "InterleavedZeroBubble":
                        vs = range(1, cfg.max_stages_per_rank + 1)
                    if p == 1 and sched != "GPipe":
                        continue
                    for v in vs:
                        if p * v > n:
                            continue
                        for m in range(1, cfg.max_microbatches + 1):
                            if (B // d) % m or d * m not in opts:
                                continue
                            try:
                                check_schedule_args(sched, p, m, v)
                            except ValueError:
                                continue
                            out.append(_Setting(order[: d * p], d, p, v, sched, m))
    return list(dict.fromkeys(out))


def plan_partition(
    profile: Profile,
    cluster: Cluster,
    config: PlannerConfig | None = None,
) -> PartitionPlan:
    """The plan with the least predicted step time that fits every device's memory.

    Args:
        profile: the workload's per-block costs (``memory.profile``), at the batch size
            of one step (all replicas together). Its times were measured at
            ``profile.flops_per_s``; a device at another rate scales them.
        cluster: the devices and links.
        config: what the planner may choose.

    Raises:
        PartitionError: no plan fits; it states the smallest per-device memory that
            would.
    """
    cfg = config or PlannerConfig()
    for name in cfg.schedules:
        if name not in SCHEDULES:
            raise ValueError(
                f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}"
            )
    best: tuple[float, PartitionPlan] | None = None
    for plan in _local_plans(profile, cluster, cfg):
        if best is None or plan.predicted_step_s < best[0]:
            best = (plan.predicted_step_s, plan)
    cost_cache: dict[int, _Costs] = {}
    for st in _settings(profile, cluster, cfg):
        if st.ranks == 1 and st.replicas == 1:
            continue  # the one-device case is memory.plan's
        q = st.replicas * st.microbatches
        if q not in cost_cache:
            cost_cache[q] = _Costs(
                profile, cluster, q, cfg.action_overhead_s, cfg.update_s_per_byte
            )
        costs = cost_cache[q]
        if best is not None and _lower_bound(costs, st) >= best[0]:
            continue
        limits = _limits(cluster, st)
        flights = _in_flight(st.schedule, st.ranks, st.microbatches, st.per_rank)
        found = _search_cuts(costs, st, limits, flights, cfg)
        if found is None:
            continue
        cuts, (res, choices, allreduce) = found
        if best is None or res.step_s < best[0] - 1e-12:
            best = (
                res.step_s,
                _as_plan(profile, cluster, st, cuts, res, choices, allreduce),
            )
    if best is None:
        raise _infeasible(profile, cluster, cfg)
    return best[1]


def _limits(cluster: Cluster, st: _Setting) -> list[int]:
    # interleaved: a rank's stages share its memory equally
    return [
        min(cluster.devices[d].memory_bytes for d in st.devices_of(j)) // st.per_rank
        for j in range(st.num_stages)
    ]


def _lower_bound(costs: _Costs, st: _Setting) -> float:
    """No plan of this setting is faster: the work spread perfectly over its devices."""
    devs = set(st.order)
    per_dev = min(
        sum(costs.fwd(k, d) + costs.bwd(k, d) for k in range(costs.n)) for d in devs
    )
    return st.microbatches * per_dev / st.ranks


def _as_plan(
    profile: Profile,
    cluster: Cluster,
    st: _Setting,
    cuts: tuple[int, ...],
    res: SimResult,
    choices: list[_StageChoice],
    allreduce: float,
) -> PartitionPlan:
    names = [b.name for b in profile.blocks]
    stages = []
    for j, ch in enumerate(choices):
        blocks = tuple(names[cuts[j] : cuts[j + 1]])
        mem = MemoryPlan(
            tuple(
                BlockPlan(nm, "recompute" if r else "keep")
                for nm, r in zip(blocks, ch.recompute)
            ),
            predicted_peak_bytes=slack(res.rank_peak_bytes[j % st.ranks]),
            predicted_step_s=(ch.fwd_s + ch.bwd_s) * st.microbatches,
        )
        devs = st.devices_of(j)
        stages.append(
            StagePlan(
                stage_index=j,
                rank=j % st.ranks,
                devices=tuple(cluster.devices[d].name for d in devs),
                blocks=blocks,
                memory=mem,
                peak_bytes=slack(res.rank_peak_bytes[j % st.ranks]),
                memory_bytes=min(cluster.devices[d].memory_bytes for d in devs),
                forward_s=ch.fwd_s,
                backward_s=ch.bwd_s,
            )
        )
    idx = tuple(tuple(range(cuts[j], cuts[j + 1])) for j in range(len(choices)))
    sched = build_schedule(
        st.schedule,
        st.ranks,
        st.microbatches,
        st.per_rank,
        stage_blocks=idx,
        names=tuple(names),
    )
    notes = []
    if st.schedule == "InterleavedZeroBubble":
        notes.append("backward split assumed half input gradient, half weight gradient")
    return PartitionPlan(
        schedule_name=st.schedule,
        num_microbatches=st.microbatches,
        num_ranks=st.ranks,
        stages_per_rank=st.per_rank,
        num_replicas=st.replicas,
        batch_size=profile.batch_size,
        stages=tuple(stages),
        schedule=sched,
        predicted_step_s=res.step_s,
        predicted_bubble=res.bubble_share,
        allreduce_s=allreduce,
        cluster=cluster.name,
        notes=tuple(notes),
    )


def _local_plans(
    profile: Profile, cluster: Cluster, cfg: PlannerConfig
) -> list[PartitionPlan]:
    """One-device plans from ``memory.plan`` (one per distinct device kind)."""
    from memory.plan import plan_memory

    out = []
    seen: set[tuple[int, float]] = set()
    for dev in cluster.devices:
        key = (dev.memory_bytes, dev.flops_per_s)
        if key in seen:
            continue
        seen.add(key)
        try:
            mp = plan_memory(
                profile,
                dev.memory_bytes,
                disk_budget_bytes=cfg.disk_budget_bytes,
                batch_size=profile.batch_size,
                max_microbatches=cfg.max_microbatches,
            )
        except BudgetError:
            continue
        out.append(_local_plan(profile, cluster, dev, mp))
    return out


def _local_plan(
    profile: Profile, cluster: Cluster, dev: Device, mp: MemoryPlan
) -> PartitionPlan:
    scale = profile.flops_per_s / dev.flops_per_s if profile.flops_per_s else 1.0
    step = mp.predicted_step_s * scale
    stage = StagePlan(
        stage_index=0,
        rank=0,
        devices=(dev.name,),
        blocks=tuple(b.name for b in mp.blocks),
        memory=mp,
        peak_bytes=mp.predicted_peak_bytes,
        memory_bytes=dev.memory_bytes,
        forward_s=sum(b.forward_s for b in profile.blocks)
        * scale
        / mp.num_microbatches,
        backward_s=step / mp.num_microbatches
        - sum(b.forward_s for b in profile.blocks) * scale / mp.num_microbatches,
    )
    return PartitionPlan(
        schedule_name="local",
        num_microbatches=mp.num_microbatches,
        num_ranks=1,
        stages_per_rank=1,
        num_replicas=1,
        batch_size=profile.batch_size,
        stages=(stage,),
        schedule=compile_plan(mp),
        predicted_step_s=step,
        predicted_bubble=0.0,
        cluster=cluster.name,
        notes=("one device: memory.plan's plan, run by partition.local",),
    )


def _infeasible(
    profile: Profile, cluster: Cluster, cfg: PlannerConfig
) -> PartitionError:
    """The error for a cluster too small: the least per-device memory that fits."""
    N = cluster.num_devices
    uniform = replace(
        cluster,
        devices=tuple(replace(d, memory_bytes=2**62) for d in cluster.devices),
    )
    need: int | None = None
    # with unbounded memory, the smallest peak over the plans the search can make
    for st in _settings(profile, uniform, replace(cfg, replicas=False)):
        if st.replicas != 1:
            continue
        costs = _Costs(profile, uniform, st.microbatches)
        flights = _in_flight(st.schedule, st.ranks, st.microbatches, st.per_rank)
        peak = _min_peak(costs, st, flights, cfg.recompute)
        if peak is not None and (need is None or peak < need):
            need = peak
    try:
        from memory.plan import min_budget_bytes

        local = min_budget_bytes(
            profile,
            disk_budget_bytes=cfg.disk_budget_bytes,
            max_microbatches=cfg.max_microbatches,
        )
        need = local if need is None else min(need, local)
    except BudgetError:
        pass
    total = sum(d.memory_bytes for d in cluster.devices)
    small = min(d.memory_bytes for d in cluster.devices)
    msg = (
        f"no plan fits the {N} device(s) of cluster {cluster.name!r} (smallest "
        f"{format_bytes(small)}, {format_bytes(total)} in all): "
    )
    if need is not None:
        msg += (
            f"the smallest memory that would fit is {format_bytes(need)} ({need} bytes) "
            f"per device on {N} device(s); add devices or memory, or shrink the batch"
        )
    return PartitionError(msg, min_memory_bytes=need)


def _min_peak(
    costs: _Costs, st: _Setting, flights: tuple[int, ...], recompute: bool
) -> int | None:
    """The least achievable bottleneck peak over contiguous cuts (min-max DP)."""
    n, P = costs.n, st.num_stages
    if P > n:
        return None
    memo: dict[tuple[int, int, int], int] = {}

    def peak(j: int, a: int, b: int) -> int:
        key = (j, a, b)
        if key not in memo:
            # the fewest bytes: nothing recomputed, or every block recompute shrinks
            peak = costs.price(
                a, b, costs.choices(a, b, ()), flights[j], st.per_rank
            ).peak_bytes
            if recompute:
                rec = costs.choices(a, b, costs.gains(a, b, st.devices_of(j)[0]))
                peak = min(
                    peak, costs.price(a, b, rec, flights[j], st.per_rank).peak_bytes
                )
            memo[key] = peak * st.per_rank
        return memo[key]

    inf = 2**63
    best = [[inf] * (n + 1) for _ in range(P + 1)]
    best[0][0] = 0
    for j in range(P):
        for a in range(n + 1):
            if best[j][a] == inf:
                continue
            for b in range(a + 1, n + 1):
                v = max(best[j][a], peak(j, a, b))
                if v < best[j + 1][b]:
                    best[j + 1][b] = v
    return None if best[P][n] == inf else int(best[P][n])


def fixed_plan(
    profile: Profile,
    cluster: Cluster,
    stages: list[list[str]],
    *,
    schedule: str = "1F1B",
    num_microbatches: int = 1,
    stages_per_rank: int = 1,
    num_replicas: int = 1,
    device_order: list[int] | None = None,
    recompute: bool = False,
    config: PlannerConfig | None = None,
) -> PartitionPlan:
    """A plan with the stages given (module names per stage), evaluated like the
    planner's own: for a fixed split such as torch's even one, or for tests.

    Stage j runs on rank j % ranks; replica g's rank r is
    ``device_order[g * ranks + r]`` (default: the cluster's order). Memory limits are
    not enforced (``recompute=True`` recomputes blocks to fit them).
    """
    names = [b.name for b in profile.blocks]
    flat = [n for s in stages for n in s]
    if flat != names:
        raise ValueError(
            "stages must list every block once, in order: got "
            f"{flat[:3]}... for blocks {names[:3]}..."
        )
    P = len(stages)
    if P % stages_per_rank:
        raise ValueError(f"{P} stages do not divide into {stages_per_rank} per rank")
    ranks = P // stages_per_rank
    order = tuple(device_order or range(cluster.num_devices))[: ranks * num_replicas]
    if len(order) < ranks * num_replicas:
        raise ValueError(
            f"{ranks} ranks x {num_replicas} replicas need {ranks * num_replicas} "
            f"devices; the cluster has {cluster.num_devices}"
        )
    check_schedule_args(schedule, ranks, num_microbatches, stages_per_rank)
    st = _Setting(
        order, num_replicas, ranks, stages_per_rank, schedule, num_microbatches
    )
    cuts = [0]
    for s in stages:
        cuts.append(cuts[-1] + len(s))
    cfg = replace(config or PlannerConfig(), recompute=recompute)
    costs = _Costs(
        profile,
        cluster,
        num_replicas * num_microbatches,
        cfg.action_overhead_s,
        cfg.update_s_per_byte,
    )
    limits = _limits(cluster, st) if recompute else [2**62] * P
    flights = _in_flight(schedule, ranks, num_microbatches, stages_per_rank)
    ev = _evaluate(costs, st, tuple(cuts), limits, flights, cfg)
    if ev is None:
        raise PartitionError(
            "the given stages do not fit their devices even with recompute",
            min_memory_bytes=None,
        )
    res, choices, allreduce = ev
    return _as_plan(profile, cluster, st, tuple(cuts), res, choices, allreduce)


def even_split(names: list[str], num_stages: int) -> list[list[str]]:
    """Equal block counts per stage (the first stages take one more when uneven):
    how torch's ``pipeline(split_spec=...)`` examples cut a model of equal layers."""
    n = len(names)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {num_stages} stages")
    size, extra = divmod(n, num_stages)
    out, i = [], 0
    for j in range(num_stages):
        k = size + (j < extra)
        out.append(names[i : i + k])
        i += k
    return out


def simulate_plan(
    plan: PartitionPlan,
    profile: Profile,
    cluster: Cluster,
    config: PlannerConfig | None = None,
) -> SimResult:
    """Run ``plan``'s schedule in the simulator again (for its timeline)."""
    if plan.schedule_name == "local":
        raise ValueError("a one-device plan has no pipeline to simulate")
    index = {d.name: i for i, d in enumerate(cluster.devices)}
    p, d = plan.num_ranks, plan.num_replicas
    try:
        order = tuple(
            index[plan.stages[r].devices[g]] for g in range(d) for r in range(p)
        )
    except KeyError as e:
        raise ValueError(f"the plan names device {e} that the cluster lacks") from None
    st = _Setting(
        order, d, p, plan.stages_per_rank, plan.schedule_name, plan.num_microbatches
    )
    cuts = [0]
    for s in plan.stages:
        cuts.append(cuts[-1] + len(s.blocks))
    cfg = config or PlannerConfig()
    costs = _Costs(
        profile,
        cluster,
        d * plan.num_microbatches,
        cfg.action_overhead_s,
        cfg.update_s_per_byte,
    )
    flights = _in_flight(st.schedule, p, st.microbatches, st.per_rank)
    ev = _evaluate(costs, st, tuple(cuts), _limits(cluster, st), flights, cfg)
    if ev is None:
        raise ValueError("the plan no longer fits this cluster")
    return ev[0]
