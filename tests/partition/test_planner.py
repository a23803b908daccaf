"""The stage planner: against exhaustive search, plain-data plans, one device,
unequal devices, replicas, and the error for a cluster too small."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from memory.profile import BlockCosts, BlockProfile, Profile
from partition import planner as pl
from partition.cluster import Cluster
from partition.evaluate import Setting, evaluate_cuts, stage_limits
from partition.planner import plan_partition
from partition.plans import PartitionError, PartitionPlan, PlannerConfig
from partition.schedule import validate
from partition.stage_cost import StageCosts, max_in_flight

MiB = 2**20


def synth(
    n: int = 6,
    batch: int = 8,
    seed: int = 0,
    act: int = 20 * MiB,
    state: int = 10 * MiB,
    io: int = 2 * MiB,
) -> Profile:
    """``n`` blocks with random times; costs scale with the micro-batch size."""
    rng = random.Random(seed)
    blocks = []
    for k in range(n):
        t = rng.uniform(0.01, 0.05)
        a = int(act * rng.uniform(0.5, 1.5))
        costs = {}
        for q in (d for d in range(1, batch + 1) if batch % d == 0):
            costs[q] = BlockCosts(
                input_bytes=io // q,
                output_bytes=io // q if k < n - 1 else 4,
                saved_bytes=a // q,
                saves_input=True,
                saves_output=False,
                forward_peak_bytes=(a + io) // q,
                forward_no_grad_peak_bytes=io // q,
                backward_peak_bytes=io // q,
                forward_flops=int(1e9 * t / q),
                backward_flops=int(2e9 * t / q),
                forward_s=t / q,
                backward_s=2 * t / q,
                time_source="flops",
            )
        blocks.append(
            BlockProfile(
                name=f"layers.{k}",
                num_params=state // 16,
                param_bytes=state // 4,
                grad_bytes=state // 4,
                optimizer_state_bytes=state // 2,
                buffer_bytes=0,
                max_param_tensor_bytes=state // 8,
                shared_param_bytes=0,
                shared_with=(),
                costs=costs,
            )
        )
    return Profile(
        blocks=tuple(blocks),
        batch_size=batch,
        batch_dependent=False,
        batch_bytes=1024,
        construction_peak_bytes=n * state // 4,
        flops_per_s=1e10,
    )


def unequal(
    fast_mem: str = "90MB", slow_mem: str = "400MB", n_fast: int = 2, n_slow: int = 1
) -> Cluster:
    hosts = [
        {"name": f"fast{i}", "memory": fast_mem, "compute": 2e10} for i in range(n_fast)
    ] + [
        {"name": f"slow{i}", "memory": slow_mem, "compute": 5e9} for i in range(n_slow)
    ]
    return Cluster.from_dict({"network": {"bandwidth": "200MB/s"}, "hosts": hosts})


def exhaustive(profile: Profile, cluster: Cluster, cfg: PlannerConfig) -> float:
    """The best simulated step over every setting and every set of boundaries."""
    best = float("inf")
    n = len(profile.blocks)
    for st in pl._settings(profile, cluster, cfg):
        if st.ranks == 1 and st.replicas == 1:
            continue
        costs = StageCosts(
            profile,
            cluster,
            st.replicas * st.microbatches,
            cfg.action_overhead_s,
            cfg.update_s_per_byte,
        )
        limits = stage_limits(cluster, st)
        flights = max_in_flight(st.schedule, st.ranks, st.microbatches, st.per_rank)
        P = st.num_stages
        for inner in itertools.combinations(range(1, n), P - 1):
            ev = evaluate_cuts(costs, st, (0, *inner, n), limits, flights, cfg)
            if ev is not None:
                best = min(best, ev.result.step_s)
    return best


@pytest.mark.parametrize("update", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_planner_is_within_2_percent_of_exhaustive_search(seed, update, monkeypatch):
    profile = synth(n=7, seed=seed)
    cluster = unequal()
    cfg = PlannerConfig(max_microbatches=8, disk_budget_bytes=0)
    if update:  # optimizer updates as long as half the model's fwd+bwd at q=1
        work = sum(b.costs[1].forward_s + b.costs[1].backward_s for b in profile.blocks)
        nbytes = sum(b.param_bytes for b in profile.blocks)
        cfg = PlannerConfig(
            max_microbatches=8, disk_budget_bytes=0, update_s_per_byte=work / 2 / nbytes
        )
        without = plan_partition(profile, cluster, PlannerConfig(max_microbatches=8))
        assert plan_partition(profile, cluster, cfg).predicted_step_s > (
            without.predicted_step_s
        )
    # the planner's own search (dynamic programme and boundary moves), never brute force
    monkeypatch.setattr(pl, "EXHAUSTIVE_LIMIT", 0)
    plan = plan_partition(profile, cluster, cfg)
    brute = exhaustive(profile, cluster, cfg)
    assert plan.num_stages > 1  # the model does not fit one device here
    assert plan.predicted_step_s <= brute * 1.02
    assert plan.predicted_step_s >= brute * (1 - 1e-9)


def test_plan_is_plain_data_and_checkable():
    plan = plan_partition(synth(n=8), unequal(n_slow=2))
    validate(plan.schedule)
    names = [b for stage in plan.stage_modules() for b in stage]
    assert names == [f"layers.{k}" for k in range(8)]  # contiguous, complete
    assert all(s.peak_bytes <= s.memory_bytes for s in plan.stages)
    text = json.dumps(plan.to_dict())
    back = PartitionPlan.from_dict(json.loads(text))
    assert back.stage_modules() == plan.stage_modules()
    assert [[str(a) for a in r] for r in back.schedule.ranks] == [
        [str(a) for a in r] for r in plan.schedule.ranks
    ]
    validate(back.schedule)
    table = plan.table()
    assert "predicted step" in table and plan.schedule_name in table


def test_fast_small_devices_get_work_the_slow_ones_cannot():
    profile = synth(n=8, seed=3)
    plan = plan_partition(profile, unequal(n_fast=2, n_slow=2))
    even = _even_split_step(profile, unequal(n_fast=2, n_slow=2), plan)
    assert plan.predicted_step_s < even


def _even_split_step(profile: Profile, cluster: Cluster, plan: PartitionPlan) -> float:
    """torch's even split (equal block counts, device order as given, same schedule)."""
    n, p = len(profile.blocks), 4
    st = Setting(
        (0, 2, 1, 3),
        1,
        p,
        1,
        "1F1B",
        plan.num_microbatches if plan.num_microbatches >= p else p,
    )
    costs = StageCosts(profile, cluster, st.microbatches)
    cuts = tuple(round(i * n / p) for i in range(p + 1))
    big = [2**62] * p
    ev = evaluate_cuts(
        costs,
        st,
        cuts,
        big,
        max_in_flight("1F1B", p, st.microbatches, 1),
        PlannerConfig(),
    )
    assert ev is not None
    return ev.result.step_s


