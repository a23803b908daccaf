"""Run a ``PartitionPlan`` on torch.distributed: one process per pipeline rank (and
replica), stages from ``torch.distributed.pipelining``, the schedule chosen by name.

Each process builds the whole model from the same seed, keeps the blocks its stages
own under their full names and replaces every other block with ``nn.Identity`` (the
torchtitan way: state-dict keys stay those of the unsplit model), wraps the blocks
its memory plan recomputes in ``torch.utils.checkpoint``, and builds a manual
``PipelineStage`` per stage. ``get_schedule_class(plan.schedule_name)`` runs the
micro-batches; replicas average their gradients with an all-reduce over the ranks
that hold the same stages; AdamW updates each rank's own parameters.

Launch on one machine (``torchrun --standalone``)::

    python -m partition.runtime launch --plan plan.json --workload gpt-tiny --steps 3

or per process with torch's ``env://`` variables (``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``), as the namespace fleet does::

    python -m partition.runtime worker --plan plan.json --workload gpt-tiny --out DIR

``--device cuda`` runs each process on the GPU of its ``LOCAL_RANK`` with NCCL
(``launch(device="cuda")``, ``fleetfit partition run --device cuda``); the default is
CPU with gloo.

Each rank writes ``rank{r}.json`` (losses, step times) and, with ``--save-grads``,
``grads{r}.safetensors`` (the first step's gradients of its own parameters, full names)
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partition.plans import PartitionPlan

logger = logging.getLogger(__name__)


class RuntimeError_(RuntimeError):
    """A pipeline run that failed; the message says which rank and why."""


# --------------------------------------------------------------------------- stages
def stage_module(model: nn.Module, owned: list[str], recompute: set[str]) -> nn.Module:
    """``model`` with every block outside ``owned`` replaced by ``nn.Identity``.

    Names of owned parameters stay those of the full model. Blocks in ``recompute``
    run under ``torch.utils.checkpoint`` (non-reentrant): their activations are
    recomputed in backward.
    """
    from torch.utils.checkpoint import checkpoint

    from memory.blocks import as_blocks

    names = [b.name for b in as_blocks(model)]
    missing = [n for n in owned if n not in names]
    if missing:
        raise ValueError(
            f"the plan names blocks {missing} that the model does not have; its blocks "
            f"are {names[:4]}...{names[-2:]}"
        )
    owned_params = {id(p) for n in owned for p in model.get_submodule(n).parameters()}
    for n in names:
        if n in owned:
            continue
        mod = model.get_submodule(n)
        shared = [p for p in mod.parameters() if id(p) in owned_params]
        if shared:
            raise ValueError(
                f"block {n} shares parameters with a block of another stage (tied "
                "weights): the pipeline runtime cannot split them; untie them or keep "
                "both blocks in one stage"
            )
        parent_name, _, leaf = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, nn.Identity())
    for n in recompute:
        mod = model.get_submodule(n)
        fwd = mod.forward

        def wrapped(*args: Any, _f: Any = fwd) -> Any:
            return checkpoint(_f, *args, use_reentrant=False)

        mod.forward = wrapped  # type: ignore[method-assign]
    return model


def _groups(world: int, ranks: int, rank: int) -> tuple[Any, Any]:
    """This process's pipeline group (its replica) and data-parallel group."""
    import torch.distributed as dist

    replicas = world // ranks
    pp = dp = None
    for g in range(replicas):
        grp = dist.new_group(list(range(g * ranks, (g + 1) * ranks)))
        if rank // ranks == g:
            pp = grp
    for r in range(ranks):
        grp = dist.new_group(list(range(r, world, ranks)))
        if rank % ranks == r:
            dp = grp
    return pp, dp


