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
import logging
import math
from dataclasses import replace

from memory.errors import BudgetError
from memory.profile import Profile
from memory.sizes import format_bytes
from partition.cluster import Cluster
from partition.evaluate import (
    Evaluation,
    Setting,
    as_plan,
    evaluate_cuts,
    link_s,
    local_plan,
    stage_limits,
)
from partition.pipeline import SCHEDULES, check_schedule_args
from partition.plans import PartitionError, PartitionPlan, PlannerConfig
from partition.stage_cost import StageChoice, StageCosts, choose_stage, max_in_flight

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- search
def _boundaries_dp(
    costs: StageCosts,
    st: Setting,
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
    memo: dict[tuple[int, int, int], tuple[float, StageChoice | None]] = {}

    def cost(j: int, a: int, b: int) -> tuple[float, StageChoice | None]:
        key = (j, a, b)
        if key not in memo:
            devs = st.devices_of(j)
            ch = choose_stage(
                costs, a, b, devs, flights[j], limits[j], cfg.recompute, st.per_rank
            )
            if ch is None:
                memo[key] = (math.inf, None)
            else:
                t = ch.fwd_s + ch.bwd_s
                if j + 1 < P:
                    nxt = st.devices_of(j + 1)
                    t += 2 * max(
                        link_s(cluster, d0, d1, costs.c[b - 1].output_bytes)
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


def _search_cuts(
    costs: StageCosts,
    st: Setting,
    limits: list[int],
    flights: tuple[int, ...],
    cfg: PlannerConfig,
) -> tuple[tuple[int, ...], Evaluation] | None:
    """The best boundaries for one setting, by simulation: every boundary set when
    there are few, else the dynamic programme's candidates improved by moving one
    boundary at a time while the simulated step gets shorter."""
    n, P = costs.n, st.num_stages
    if P > n:
        return None
    cache: dict[tuple[int, ...], Evaluation | None] = {}

    def ev(cuts: tuple[int, ...]) -> Evaluation | None:
        if cuts not in cache:
            cache[cuts] = evaluate_cuts(costs, st, cuts, limits, flights, cfg)
        return cache[cuts]

    if math.comb(n - 1, P - 1) <= EXHAUSTIVE_LIMIT:
        starts = [(0, *c, n) for c in itertools.combinations(range(1, n), P - 1)]
    else:
        starts = _boundaries_dp(costs, st, limits, flights, cfg)[: cfg.candidates]
    best: tuple[tuple[int, ...], Evaluation] | None = None
    for cuts in starts:
        e = ev(cuts)
        if e is not None and (best is None or e.result.step_s < best[1].result.step_s):
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
                if e is not None and e.result.step_s < best[1].result.step_s - 1e-12:
                    best = (tuple(c), e)
                    improved = True
        if not improved:
            break
    return best


EXHAUSTIVE_LIMIT = 64
"""Settings with at most this many boundary sets are searched exhaustively."""


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


def _settings(profile: Profile, cluster: Cluster, cfg: PlannerConfig) -> list[Setting]:
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
                            out.append(Setting(order[: d * p], d, p, v, sched, m))
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
    cost_cache: dict[int, StageCosts] = {}
    for st in _settings(profile, cluster, cfg):
        if st.ranks == 1 and st.replicas == 1:
            continue  # the one-device case is memory.plan's
        q = st.replicas * st.microbatches
        if q not in cost_cache:
            cost_cache[q] = StageCosts(
                profile, cluster, q, cfg.action_overhead_s, cfg.update_s_per_byte
            )
        costs = cost_cache[q]
        if best is not None and _lower_bound(costs, st) >= best[0]:
            continue
        limits = stage_limits(cluster, st)
        flights = max_in_flight(st.schedule, st.ranks, st.microbatches, st.per_rank)
        found = _search_cuts(costs, st, limits, flights, cfg)
        if found is None:
            continue
        cuts, (res, choices, allreduce) = found
        if best is None or res.step_s < best[0] - 1e-12:
            best = (
                res.step_s,
                as_plan(profile, cluster, st, cuts, res, choices, allreduce),
            )
    if best is None:
        raise _infeasible(profile, cluster, cfg)
    return best[1]


def _lower_bound(costs: StageCosts, st: Setting) -> float:
    """No plan of this setting is faster: the work spread perfectly over its devices."""
    devs = set(st.order)
    per_dev = min(
        sum(costs.fwd(k, d) + costs.bwd(k, d) for k in range(costs.n)) for d in devs
    )
    return st.microbatches * per_dev / st.ranks


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
        out.append(local_plan(profile, cluster, dev, mp))
    return out


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
        costs = StageCosts(profile, uniform, st.microbatches)
        flights = max_in_flight(st.schedule, st.ranks, st.microbatches, st.per_rank)
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
    costs: StageCosts, st: Setting, flights: tuple[int, ...], recompute: bool
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
