"""Issue 3's acceptance grid: for several workloads and budgets from plain's peak down
to the smallest the planner accepts, a measured run stays within its budget and trains
exactly like plain training."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from memory.cost import predict
from memory.plan import min_budget_bytes, plan_memory
from memory.profile import loading_from_file
from memory.spec import MemoryPlan
from partition.run import measured_run, profile_workload
from workloads import get_workload

pytestmark = pytest.mark.heavy


def budgets(low: int, high: int, n: int = 4) -> list[int]:
    ratio = (high / low) ** (1 / (n - 1))
    return [int(low * ratio**i) for i in range(n)]


def relative_distance(a: dict, b: dict) -> float:
    num = math.sqrt(
        sum(
            float(((a[k].double() - b[k].double()) ** 2).sum())
            for k in a
            if a[k].is_floating_point()
        )
    )
    den = math.sqrt(
        sum(float((a[k].double() ** 2).sum()) for k in a if a[k].is_floating_point())
    )
    return num / den


@pytest.mark.parametrize(
    "name", ["digits-cnn", "digits-cnn-bn", "digits-mlp", "gpt-tiny"]
)
def test_budget_grid(name, tmp_path):
    wl = get_workload(name)
    profile = profile_workload(wl, offload_dir=str(tmp_path))
    names = [b.name for b in profile.blocks]
    plain_pred = predict(profile, MemoryPlan.plain(names)).peak_bytes
    _, ref = measured_run(name, None, steps=3, save=str(tmp_path / "plain.safetensors"))
    want = load_file(str(tmp_path / "plain.safetensors"))
    fp = loading_from_file(profile)
    low = min_budget_bytes(fp, offload_dir=str(tmp_path))
    for i, budget in enumerate(budgets(low, max(plain_pred, low + 1))):
        plan = plan_memory(
            fp,
            budget,
            batch_size=wl.batch_size,
            offload_dir=str(tmp_path),
            batch_dependent=profile.batch_dependent,
        )
        out = tmp_path / f"plan{i}.safetensors"
        m, got = measured_run(
            name, plan, steps=3, save=str(out), offload_dir=str(tmp_path)
        )
        assert m.peak_bytes <= budget, (budget, m.peak_bytes, plan)
        params = load_file(str(out))
        assert params.keys() == want.keys()
        if plan.num_microbatches == 1 and plan.loss_chunks == 1:
            assert got["losses"] == ref["losses"], plan  # only data moved: bit for bit
            assert all(torch.equal(params[k], want[k]) for k in want), plan
        else:  # the arithmetic order changed
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
            assert relative_distance(params, want) <= 1e-6, plan


def test_gpt_byte_smallest_plan_is_a_quarter_of_plain(tmp_path):
    """A model of 8 blocks: the smallest accepted budget is at most a quarter of
    plain's measured peak, and a run at it fits and trains like plain. (At the default
    8 x 128 tokens the ratio is 0.30, because torch's fixed runtime cost, ~80 MB, is
    over half of the smallest plan; at 8 x 256 the activations make plain larger.)"""
    shape = {"batch_size": 8, "seq_len": 256}
    wl = get_workload("gpt-byte", **shape)
    profile = loading_from_file(profile_workload(wl, offload_dir=str(tmp_path)))
    assert len(profile.blocks) >= 8
    m_plain, ref = measured_run("gpt-byte", None, steps=2, **shape)
    low = min_budget_bytes(profile, offload_dir=str(tmp_path))
    print(
        f"gpt-byte plain {m_plain.peak_bytes / 2**20:.1f} MiB, smallest plan "
        f"{low / 2**20:.1f} MiB"
    )
    plan = plan_memory(
        profile, low, batch_size=wl.batch_size, offload_dir=str(tmp_path)
    )
    m, got = measured_run("gpt-byte", plan, steps=2, offload_dir=str(tmp_path), **shape)
    assert m.peak_bytes <= low
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert low <= m_plain.peak_bytes / 4
