"""An ``adapter`` assignment trains LoRA factors only (memory.lora, peft), on the
built-in GPT (chain path) and on a transformers GPT-2 (per unit): under a plan it
equals plain LoRA training, the base stays frozen, and the reply is the factors."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("peft")

from client.train import draw_batches, train_assigned  # noqa: E402
from memory.blocks import as_blocks  # noqa: E402
from memory.lora import LoraSpec, add_adapters, factor_keys  # noqa: E402
from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from workloads import get_workload  # noqa: E402
from workloads.models import lm_loss  # noqa: E402

TINY = LoraSpec(rank=4, alpha=8.0, targets=("qkv", "proj", "fc", "out"), start=2)


@functools.cache
def _setup(name: str):
    wl = get_workload(name)
    model = wl.make_model(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches, n, seed = draw_batches(
        wl, 0, 2, split="iid", alpha=0.5, seed=0, server_round=1, local_steps=3
    )
    return wl, model, state, batches, n, seed


def _train(name, spec, plan=None, measure="inline"):
    wl, _, state, batches, n, seed = _setup(name)
    return train_assigned(
        state,
        wl,
        batches,
        num_examples=n,
        torch_seed=seed,
        plan=plan,
        window=None,
        lr=1e-2,
        measure=measure,
        adapters=spec,
    )


def _reference(name, spec):
    """Plain LoRA training by hand: peft adapters, torch AdamW on them alone."""
    wl, _, state, batches, _, seed = _setup(name)
    model = wl.make_model(0)
    model.load_state_dict(state)
    torch.manual_seed(seed)
    paths = add_adapters(model, spec, as_blocks(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-2)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    modules = dict(model.named_modules())
    out = {}
    for p in paths:
        a, b = factor_keys(p)
        out[a] = modules[p].lora_A["default"].weight.detach()
        out[b] = modules[p].lora_B["default"].weight.detach()
    return out, losses


def test_gpt_adapters_equal_plain_lora_and_only_factors_return():
    plain = _train("gpt-tiny", TINY)
    want, losses = _reference("gpt-tiny", TINY)
    assert set(plain.state) == set(want)
    assert all(".layers.0." not in k and k.startswith("layers.1.") for k in plain.state)
    for k in want:
        torch.testing.assert_close(plain.state[k], want[k], rtol=1e-5, atol=1e-6)
    assert plain.mean_loss == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert any(
        k.endswith("lora_B") and v.abs().sum() > 0 for k, v in plain.state.items()
    )


@pytest.mark.parametrize("how", ["recompute", "offload"])
def test_gpt_adapters_under_a_plan_equal_plain_bit_for_bit(how):
    plain = _train("gpt-tiny", TINY)
    # the chain [start, last]: layers.1 and the head
    plan = MemoryPlan((BlockPlan("layers.1", how), BlockPlan("head", how)))
    planned = _train("gpt-tiny", TINY, plan)
    for k in plain.state:
        assert torch.equal(plain.state[k], planned.state[k]), k
    assert plain.mean_loss == planned.mean_loss


def test_bf16_base_trains_float32_factors():
    spec = LoraSpec(
        rank=4, alpha=8.0, targets=("qkv", "fc"), start=1, base_dtype="bfloat16"
    )
    got = _train("gpt-tiny", spec)
    full = _train(
        "gpt-tiny", LoraSpec(rank=4, alpha=8.0, targets=("qkv", "fc"), start=1)
    )
    assert set(got.state) == set(full.state)
    assert all(v.dtype == torch.float32 for v in got.state.values())
    # the same training in bfloat16 arithmetic: the same losses to bf16's precision
    assert got.mean_loss == pytest.approx(full.mean_loss, rel=1e-2)
    assert all(bool(torch.isfinite(v).all()) for v in got.state.values())


def test_int8_base_trains_float32_factors_near_the_float32_base():
    targets = ("qkv", "fc")
    got = _train(
        "gpt-tiny",
        LoraSpec(rank=4, alpha=8.0, targets=targets, start=1, base_dtype="int8"),
    )
    full = _train("gpt-tiny", LoraSpec(rank=4, alpha=8.0, targets=targets, start=1))
    assert set(got.state) == set(full.state)
    assert all(v.dtype == torch.float32 for v in got.state.values())
    # float32 arithmetic on weights rounded to 8 bits: the losses within 1%
    assert got.mean_loss == pytest.approx(full.mean_loss, rel=1e-2)
    assert got.mean_loss != full.mean_loss  # the base really was quantized
    assert all(bool(torch.isfinite(v).all()) for v in got.state.values())


SPEC = "examples.transformers_gpt2:build"


def test_transformers_gpt2_adapters_per_unit_under_recompute():
    pytest.importorskip("transformers")
    # units: wte, wpe, h.0 .. h.3, ln_f, lm_head; adapters on h.2 and h.3
    spec = LoraSpec(rank=4, alpha=8.0, targets=("c_attn", "c_fc"), start=4)
    plain = _train(SPEC, spec)
    assert sorted({k.split(".")[2] for k in plain.state}) == ["2", "3"]
    names = ["transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    plan = MemoryPlan(tuple(BlockPlan(n, "recompute") for n in names))
    planned = _train(SPEC, spec, plan)
    for k in plain.state:
        assert torch.equal(plain.state[k], planned.state[k]), k
    assert any(
        k.endswith("lora_B") and v.abs().sum() > 0 for k, v in plain.state.items()
    )


def test_transformers_gpt2_adapters_on_an_int8_base():
    pytest.importorskip("transformers")
    targets = ("c_attn", "c_fc")
    full = _train(SPEC, LoraSpec(rank=4, alpha=8.0, targets=targets, start=4))
    got = _train(
        SPEC, LoraSpec(rank=4, alpha=8.0, targets=targets, start=4, base_dtype="int8")
    )
    assert set(got.state) == set(full.state)
    assert got.mean_loss == pytest.approx(full.mean_loss, rel=1e-2)
    assert got.mean_loss != full.mean_loss
