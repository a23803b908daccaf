"""Assignments from the memory model: full, part (a moving window), none; time."""

import pytest

from server.assign import Assigner, part_profile
from wire.facts import NodeFacts
from wire.windows import trained_keys
from workloads import get_workload

MiB = 2**20


@pytest.fixture(scope="module")
def assigner():
    wl = get_workload("digits-cnn")
    return Assigner(
        wl,
        wl.make_model(0),
        local_steps=10,
        runtime_reserve_bytes=0,
        train_time_s=1000.0,
    )


def facts(budget, disk=0, flops=None):
    f = {"budget-bytes": budget, "disk-budget-bytes": disk}
    if flops is not None:
        f["flops-per-s"] = flops
    return NodeFacts.from_record(f)


def test_full_part_none_follow_the_budget(assigner):
    full = assigner.assign(facts(64 * MiB), 1)
    assert full.kind == "full" and full.plan is not None and full.window is None
    assert full.predicted_peak_bytes <= 64 * MiB
    whole_min = assigner._min_budget(0, 3, 0)
    head_min = assigner._min_budget(3, 3, 0)
    assert head_min < whole_min
    part = assigner.assign(facts((head_min + whole_min) // 2), 1)
    assert part.kind == "part" and part.window is not None
    assert part.predicted_peak_bytes <= (head_min + whole_min) // 2
    assert len(part.plan.blocks) == 4 - part.window[0]  # the chain [start, head]
    none = assigner.assign(facts(head_min // 2), 1)
    assert none.kind == "none" and none.local_steps == 0
    assert none.min_budget_bytes == head_min and str(head_min) in none.reason


def test_a_plain_client_gets_the_whole_model(assigner):
    a = assigner.assign(NodeFacts(), 1)
    assert a.kind == "full" and a.plan is None and a.budget_bytes is None


def test_the_window_moves_over_rounds():
    wl = get_workload("gpt-tiny")  # embed, layers.0, layers.1, head
    a = Assigner(
        wl, wl.make_model(0), local_steps=3, runtime_reserve_bytes=0, train_time_s=1e3
    )
    one = max(a._min_budget(s, s + 1, 0) for s in range(3))
    two = min(a._min_budget(s, s + 2, 0) for s in range(2))
    assert one < two  # uniform layers: any one-block window is cheaper than two
    windows = [a.assign(facts(one), r).window for r in range(1, 5)]
    assert windows == [(0, 1), (1, 2), (2, 3), (0, 1)]


def test_slow_nodes_get_fewer_steps_not_dropped(assigner):
    fast = assigner.assign(facts(64 * MiB, flops=assigner.profile.flops_per_s), 1)
    slow_rate = assigner.profile.flops_per_s * fast.plan.predicted_step_s / 1000.0 / 3
    slow = assigner.assign(facts(64 * MiB, flops=slow_rate), 1)
    assert fast.local_steps == 10
    assert slow.kind == "full" and 1 <= slow.local_steps < 10
    crawl = assigner.assign(facts(64 * MiB, flops=slow_rate / 1e6), 1)
    assert crawl.local_steps == 1


def test_part_profile_freezes_and_holds_the_prefix(assigner):
    prof = assigner.profile
    p = part_profile(prof, 1, 2)
    assert [b.name for b in p.blocks] == ["1", "2", "3"]
    assert p.blocks[0].grad_bytes > 0 and p.blocks[1].grad_bytes == 0
    assert p.blocks[1].optimizer_state_bytes == 0 and p.blocks[2].grad_bytes > 0
    assert p.batch_bytes > prof.batch_bytes + prof.blocks[0].param_bytes - 1


def test_trained_keys_follow_tied_owners():
    wl = get_workload("gpt-tiny")
    model = wl.make_model(0)
    model.head.proj.weight = model.embed.tok.weight  # tie, as GPT-2 does
    n = len(list(model.children()))
    assert n >= 3
    keys = trained_keys(model, (1, 2))
    assert "head.proj.weight" not in keys and "embed.tok.weight" not in keys
    assert any(k.startswith("layers.0.") for k in keys)
    assert any(k.startswith("head.") for k in keys)
    keys0 = trained_keys(model, (0, 1))
    assert "head.proj.weight" in keys0 and "embed.tok.weight" in keys0