# --------------------------------------------------------------------------- worker
def run_worker(
    plan: PartitionPlan,
    workload: str,
    out: str | Path,
    *,
    steps: int = 3,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    save_grads: bool = False,
    threads: int = 1,
    dtype: str = "float32",
    trace: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """The body of one process (``torch.distributed`` initialised from ``env://``).

    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; each process takes the GPU of
    its ``LOCAL_RANK``).

    With ``trace``, the result's ``"trace"`` lists, for every step, each forward and
    backward action this rank ran: ``[kind, stage, micro-batch, start s, end s, CPU s]``
    with times from the step's start and the CPU seconds of this thread (what the
    simulator's per-action times are compared against; see docs/partition.md)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        get_schedule_class,
    )

    from workloads import get_workload

    torch.set_num_threads(threads)
    dev = check_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if plan.schedule_name == "local":
        raise ValueError(
            "a one-device plan runs with partition.local (fleetfit memory run), not "
            "torch.distributed"
        )
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    p, d = plan.num_ranks, plan.num_replicas
    if world != p * d:
        raise ValueError(
            f"the plan needs {p * d} processes ({p} ranks x {d} replicas), got {world}"
        )
    pp_group, dp_group = _groups(world, p, rank)
    pp_rank, replica = rank % p, rank // p
    wl = get_workload(workload, batch_size=batch_size, seq_len=seq_len)
    if wl.batch_size != plan.batch_size:
        raise ValueError(
            f"the plan is for batches of {plan.batch_size}, the workload's are "
            f"{wl.batch_size}; pass the planned batch size"
        )
    dt = getattr(torch, dtype)
    mine = [s for s in plan.stages if s.rank == pp_rank]
    stages, params = [], []
    built: list[Any] = []  # transformers stages (partition.model_stages)
    tied = None
    if wl.any_model:
        from partition.model_stages import TiedWeights, build_stage, tied_groups

        tied = TiedWeights(tied_groups(wl.make_model(seed), plan), p, d, rank)
    for s in mine:
        model = wl.make_model(seed).to(dt)
        if wl.any_model:
            b = build_stage(
                model,
                list(s.blocks),
                s.memory,
                offload_dir=str(Path(out) / f"offload-rank{rank}"),
            )
            built.append(b)
            mod: nn.Module = b.module
        else:
            rec = {b.name for b in s.memory.blocks if b.activations != "keep"}
            mod = stage_module(model, list(s.blocks), rec)
        mod.to(dev)
        params += list(mod.parameters())
        stages.append(
            PipelineStage(mod, s.stage_index, plan.num_stages, dev, group=pp_group)
        )
    actions: list[list[Any]] = []  # this step's trace (trace=True)
    step_t0 = [0.0]
    if trace:
        for st in stages:
            _trace_actions(st, actions, step_t0)
    cls = get_schedule_class(plan.schedule_name)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if built:  # the transformers model's own causal-LM loss
            return built[0].module.loss(output, target)
        return wl.loss_fn(output, target)

    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(
        stages[0] if single else stages,
        n_microbatches=plan.num_microbatches,
        loss_fn=loss_fn,
        scale_grads=True,
    )
    optimizer = torch.optim.AdamW(params, lr=lr)
    batches = (
        _any_model_batches(wl, steps)
        if built
        else wl.batches(wl.items(train=True), seed)
    )
    per = plan.batch_size // d
    first = any(s.stage_index == 0 for s in mine)
    last = any(s.stage_index == plan.num_stages - 1 for s in mine)
    losses: list[float] = []
    times: list[float] = []
    cpu_times: list[float] = []  # this process's CPU seconds per step (all threads)
    sys_times: list[float] = []  # of which in the kernel (page faults, sockets)
    grads: dict[str, torch.Tensor] = {}
    traces: list[list[list[Any]]] = []
    for step in range(steps):
        x, y = next(batches)
        x, y = (
            x[replica * per : (replica + 1) * per],
            y[replica * per : (replica + 1) * per],
        )
        if x.is_floating_point():
            x = x.to(dt)
        x, y = x.to(dev), y.to(dev)
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu()
        step_t0[0] = t0
        actions.clear()
        mb_losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if last:
            kwargs.update(target=y, losses=mb_losses)
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        if tied is not None:  # before the replicas' average: both are sums
            tied.sum_grads([st.submod for st in stages])
        if d > 1:
            for prm in params:
                if prm.grad is not None:
                    dist.all_reduce(prm.grad, group=dp_group)
                    prm.grad /= d
        if save_grads and step == 0:
            for s_idx, st in enumerate(stages):
                for name, prm in st.submod.named_parameters():
                    if prm.grad is not None:
                        grads[name] = prm.grad.detach().cpu().clone()
                del s_idx
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for b in built:
            b.end_step()  # this step's offloaded activations are no longer needed
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        if trace:
            traces.append(list(actions) + [["step", -1, -1, 0.0, times[-1], 0.0]])
        c1 = _cpu()
        cpu_times.append(c1[0] + c1[1] - c0[0] - c0[1])
        sys_times.append(c1[1] - c0[1])
        # the step's loss: mean over micro-batches (and replicas), sent to every rank
        value = torch.zeros(1, dtype=torch.float64, device=dev)
        if last and mb_losses:
            value[0] = float(
                torch.stack([v.detach().double() for v in mb_losses]).mean()
            )
        dist.all_reduce(value)
        losses.append(float(value[0]) / d)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    later = times[1:] or times
    thread_cpu = _thread_cpu_s()
    result: dict[str, Any] = {
        "rank": rank,
        "stages": [s.stage_index for s in mine],
        "losses": losses,
        "step_times_s": times,
        "step_s": statistics.median(later),
        "cpu_times_s": cpu_times,
        "cpu_s": statistics.median(cpu_times[1:] or cpu_times),
        "cpu_sys_s": statistics.median(sys_times[1:] or sys_times),
        "thread_cpu_s": thread_cpu,
    }
    if trace:
        result["trace"] = traces
    if dev.type == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if save_grads:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in grads.items()},
            str(out / f"grads{rank}.safetensors"),
        )
    dist.barrier()
    dist.destroy_process_group()
    return result


def check_device(device: str) -> torch.device:
    """``"cpu"`` or ``"cuda"`` as a ``torch.device``; a clear error otherwise."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: choose cpu (gloo) or cuda (NCCL)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device cuda: this torch has no usable CUDA GPU "
            f"(torch {torch.__version__}); use device cpu"
        )
    return torch.device(device)


