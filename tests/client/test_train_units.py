"""A client trains a transformers model (dict inputs, its own loss, tied head) on its
own data, per unit: ``full`` under a plan equals plain training, ``part`` trains its
window and head only, and the reply carries the keys the server expects."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from client.train import draw_batches, train_assigned  # noqa: E402
from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from server.assign import Assigner  # noqa: E402
from wire.windows import trained_keys  # noqa: E402
from workloads import get_workload  # noqa: E402

SPEC = "examples.transformers_gpt2:build"


@functools.cache
def _setup():
    wl = get_workload(SPEC)
    model = wl.make_model(0)
    assigner = Assigner(
        wl, model, local_steps=2, runtime_reserve_bytes=0, train_time_s=1e9
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches, n, seed = draw_batches(
        wl,
        1,
        3,
        split="iid",
        alpha=0.5,
        seed=0,
        server_round=1,
        local_steps=2,
    )
    return wl, model, assigner, state, batches, n, seed


def _train(plan, window, measure="inline"):
    wl, _, _, state, batches, n, seed = _setup()
    return train_assigned(
        state,
        wl,
        batches,
        num_examples=n,
        torch_seed=seed,
        plan=plan,
        window=window,
        lr=1e-3,
        measure=measure,
    )


def test_units_and_own_data():
    wl, _, assigner, _, batches, n, _ = _setup()
    assert assigner.per_unit and assigner.names[0] == "transformer.wte"
    assert assigner.names[-1] == "lm_head" and len(assigner.names) == 8
    assert set(batches[0][0]) == {"input_ids", "labels"} and batches[0][1] is None
    assert n > 0 and wl.metric_name == "perplexity"


def test_full_under_a_plan_equals_plain_bit_for_bit():
    _, _, assigner, _, _, _, _ = _setup()
    plain = _train(None, None)
    plan = MemoryPlan(
        tuple(BlockPlan(name, "recompute") for name in assigner.names),
    )
    planned = _train(plan, None)
    assert set(plain.state) == set(trained_keys(_setup()[1], None, assigner.blocks))
    assert set(planned.state) == set(plain.state)
    for k in plain.state:
        assert torch.equal(plain.state[k], planned.state[k]), k
    assert plain.mean_loss == planned.mean_loss


def test_part_trains_its_window_and_head_only():
    _, model, assigner, state, _, _, _ = _setup()
    window = (3, 5)  # transformer.h.1 and h.2, plus the head
    plans, _ = None, None
    part = assigner._part_profiles(*window)
    from memory.unit_profile import plan_units

    plans, _ = plan_units(part, None, disk_budget_bytes=2**30)  # the smallest plan
    result = _train(plans, window)
    expected = set(trained_keys(model, window, assigner.blocks))
    assert set(result.state) == expected
    assert {k.split(".")[2] for k in expected if k.startswith("transformer.h.")} == {
        "1",
        "2",
    }
    assert "lm_head.weight" not in expected  # tied: trains with its owner, wte
    for k, v in result.state.items():
        if k.endswith("weight") and v.dtype.is_floating_point:
            assert not torch.equal(v, state[k]), f"{k} did not train"


@pytest.mark.child
def test_the_child_reply_keeps_tied_keys_and_equals_inline():
    inline = _train(None, (0, 2))
    child = _train(None, (0, 2), measure="child")
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(child.state)
    assert set(child.state) == set(inline.state)
    for k in inline.state:
        assert torch.equal(inline.state[k], child.state[k]), k
    assert child.method == "child" and child.peak_bytes > 0