def test_one_device_is_the_one_stage_plan_from_memory_plan():
    cluster = Cluster.from_dict(
        {"hosts": [{"name": "pi", "memory": "1GB", "compute": 1e10}]}
    )
    plan = plan_partition(synth(n=4), cluster)
    assert plan.schedule_name == "local" and plan.num_stages == 1
    assert len(plan.schedule.ranks) == 1 and not plan.schedule.is_pipeline
    validate(plan.schedule)
    assert [str(a) for a in plan.schedule.ranks[0]][-1] == "STEP"


def test_replicas_when_devices_outnumber_useful_stages():
    cluster = Cluster.uniform(
        4, memory="2GB", compute=1e10, bandwidth="100GB/s", latency=0
    )
    plan = plan_partition(
        synth(n=2, state=1 * MiB, act=1 * MiB),
        cluster,
        PlannerConfig(disk_budget_bytes=0),
    )
    assert plan.num_replicas > 1
    assert plan.num_replicas * plan.num_ranks <= 4


def test_an_infeasible_cluster_states_the_smallest_memory_that_fits():
    profile = synth(n=6, seed=1)
    cfg = PlannerConfig(max_microbatches=8)
    small = Cluster.uniform(3, memory="20MB", compute=1e10)
    with pytest.raises(PartitionError) as e:
        plan_partition(profile, small, cfg)
    need = e.value.min_memory_bytes
    assert need is not None and need > 20 * 10**6
    assert "smallest memory that would fit" in str(e.value)
    # exactly that much fits; a little less does not
    plan_partition(profile, Cluster.uniform(3, memory=need, compute=1e10), cfg)
    with pytest.raises(PartitionError):
        plan_partition(
            profile, Cluster.uniform(3, memory=int(need * 0.98), compute=1e10), cfg
        )


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule 'PipeDream'"):
        plan_partition(synth(), unequal(), PlannerConfig(schedules=("PipeDream",)))


def test_cli_plan_prints_the_table_and_json(tmp_path, capsys):
    import json as _json

    from fleetfit.cli import main

    cluster = tmp_path / "two.toml"
    cluster.write_text(
        '[network]\nbandwidth = "100MB/s"\n'
        '[[hosts]]\nname = "a"\nmemory = "40MB"\ncompute = "probe"\n'
        '[[hosts]]\nname = "b"\nmemory = "40MB"\ncompute = "probe"\n'
    )
    rc = main(
        [
            "partition",
            "plan",
            "--workload",
            "digits-mlp",
            "--cluster",
            str(cluster),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "predicted step" in out
    d = _json.loads(out.strip().splitlines()[-1])
    assert d["plan"]["batch_size"] >= 1 and d["plan"]["stages"]


def test_cli_plan_for_a_gpu_model(capsys):
    from fleetfit.cli import main

    path = (
        Path(__file__).resolve().parents[2] / "partition" / "clusters" / "h100-64.toml"
    )
    assert (
        main(["partition", "plan", "--model", "llama2-7b", "--cluster", str(path)]) == 0
    )
    assert "MFU" in capsys.readouterr().out


def test_cli_names_a_bad_cluster(tmp_path, capsys):
    from fleetfit.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text('[[hosts]]\nname = "a"\nmemory = "lots"\ncompute = 1e9\n')
    assert (
        main(["partition", "plan", "--workload", "digits-mlp", "--cluster", str(bad)])
        == 2
    )
    assert "hosts[0].memory" in capsys.readouterr().err
