"""Pipelines of transformers models (GPT-2 with its tied head, Llama with rotary
embeddings): stage modules cut at the units, checked in one process against the
unsplit model (bit for bit), then torchrun runs (gloo, 2 and 3 processes) whose losses
and every gradient must equal a single-process run."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from partition.model_stages import (  # noqa: E402
    CausalLMStage,
    StageError,
    TiedGroup,
    TiedWeights,
    build_stage,
    check_stages,
    split_batch,
    tied_groups,
)
from workloads import get_workload  # noqa: E402

GPT2 = "tests.partition.hf_models:gpt2"
LLAMA = "tests.partition.hf_models:llama"
GPT2_CUTS = [
    ["transformer.wte"],
    ["transformer.wpe", "transformer.h.0"],
    ["transformer.h.1", "transformer.ln_f", "lm_head"],
]
LLAMA_CUTS = [
    ["model.embed_tokens", "model.layers.0"],
    ["model.layers.1", "model.layers.2", "model.norm", "lm_head"],
]
# Relative tolerance (largest difference over the largest value) of a pipelined run
# against one process: micro-batches change the order of the loss's and the weight
# gradients' sums, so fp32 results agree to rounding, not bit for bit.
RTOL = 1e-5


def _example(workload):
    wl = get_workload(workload)
    inputs, targets, _ = wl.example
    return wl, inputs, split_batch(inputs, targets)


def _reference(workload, steps=1, lr=1e-3, threads=None):
    """Losses of ``steps`` AdamW steps of the unsplit model and its first gradients,
    every name (tied names both listed); ``threads``: torch's threads meanwhile (the
    pipeline's ranks run one each, and LayerNorm's backward sums by thread)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _reference_steps(workload, steps, lr)
    finally:
        torch.set_num_threads(before)


def _reference_steps(workload, steps, lr):
    wl, inputs, _ = _example(workload)
    model = wl.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        if step == 0:
            grads = {
                n: p.grad.clone()
                for n, p in model.named_parameters(remove_duplicate=False)
            }
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, grads


def _chain(workload, cuts, plans=None):
    """The stages run in turn in this process, backward stage by stage as the
    pipeline sends gradients, tied copies summed: the loss and the stage modules."""
    wl, _, (ids, labels) = _example(workload)
    built = [
        build_stage(wl.make_model(0), c, None if plans is None else plans[i])
        for i, c in enumerate(cuts)
    ]
    mods = [b.module for b in built]
    ins, outs, h = [], [], ids
    for m in mods:
        x = h.detach().requires_grad_(h.is_floating_point())
        ins.append(x)
        h = m(x)
        outs.append(h)
    loss = mods[-1].loss(h, labels)
    loss.backward()
    for i in range(len(mods) - 1, 0, -1):
        outs[i - 1].backward(ins[i].grad)
    plan = _plan_stub(cuts)
    TiedWeights(tied_groups(wl.make_model(0), plan), 1, 1, 0).sum_grads(mods)
    for b in built:
        b.end_step()
    return float(loss.detach()), mods


def _plan_stub(cuts, ranks=None):
    from types import SimpleNamespace

    ranks = ranks or [0] * len(cuts)
    return SimpleNamespace(
        stages=[SimpleNamespace(rank=r, blocks=tuple(c)) for r, c in zip(ranks, cuts)]
    )


# ----------------------------------------------------------------- no processes
@pytest.mark.parametrize(
    "workload,cuts",
    [
        (GPT2, GPT2_CUTS),
        (
            GPT2,
            [["transformer.wte", "transformer.wpe"], GPT2_CUTS[1][1:] + GPT2_CUTS[2]],
        ),
        (LLAMA, LLAMA_CUTS),
        (LLAMA, [[n] for n in LLAMA_CUTS[0] + LLAMA_CUTS[1]]),  # one unit per stage
    ],
)
def test_stages_reproduce_the_model_bit_for_bit(workload, cuts):
    wl, _, (ids, _) = _example(workload)
    check_stages(wl.make_model(0), cuts, ids)


@pytest.mark.parametrize("workload,cuts", [(GPT2, GPT2_CUTS), (LLAMA, LLAMA_CUTS)])
def test_chained_stages_give_one_process_gradients_bit_for_bit(workload, cuts):
    """Every gradient, the tied head's included (its copies on the first and last
    stage summed), equals the unsplit model's; recompute in a stage changes nothing."""
    plans = [
        MemoryPlan(blocks=tuple(BlockPlan(n, "recompute") for n in c)) for c in cuts
    ]
    losses, grads = _reference(workload)
    for p in (None, plans):
        loss, mods = _chain(workload, cuts, p)
        assert loss == losses[0]
        seen = set()
        for m in mods:
            for n, prm in m.named_parameters(remove_duplicate=False):
                assert torch.equal(prm.grad, grads[n]), n
                seen.add(n)
        assert seen == set(grads)


def test_tied_groups_name_the_ranks_holding_a_copy():
    wl = get_workload(GPT2)
    groups = tied_groups(wl.make_model(0), _plan_stub(GPT2_CUTS, [0, 1, 2]))
    assert groups == [TiedGroup(("transformer.wte.weight", "lm_head.weight"), (0, 2))]
    assert tied_groups(get_workload(LLAMA).make_model(0), _plan_stub(LLAMA_CUTS)) == []


def test_a_stage_keeps_full_names_and_only_its_units():
    wl = get_workload(GPT2)
    stage = CausalLMStage(wl.make_model(0), GPT2_CUTS[2])
    names = {n for n, _ in stage.named_parameters()}
    assert "lm_head.weight" in names and "transformer.h.1.ln_1.weight" in names
    assert not any(n.startswith(("transformer.h.0.", "transformer.wpe")) for n in names)
    assert stage.last and not stage.first