def _trace_actions(stage: Any, actions: list[list[Any]], t0: list[float]) -> None:
    """Wrap ``stage``'s forward and backward of one micro-batch so each call appends
    ``[kind, stage index, micro-batch, start, end, thread CPU s]`` to ``actions``
    (times relative to ``t0[0]``, the step's start)."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        inner = getattr(stage, name)

        def timed(
            mb: int, *args: Any, _f: Any = inner, _k: str = kind, **kw: Any
        ) -> Any:
            a, c = time.perf_counter(), time.thread_time()
            r = _f(mb, *args, **kw)
            actions.append(
                [
                    _k,
                    stage.stage_index,
                    mb,
                    a - t0[0],
                    time.perf_counter() - t0[0],
                    time.thread_time() - c,
                ]
            )
            return r

        setattr(stage, name, timed)


def _any_model_batches(wl: Any, steps: int) -> Any:
    """``(input_ids, labels)`` per step of a transformers workload: its ``load_data``
    batches, or its example batch at every step."""
    from partition.model_stages import split_batch

    batches, _ = wl.node_batches(0, 1, server_round=1, local_steps=steps)
    return iter([split_batch(*b) for b in batches])


def _cpu() -> tuple[float, float]:
    """This process's (user, system) CPU seconds at microsecond resolution
    (``os.times`` counts 10 ms clock ticks: a short step read as zero)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads so far, summed by thread name (Linux;
    empty elsewhere): where a rank's CPU goes besides its blocks."""
    by_name: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        secs = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        by_name[name] = round(by_name.get(name, 0.0) + secs, 3)
    return by_name


# --------------------------------------------------------------------------- launcher
def launch(
    plan: PartitionPlan,
    workload: str,
    out: str | Path,
    *,
    steps: int = 3,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    save_grads: bool = False,
    threads: int = 1,
    dtype: str = "float32",
    timeout_s: float = 600.0,
    port: int | None = None,
    trace: bool = False,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run ``plan`` with ``torchrun --standalone`` on this machine; wait; collect.

    ``trace``: every rank's result lists its actions per step (``run_worker``).
    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per process: the plan
    needs ranks x replicas GPUs on this machine).

    Returns:
        ``{"losses": [...], "step_s": slowest rank's median, "ranks": [...]}``.

    Raises:
        RuntimeError_: a process failed or the run passed ``timeout_s`` (every process
            is killed either way).
    """
    from workloads.registry import child_env

    nproc = plan.num_ranks * plan.num_replicas
    if check_device(device).type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(
            f"the plan runs {nproc} processes, one GPU each; this machine has "
            f"{torch.cuda.device_count()}; use fewer ranks or replicas, or device cpu"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan_file = out / "plan.json"
    plan_file.write_text(plan.to_json())
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone" if port is None else f"--master-port={port}",
        f"--nproc-per-node={nproc}",
        "-m",
        "partition.runtime",
        "worker",
        *_worker_args(
            plan_file,
            workload,
            out,
            steps,
            seed,
            lr,
            batch_size,
            seq_len,
            save_grads,
            threads,
            dtype,
            trace,
            device,
        ),
    ]
    env = child_env()
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    log = out / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError_(
                f"the pipeline run passed {timeout_s:.0f} s and was killed; see {log}"
            ) from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError_(f"torchrun exited with {rc}; last output:\n{tail}")
    return collect(out, nproc)


def collect(out: str | Path, nproc: int) -> dict[str, Any]:
    """Gather the ranks' result files."""
    ranks = [
        json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)
    ]
    return {
        "losses": ranks[0]["losses"],
        "step_s": max(r["step_s"] for r in ranks),
        "ranks": ranks,
    }


def _worker_args(
    plan_file: Path,
    workload: str,
    out: Path,
    steps: int,
    seed: int,
    lr: float,
    batch_size: int | None,
    seq_len: int | None,
    save_grads: bool,
    threads: int,
    dtype: str,
    trace: bool = False,
    device: str = "cpu",
) -> list[str]:
    args = [
        f"--plan={plan_file}",
        f"--workload={workload}",
        f"--out={out}",
        f"--steps={steps}",
        f"--seed={seed}",
        f"--lr={lr}",
        f"--threads={threads}",
        f"--dtype={dtype}",
    ]
    if batch_size:
        args.append(f"--batch={batch_size}")
    if seq_len:
        args.append(f"--seq={seq_len}")
    if save_grads:
        args.append("--save-grads")
    if trace:
        args.append("--trace")
    if device != "cpu":
        args.append(f"--device={device}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m partition.runtime")
    parser.add_argument("mode", choices=["worker"])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--save-grads", action="store_true")
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = parser.parse_args(argv)
    plan = PartitionPlan.from_dict(json.loads(Path(a.plan).read_text()))
    run_worker(
        plan,
        a.workload,
        a.out,
        steps=a.steps,
        seed=a.seed,
        lr=a.lr,
        batch_size=a.batch,
        seq_len=a.seq,
        save_grads=a.save_grads,
        threads=a.threads,
        dtype=a.dtype,
        trace=a.trace,
        device=a.device,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
