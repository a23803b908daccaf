"""The pipeline runtime: stage modules without processes, then torchrun runs (2 and 4
processes, gloo) whose losses and gradients must equal a single-process run."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from memory.blocks import as_blocks
from memory.chain_profile import profile_blocks
from partition.cluster import Cluster
from partition.evaluate import even_split, fixed_plan
from partition.pipeline import build_schedule
from partition.runtime import launch, stage_module
from workloads import get_workload

MLP = "tests.partition.pipe_models:deep_mlp"


def _profile(wl):
    model = wl.make_model(0)
    x, y = wl.example_batch()
    return profile_blocks(as_blocks(model), x, y, wl.loss_fn, measure_time=False)


def _plan(
    workload: str,
    stages_n: int,
    schedule: str,
    m: int,
    v: int = 1,
    d: int = 1,
    recompute=False,
):
    wl = get_workload(workload)
    prof = _profile(wl)
    names = [b.name for b in prof.blocks]
    cluster = Cluster.uniform((stages_n // v) * d, memory="1GB", compute=1e10)
    plan = fixed_plan(
        prof,
        cluster,
        even_split(names, stages_n),
        schedule=schedule,
        num_microbatches=m,
        stages_per_rank=v,
        num_replicas=d,
    )
    if recompute:  # recompute every other block
        from dataclasses import replace

        from memory.spec import BlockPlan

        stages = tuple(
            replace(
                s,
                memory=replace(
                    s.memory,
                    blocks=tuple(
                        BlockPlan(b.name, "recompute" if i % 2 == 0 else "keep")
                        for i, b in enumerate(s.memory.blocks)
                    ),
                ),
            )
            for s in plan.stages
        )
        plan = replace(plan, stages=stages)
    return plan


def _reference(workload: str, steps: int, lr: float = 1e-3):
    wl = get_workload(workload)
    model = wl.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = wl.batches(wl.items(train=True), 0)
    losses, grads = [], {}
    for step in range(steps):
        x, y = next(batches)
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, grads


def test_stage_module_keeps_full_names_and_drops_the_rest():
    wl = get_workload("gpt-tiny")
    full = wl.make_model(0)
    mod = stage_module(copy.deepcopy(full), ["layers.1", "head"], set())
    names = {n for n, _ in mod.named_parameters()}
    assert names and all(n.startswith(("layers.1.", "head.")) for n in names)
    assert isinstance(mod.embed, torch.nn.Identity)
    assert isinstance(mod.layers[0], torch.nn.Identity)
    h = torch.randn(2, 8, 64)
    want = full.head(full.layers[1](h))
    assert torch.equal(mod(h), want)


def test_recomputed_blocks_give_identical_gradients():
    wl = get_workload("gpt-tiny")
    x, y = wl.example_batch()
    ref = wl.make_model(0)
    wl.loss_fn(ref(x), y).backward()
    mod = stage_module(
        wl.make_model(0),
        ["embed", "layers.0", "layers.1", "head"],
        {"layers.0", "layers.1"},
    )
    wl.loss_fn(mod(x), y).backward()
    for (n, a), (_, b) in zip(ref.named_parameters(), mod.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_tied_weights_across_stages_are_refused():
    wl = get_workload("gpt2-small")
    from workloads.models import GPT, GPTConfig

    model = GPT(
        GPTConfig(
            vocab_size=64,
            context=8,
            d_model=16,
            num_layers=2,
            num_heads=2,
            tie_weights=True,
        )
    )
    with pytest.raises(ValueError, match="tied weights"):
        stage_module(model, ["layers.0", "layers.1", "head"], set())
    del wl


def _check(out, plan, workload, steps, ref):
    losses, grads = ref
    nproc = plan.num_ranks * plan.num_replicas
    got = {}
    for r in range(nproc):
        got.update(load_file(str(out / f"grads{r}.safetensors")))
    assert set(got) == set(grads)
    for n, g in grads.items():
        err = (got[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err < 1e-5, (n, float(err))
    assert len(losses) == steps
    return losses


def _run(tmp_path, plan, workload, steps=2, trace=False, device="cpu"):
    res = launch(
        plan,
        workload,
        tmp_path,
        steps=steps,
        save_grads=True,
        timeout_s=300,
        trace=trace,
        device=device,
    )
    ref = _reference(workload, steps)
    _check(tmp_path, plan, workload, steps, ref)
    assert res["losses"] == pytest.approx(ref[0], rel=1e-5)
    return res


@pytest.mark.child
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_two_processes_match_one(tmp_path, schedule):
    plan = _plan("gpt-tiny", 2, schedule, m=2, recompute=schedule == "1F1B")
    res = _run(tmp_path, plan, "gpt-tiny", trace=True)
    # the action trace: per rank and step, the schedule's forwards and backwards in
    # its order, each inside the step, CPU time within wall time
    sched = build_schedule(schedule, 2, 2)
    for r in res["ranks"]:
        want = [
            (a.kind, a.stage, a.microbatch)
            for a in sched.ranks[r["rank"]]
            if a.kind in ("F", "B")
        ]
        assert len(r["trace"]) == 2
        for step in r["trace"]:
            *acts, (kind, _, _, start, step_s, _) = step
            assert kind == "step" and start == 0.0
            assert [(a[0], a[1], a[2]) for a in acts] == want
            prev = 0.0
            for _, _, _, a, b, cpu in acts:
                assert prev <= a <= b <= step_s
                assert 0.0 <= cpu <= (b - a) + 2e-3
                prev = b


@pytest.mark.distributed
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl_match_one_process(tmp_path):
    """The same plan on CUDA with NCCL (one GPU per rank): losses and gradients of
    one CPU process within the float tolerance of _check."""
    plan = _plan("gpt-tiny", 2, "1F1B", m=2, recompute=True)
    res = _run(tmp_path, plan, "gpt-tiny", device="cuda")
    assert all(r["max_memory_allocated"] > 0 for r in res["ranks"])


def test_cuda_without_a_gpu_is_refused_before_starting(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    plan = _plan("gpt-tiny", 2, "1F1B", m=2)
    with pytest.raises(ValueError, match="device cuda: this torch has no usable CUDA"):
        launch(plan, "gpt-tiny", tmp_path, device="cuda")
    assert not (tmp_path / "torchrun.log").exists()


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize(
    "schedule,stages,v,d,m",
    [
        ("1F1B", 4, 1, 1, 4),
        ("Interleaved1F1B", 8, 2, 1, 4),
        ("InterleavedZeroBubble", 4, 1, 1, 4),
        ("GPipe", 2, 1, 2, 2),  # 2 ranks x 2 data-parallel replicas
    ],
)
def test_four_processes_match_one(tmp_path, schedule, stages, v, d, m):
    _run(tmp_path, _plan(MLP, stages, schedule, m=m, v=v, d=d), MLP)


@pytest.mark.heavy
@pytest.mark.distributed
def test_namespace_fleet_runs_a_pipeline_and_cleans_up(tmp_path):
    import subprocess

    from partition import netns

    why = netns.available()
    if why:
        pytest.skip(f"namespace fleet unavailable: {why}")
    plan = _plan("gpt-tiny", 2, "1F1B", m=2)
    pf = tmp_path / "plan.json"
    pf.write_text(plan.to_json())
    hosts = [netns.HostSpec("a", 0.5, 20e6), netns.HostSpec("b", 0.3, 5e6)]
    with netns.Fleet(hosts) as fleet:
        res = fleet.run_ranks(pf, "gpt-tiny", tmp_path, steps=2, timeout_s=300)
    ref_losses, _ = _reference("gpt-tiny", 2)
    assert res[1]["losses"] == pytest.approx(ref_losses, rel=1e-5)
    # every rank ran every step and reports its CPU per step and by thread. A step's
    # CPU can read 0 on a loaded machine (a rank throttled by its cgroup quota
    # mostly waits, and the kernel adds a running thread's time at ticks and
    # switches), so per step only >= 0 holds; the run's CPU by thread (imports,
    # model, steps: seconds of work) is > 0 however long the rank waited
    for r in res:
        assert len(r["cpu_times_s"]) == len(r["step_times_s"]) == 2
        assert all(t > 0 for t in r["step_times_s"])
        assert all(math.isfinite(c) and c >= 0 for c in r["cpu_times_s"])
        assert 0 <= r["cpu_s"] <= max(r["cpu_times_s"])
        assert sum(r["thread_cpu_s"].values()) > 0
    left = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout
    assert netns.PREFIX not in left


@pytest.mark.heavy
@pytest.mark.distributed
def test_namespace_fleet_probes_every_host_and_can_be_rebuilt_at_once():
    """Probes run in each host's namespace and cgroup; a fleet made right after the
    last one closed does not trip over its vanishing veth pairs."""
    import sys

    from partition import netns

    why = netns.available()
    if why:
        pytest.skip(f"namespace fleet unavailable: {why}")
    hosts = [netns.HostSpec("a", 0.5, 20e6), netns.HostSpec("b", 0.3, 5e6)]
    code = (
        "import json, os; print(json.dumps([open('/proc/self/cgroup').read(), "
        "sorted(os.listdir('/sys/class/net'))]))"
    )
    for _ in range(3):
        with netns.Fleet(hosts) as fleet:
            outs = fleet.run_on_all([sys.executable, "-c", code])
        assert len(outs) == 2
        for i, out in enumerate(outs):
            cgroups, nets = json.loads(out)
            # its own cgroup (the CPU quota) and its own network: lo and its veth end
            assert f"/{netns.PREFIX}{i}\n" in cgroups
            assert nets == ["ffeth0", "lo"]