def test_what_the_stages_cannot_run_is_refused():
    wl, inputs, _ = _example(GPT2)
    model = wl.make_model(0)
    with pytest.raises(StageError, match="stream"):
        plan = MemoryPlan(blocks=(BlockPlan("transformer.h.0", "recompute", "stream"),))
        build_stage(copy.deepcopy(model), GPT2_CUTS[1], plan)
    with pytest.raises(StageError, match="contiguous"):
        CausalLMStage(copy.deepcopy(model), ["transformer.wte", "transformer.h.0"])
    with pytest.raises(StageError, match="does not have"):
        CausalLMStage(copy.deepcopy(model), ["model.layers.0"])
    with pytest.raises(StageError, match="GPT-2"):
        CausalLMStage(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["0"])
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -3:] = 0
    with pytest.raises(StageError, match="pads"):
        split_batch({**inputs, "attention_mask": mask}, None)
    with pytest.raises(StageError, match="not carried"):
        split_batch({**inputs, "token_type_ids": mask}, None)


# ----------------------------------------------------------------- torchrun
def _fixed(workload, cuts, schedule, m, plans):
    from memory.unit_profile import unit_profiles
    from partition.cluster import Cluster
    from partition.evaluate import fixed_plan

    wl, inputs, _ = _example(workload)
    prof = unit_profiles(wl.make_model(0), inputs, chunk_options=(1,))[1]
    cluster = Cluster.uniform(len(cuts), memory="1GB", compute=1e10)
    plan = fixed_plan(prof, cluster, cuts, schedule=schedule, num_microbatches=m)
    stages = tuple(
        replace(s, memory=plans.get(s.stage_index, s.memory)) for s in plan.stages
    )
    return replace(plan, stages=stages)


def _pipelined(tmp_path, workload, plan, steps=2):
    from safetensors.torch import load_file

    from partition.runtime import launch

    res = launch(plan, workload, tmp_path, steps=steps, save_grads=True, timeout_s=300)
    got = {}
    for r in range(plan.num_ranks):
        got.update(load_file(str(tmp_path / f"grads{r}.safetensors")))
    return res, got


def _compare(res, got, ref):
    losses, grads = ref
    assert set(got) == set(grads)  # the tied head's both names: one copy each
    worst = 0.0
    for n, g in grads.items():
        err = float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
        worst = max(worst, err)
        assert err < RTOL, (n, err)
    assert res["losses"] == pytest.approx(losses, rel=RTOL)
    return worst


@pytest.mark.heavy
@pytest.mark.distributed
def test_gpt2_three_processes_match_one(tmp_path):
    """1F1B over 3 ranks, 4 micro-batches; the tied embedding on rank 0 and head on
    rank 2; the last stage recomputes its layer."""
    rec = MemoryPlan(
        blocks=(
            BlockPlan("transformer.h.1", "recompute"),
            BlockPlan("transformer.ln_f"),
            BlockPlan("lm_head"),
        )
    )
    plan = _fixed(GPT2, GPT2_CUTS, "1F1B", 4, {2: rec})
    res, got = _pipelined(tmp_path, GPT2, plan)
    _compare(res, got, _reference(GPT2, steps=2))
    # both copies of the tied weight received the same (summed) gradient
    assert torch.equal(got["transformer.wte.weight"], got["lm_head.weight"])


@pytest.mark.heavy
@pytest.mark.distributed
def test_gpt2_one_microbatch_is_bit_for_bit(tmp_path):
    """GPipe over 3 ranks, one micro-batch: every loss and gradient, the tied
    weight's sum across ranks 0 and 2 included, equals one single-threaded process
    exactly."""
    plan = _fixed(GPT2, GPT2_CUTS, "GPipe", 1, {})
    res, got = _pipelined(tmp_path, GPT2, plan)
    losses, grads = _reference(GPT2, steps=2, threads=1)
    assert res["losses"] == losses
    for n, g in grads.items():
        assert torch.equal(got[n], g), n


@pytest.mark.child
@pytest.mark.distributed
def test_llama_two_processes_match_one(tmp_path):
    """GPipe over 2 ranks, 2 micro-batches; stage 0 offloads its layer's activations
    to files, stage 1 recomputes one layer."""
    off = MemoryPlan(
        blocks=(BlockPlan("model.embed_tokens"), BlockPlan("model.layers.0", "offload"))
    )
    rec = MemoryPlan(
        blocks=tuple(
            BlockPlan(n, "recompute" if n == "model.layers.1" else "keep")
            for n in LLAMA_CUTS[1]
        )
    )
    plan = _fixed(LLAMA, LLAMA_CUTS, "GPipe", 2, {0: off, 1: rec})
    res, got = _pipelined(tmp_path, LLAMA, plan)
    _compare(res, got, _reference(LLAMA, steps=2))


@pytest.mark.child
def test_cli_plans_a_transformers_model_over_its_units(tmp_path, capsys):
    """``fleetfit partition plan --workload module:function`` on GPT-2: profiled per
    unit, every unit in exactly one stage, in order."""
    import json

    from fleetfit.cli import main

    cluster = tmp_path / "two.toml"
    cluster.write_text(
        'name = "two"\n[network]\nbandwidth = "1GB/s"\n'
        + "".join(
            f'[[hosts]]\nname = "h{i}"\nmemory = "1GB"\ncompute = "1GFLOP/s"\n'
            for i in range(2)
        )
    )
    rc = main(
        ["partition", "plan", "--workload", GPT2, "--cluster", str(cluster), "--json"]
    )
    assert rc == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plan"]
    blocks = [b for s in plan["stages"] for b in s["blocks"]]
    assert blocks == [n for c in GPT2_CUTS for n in c]
