"""Evaluating a pipeline plan: one setting (device order, replicas, ranks, stages
per rank, schedule, micro-batches) and its stage boundaries, priced stage by stage
(``partition.stage_cost``) and run in the event simulator (``partition.simulate``).

``fixed_plan`` evaluates the stages a user gives (torch's even split, ``even_split``),
``simulate_plan`` re-runs a plan's schedule for its timeline; ``partition.planner``
searches over settings and boundaries with the same evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from memory.cost import slack
from memory.profile import Profile
from memory.spec import BlockPlan, MemoryPlan
from partition.cluster import Cluster, Device
from partition.pipeline import build_schedule, check_schedule_args
from partition.plans import PartitionError, PartitionPlan, PlannerConfig, StagePlan
from partition.schedule import compile_plan
from partition.simulate import CpuQuota, SimResult, StageCost, simulate
from partition.stage_cost import StageChoice, StageCosts, choose_stage, max_in_flight


@dataclass(frozen=True)
class Setting:
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


def link_s(cluster: Cluster, a: int, b: int, nbytes: int) -> float:
    if a == b:
        return 0.0
    return cluster.link(a, b).transfer_s(nbytes)


class Evaluation(NamedTuple):
    """One boundary choice, simulated."""

    result: SimResult
    stages: list[StageChoice]  # per stage, in order
    allreduce_s: float  # the slowest rank's gradient all-reduce across replicas


def evaluate_cuts(
    costs: StageCosts,
    st: Setting,
    cuts: tuple[int, ...],
    limits: list[int],
    flights: tuple[int, ...],
    cfg: PlannerConfig,
) -> Evaluation | None:
    """Simulate one boundary choice; (result, stage choices, all-reduce seconds)."""
    P = st.num_stages
    choices = []
    for j in range(P):
        ch = choose_stage(
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
            link_s(
                cluster,
                st.order[g * st.ranks + ra],
                st.order[g * st.ranks + rb],
                nbytes,
            )
            for g in range(st.replicas)
        )

    allreduce = allreduce_s(costs, st, cuts)
    res = simulate(
        sched,
        stage_costs,
        transfer,
        allreduce_s=allreduce,
        quotas=rank_quotas(cluster, st),
        sends=cfg.sends,
    )
    return Evaluation(res, choices, allreduce)


def rank_quotas(cluster: Cluster, st: Setting) -> list[CpuQuota | None] | None:
    """Per rank, the CPU quota of its slowest replica's device (None: no quota)."""
    out: list[CpuQuota | None] = []
    for r in range(st.ranks):
        devs = [cluster.devices[st.order[g * st.ranks + r]] for g in range(st.replicas)]
        d = min(devs, key=lambda x: x.flops_per_s)
        out.append(
            None if d.cpu_limit is None else CpuQuota(d.cpu_limit, d.cpu_period_s)
        )
    return out if any(q is not None for q in out) else None


def allreduce_s(costs: StageCosts, st: Setting, cuts: tuple[int, ...]) -> float:
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


def stage_limits(cluster: Cluster, st: Setting) -> list[int]:
    # interleaved: a rank's stages share its memory equally
    return [
        min(cluster.devices[d].memory_bytes for d in st.devices_of(j)) // st.per_rank
        for j in range(st.num_stages)
    ]


def as_plan(
    profile: Profile,
    cluster: Cluster,
    st: Setting,
    cuts: tuple[int, ...],
    res: SimResult,
    choices: list[StageChoice],
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


def local_plan(
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
    st = Setting(
        order, num_replicas, ranks, stages_per_rank, schedule, num_microbatches
    )
    cuts = [0]
    for s in stages:
        cuts.append(cuts[-1] + len(s))
    cfg = replace(config or PlannerConfig(), recompute=recompute)
    costs = StageCosts(
        profile,
        cluster,
        num_replicas * num_microbatches,
        cfg.action_overhead_s,
        cfg.update_s_per_byte,
    )
    limits = stage_limits(cluster, st) if recompute else [2**62] * P
    flights = max_in_flight(schedule, ranks, num_microbatches, stages_per_rank)
    ev = evaluate_cuts(costs, st, tuple(cuts), limits, flights, cfg)
    if ev is None:
        raise PartitionError(
            "the given stages do not fit their devices even with recompute",
            min_memory_bytes=None,
        )
    res, choices, allreduce = ev
    return as_plan(profile, cluster, st, tuple(cuts), res, choices, allreduce)


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
    st = Setting(
        order, d, p, plan.stages_per_rank, plan.schedule_name, plan.num_microbatches
    )
    cuts = [0]
    for s in plan.stages:
        cuts.append(cuts[-1] + len(s.blocks))
    cfg = config or PlannerConfig()
    costs = StageCosts(
        profile,
        cluster,
        d * plan.num_microbatches,
        cfg.action_overhead_s,
        cfg.update_s_per_byte,
    )
    flights = max_in_flight(st.schedule, p, st.microbatches, st.per_rank)
    ev = evaluate_cuts(costs, st, tuple(cuts), stage_limits(cluster, st), flights, cfg)
    if ev is None:
        raise ValueError("the plan no longer fits this cluster")
    return ev.result
