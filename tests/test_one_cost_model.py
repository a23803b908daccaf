"""One memory model (issue 12): the device planner (``memory.plan``), the stage planner
(``partition.planner``, pricing stages in ``partition.stage_cost``) and the GPU layouts (``partition.gpu``) price the same units
with ``memory.cost``'s events and agree on their peaks.

The units are a transformers GPT-2 built from its config (tied embedding and head),
a synthetic chain, and the GPU model's analytic units of a small Llama-shaped spec.
"""

from __future__ import annotations

import functools

import pytest

from memory.cost import (
    AS_PLAN,
    KEEP,
    RECOMPUTE,
    CostModel,
    activation_bytes,
    events,
    predict,
    price_stage,
    slack,
)
from memory.profile import Profile
from memory.spec import BlockPlan, MemoryPlan
from partition import gpu
from partition import planner as pl
from partition.cluster import Cluster
from partition.evaluate import fixed_plan
from partition.plans import PartitionPlan, PlannerConfig, StagePlan
from partition.stage_cost import StageCosts, max_in_flight
from tests.partition.test_planner import synth, unequal


@functools.cache
def _gpt2_units() -> Profile:
    pytest.importorskip("transformers")
    from memory.unit_profile import profile_units
    from tests.hf.models import build

    model, (inputs, targets) = build("gpt2")
    return profile_units(model, inputs, targets, max_microbatches=2)


def _profile(name: str) -> Profile:
    return _gpt2_units() if name == "gpt2" else synth(n=7, seed=1)


def _plan(profile: Profile, choices: list[str], m: int = 1) -> MemoryPlan:
    return MemoryPlan(
        tuple(
            BlockPlan(b.name, *AS_PLAN[ch])
            for b, ch in zip(profile.blocks, choices, strict=True)
        ),
        num_microbatches=m,
    )


def _mixed(profile: Profile) -> list[str]:
    """Keep and recompute alternating, where a unit allows both."""
    out = []
    for k, b in enumerate(profile.blocks):
        allowed = b.options or (KEEP, RECOMPUTE)
        want = RECOMPUTE if k % 2 else KEEP
        out.append(want if want in allowed else allowed[0])
    return out


@pytest.mark.parametrize("name", ["synthetic", "gpt2"])
@pytest.mark.parametrize("m", [1, 2])
def test_a_device_step_is_its_whole_chain_priced_as_one_stage(name, m):
    profile = _profile(name)
    n = len(profile.blocks)
    for choices in ([KEEP] * n, [RECOMPUTE] * n, _mixed(profile)):
        choices = [
            c if c in (profile.blocks[k].options or (c,)) else RECOMPUTE
            for k, c in enumerate(choices)
        ]
        device = predict(profile, _plan(profile, choices, m))
        model = CostModel(profile, m, 1)
        stage = price_stage(model, (0, n), choices, in_flight=1, base_bytes=model.base)
        # the device's step adds only the model's construction before it
        assert device.peak_bytes == max(
            stage.peak_bytes, slack(profile.construction_peak_bytes)
        )


@pytest.mark.parametrize("name", ["synthetic", "gpt2"])
def test_micro_batches_in_flight_add_their_activations_to_every_event(name):
    profile = _profile(name)
    n = len(profile.blocks)
    model = CostModel(profile, 2, 1)
    choices = _mixed(profile)
    device = events(model, choices)
    assert device[-1][0] == "model construction"
    act = activation_bytes(model, choices, (0, n))
    assert act > 0
    for in_flight, base in ((1, model.base), (3, 12345)):
        stage = events(
            model, choices, span=(0, n), in_flight=in_flight, base_bytes=base
        )
        assert len(stage) == len(device) - 1
        for (what_d, bytes_d, _), (what_s, bytes_s, _) in zip(device, stage):
            assert what_d == what_s
            # every forward and backward holds the other micro-batches' activations;
            # none are alive in the optimizer's update
            held = 0 if what_d == "optimizer step" else (in_flight - 1) * act
            assert bytes_s == bytes_d - model.base + base + held, what_d


def _stage_choices(stage: StagePlan) -> list[str]:
    return [
        RECOMPUTE if b.activations == "recompute" else KEEP for b in stage.memory.blocks
    ]


def _check_stages(profile: Profile, cluster: Cluster, plan: PartitionPlan) -> None:
    """Each stage's peak in the plan is ``memory.cost``'s price of its span."""
    assert plan.stages_per_rank == 1 and plan.num_stages > 1
    q = plan.num_replicas * plan.num_microbatches
    model = CostModel(profile, q, 1)
    costs = StageCosts(profile, cluster, q)
    flights = max_in_flight(
        plan.schedule_name, plan.num_ranks, plan.num_microbatches, 1
    )
    a = 0
    for j, stage in enumerate(plan.stages):
        b = a + len(stage.blocks)
        price = price_stage(
            model,
            (a, b),
            _stage_choices(stage),
            in_flight=flights[j],
            base_bytes=costs.base(a, b, flights[j]),
        )
        assert stage.peak_bytes == price.peak_bytes, (j, stage.blocks)
        assert stage.peak_bytes <= stage.memory_bytes
        a = b
    assert a == len(profile.blocks)


def test_the_stage_planner_prices_stages_with_the_device_model():
    profile = synth(n=7, seed=1)
    cluster = unequal(fast_mem="50MB")  # tight: some stages recompute
    plan = pl.plan_partition(
        profile, cluster, PlannerConfig(schedules=("GPipe", "1F1B"))
    )
    _check_stages(profile, cluster, plan)
    assert any(
        b.activations == "recompute" for s in plan.stages for b in s.memory.blocks
    )


def test_a_transformers_pipeline_is_priced_by_the_same_units():
    profile = _gpt2_units()
    cluster = Cluster.from_dict(
        {
            "hosts": [
                {"name": f"h{i}", "memory": "4GB", "compute": 1e10} for i in range(2)
            ]
        }
    )
    names = [b.name for b in profile.blocks]
    half = len(names) // 2
    plan = fixed_plan(
        profile,
        cluster,
        [names[:half], names[half:]],
        schedule="1F1B",
        num_microbatches=2,
    )
    _check_stages(profile, cluster, plan)


SMALL = gpu.TransformerSpec("tiny-llama", 4, 512, 1376, 8, 4, 1000, 256)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sharding", ["zero1", "fsdp", "ddp"])
def test_gpu_layouts_price_their_units_like_a_device(recompute, sharding):
    kw = dict(dp=4, tp=2, microbatch_size=2, recompute=recompute, sharding=sharding)
    units = gpu.analytic_profile(SMALL, **kw)
    choices = [b.options[0] for b in units.blocks]
    device = predict(units, _plan(units, choices, 1))
    layout = gpu.memory_bytes(SMALL, pp=1, num_microbatches=1, **kw)
    assert device.peak_bytes == slack(layout)
    # a pipeline's first rank is its span of the same units with pp micro-batches
    model = CostModel(units, 4, 1, slices=1)
    first = price_stage(model, (0, 3), choices[:3], in_flight=2, base_bytes=0).raw_bytes
    assert gpu.memory_bytes(SMALL, pp=2, num_microbatches=4, **kw) >= first
