"""The memory model's price of an adapter assignment (``server.assign.
adapter_profile``): the frozen base holds parameters only (bfloat16 halves them),
the adapters their parameters, gradients and AdamW state; and a measured child stays
inside the budget the assigner planned for, returning what inline training does."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("peft")

from client.train import draw_batches, train_assigned  # noqa: E402
from memory.lora import LoraSpec  # noqa: E402
from memory.plan import min_budget_bytes  # noqa: E402
from memory.sizes import parse_bytes  # noqa: E402
from server.assign import Assigner, adapter_profile  # noqa: E402
from wire.facts import NodeFacts  # noqa: E402
from workloads import get_workload  # noqa: E402

TARGETS = ("qkv", "proj", "fc", "out")


@functools.cache
def _assigner(name: str, rank: int = 8, base_dtype: str = "float32", reserve=0):
    wl = get_workload(name)
    return Assigner(
        wl,
        wl.make_model(0),
        local_steps=2,
        runtime_reserve_bytes=reserve,
        train_time_s=1e9,
        adapters="all",
        lora=LoraSpec(
            rank=rank, alpha=2.0 * rank, targets=TARGETS, base_dtype=base_dtype
        ),
    )


def test_adapter_profile_prices_the_frozen_base_and_the_factors():
    a = _assigner("gpt-tiny")
    prof = a.profile
    # gpt-tiny: embed, layers.0, layers.1, head; d=64; rank 8 on qkv, proj, fc, out
    per_layer = 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    numels, _ = a._adapter_sizes()
    assert numels == [0, per_layer, per_layer, 0]
    got = adapter_profile(prof, 2, numels)
    assert [b.name for b in got.blocks] == ["layers.1", "head"]
    layer, head = got.blocks
    assert layer.grad_bytes == 4 * per_layer
    assert layer.optimizer_state_bytes == 8 * per_layer
    assert layer.param_bytes == prof.blocks[2].param_bytes + 4 * per_layer
    assert head.grad_bytes == 0 and head.optimizer_state_bytes == 0
    held = prof.blocks[0].param_bytes + prof.blocks[1].param_bytes
    held += prof.blocks[2].input_bytes
    assert got.batch_bytes == prof.batch_bytes + held
    half = adapter_profile(prof, 2, numels, base_bytes_per_param=2)
    assert half.blocks[0].param_bytes == prof.blocks[2].param_bytes // 2 + 4 * per_layer
    assert half.batch_bytes < got.batch_bytes


def test_budget_decides_where_adapters_sit_rank_matters_little():
    a8 = _assigner("gpt-byte")
    a64 = _assigner("gpt-byte", rank=64)
    starts = a8.adapter_starts()
    assert starts == [1, 2, 3, 4, 5, 6]  # the six layers

    def need(a, start):  # in memory (no disk to stream the frozen base from)
        return min(
            min_budget_bytes(p, disk_budget_bytes=0)
            for p in a.adapter_profiles(start).values()
        )

    last, all_layers = need(a8, starts[-1]), need(a8, starts[0])
    assert last < all_layers  # the lowest adapter sets how far the backward runs
    assert need(a64, starts[-1]) < 1.1 * last  # rank: a few percent
    bf16 = _assigner("gpt-byte", base_dtype="bfloat16")
    assert need(bf16, starts[0]) < 0.9 * all_layers
    int8 = _assigner("gpt-byte", base_dtype="int8")
    # at this size the model's float32 construction sets both floors ...
    assert need(int8, starts[0]) <= need(bf16, starts[0])

    def frozen(a):  # ... what the step holds of the base: about half of bf16's
        p = a.adapter_profiles(starts[0])[1]
        return p.batch_bytes + sum(b.param_bytes for b in p.blocks)

    assert frozen(int8) < 0.6 * frozen(bf16)
    # with a budget between the two, the assigner adapts the layers that fit
    got = a8.assign(
        NodeFacts(budget_bytes=(last + all_layers) // 2, disk_budget_bytes=0), 1
    )
    assert got.kind == "adapter" and got.adapters is not None
    assert starts[0] < got.adapters.start <= starts[-1]
    assert got.predicted_peak_bytes <= (last + all_layers) // 2


@pytest.mark.child
@pytest.mark.parametrize("base_dtype", ["float32", "int8"])
def test_measured_adapter_peak_is_inside_its_budget(base_dtype):
    a = _assigner("gpt-tiny", base_dtype=base_dtype, reserve=parse_bytes("100MiB"))
    budget = a.adapter_min_budget()
    asg = a.assign(NodeFacts(budget_bytes=budget, disk_budget_bytes=0), 1)
    assert asg.kind == "adapter" and asg.plan is not None
    wl = a.workload
    state = {k: v.clone() for k, v in a.model.state_dict().items()}
    batches, n, seed = draw_batches(
        wl, 0, 2, split="iid", alpha=0.5, seed=0, server_round=1, local_steps=2
    )
    kwargs = dict(
        num_examples=n,
        torch_seed=seed,
        plan=asg.plan,
        window=None,
        lr=1e-3,
        adapters=asg.adapters,
    )
    r = train_assigned(state, wl, batches, measure="child", **kwargs)
    assert r.method == "child" and 0 < r.peak_bytes <= budget
    inline = train_assigned(state, wl, batches, measure="inline", **kwargs)
    assert set(r.state) == set(inline.state)  # the factors only, the same bits
    for k in inline.state:
        assert torch.equal(r.state[k], inline.state[k]), k


def test_base_sizes_match_the_profile_and_int8_holds_a_quarter_of_its_layers():
    fp32, int8 = _assigner("gpt-byte"), _assigner("gpt-byte", base_dtype="int8")
    held, transient = fp32._base_sizes()
    assert held == [b.param_bytes for b in fp32.profile.blocks]  # ownership agrees
    assert transient == [0] * len(held)
    q_held, q_transient = int8._base_sizes()
    # gpt-byte (d=512): a layer's linear weights are 12 d^2 floats; int8 keeps a
    # byte each plus a float32 scale per output row, the norms and biases float32
    d = 512
    for i in range(1, 7):
        linear = 4 * 12 * d * d
        assert q_held[i] == held[i] - linear + linear // 4 + 4 * (3 * d + d + 4 * d + d)
        assert q_transient[i] == 4 * 4 * d * d  # the largest: fc or out, 4d x d
    prof = int8.adapter_profiles(1)[1]
    assert all(b.options and "S" not in b.options for b in prof.blocks[:-1])
