"""Unequal devices: the planned pipeline against torch's even split, on a namespace fleet.

Four hosts made as network namespaces on this machine (partition/netns.py): two fast
ones with little memory, two slow ones with more, each link shaped to 20 MB/s with tbf,
speed set by CFS CPU quotas (cgroups, one thread per rank). A 12-block GPT (embed, 10
layers, head) is planned with fleetfit's planner and, side by side, cut evenly into 4
stages (3 blocks each: what torch's ``pipeline`` examples do for equal layers) under
1F1B. Both run with torch.distributed.pipelining; the table shows measured and
simulated step times.

Each host's speed is probed, not taken from its quota: the same whole-model forward
and backward runs on all four hosts at once (in their namespaces and cgroups), and a
host's speed is the profile's time for it over the time measured there (a CFS quota of
0.15 delivers 0.08-0.14 of a core here). ``--nominal`` plans with the quotas instead.
Per rank, the runs report CPU seconds per step (user and kernel) and by thread.

Run as root from the repository root:

    .venv/bin/python benchmarks/partition_unequal.py            # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/partition_unequal.py --steps 8 --fast 0.45 --slow 0.15

Without root or ``ip netns`` it prints why and exits 0 (nothing is changed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from memory.blocks import as_blocks  # noqa: E402
from memory.chain_profile import profile_blocks  # noqa: E402
from memory.profile import Profile  # noqa: E402
from workloads.models import GPT, GPTConfig  # noqa: E402

WORKLOAD = "benchmarks.partition_unequal:workload"
UNIT = 1e10  # FLOP/s of one full core in the profile's time base (a label, not a claim)
CFG = GPTConfig(vocab_size=256, context=64, d_model=192, num_layers=10, num_heads=4)
BATCH, SEQ = 16, 64  # examples, tokens


def workload() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """The benchmark's model: a 12-block GPT, batch 16 x 64 tokens (fixed batch)."""
    model = GPT(CFG)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(CFG.vocab_size, (BATCH, SEQ + 1), generator=g)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, (toks[:, :-1].contiguous(), toks[:, 1:].contiguous()), loss


def tiny() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A model with next to no compute: what a pipeline step costs besides blocks."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 8, generator=g), torch.randn(32, 8, generator=g))
    return model, batch, F.mse_loss


def probe_overhead(steps: int = 6) -> float:
    """Seconds of runtime work per stage action (one thread, full speed, loopback):
    2 ranks, GPipe, 32 micro-batches of a model with next to no compute."""
    from partition.cluster import Cluster
    from partition.evaluate import fixed_plan
    from partition.runtime import launch

    model, (x, y), loss = tiny()
    prof = profile_blocks(
        as_blocks(model), x, y, loss, measure_time=False, max_microbatches=32
    )
    c = Cluster.uniform(2, memory="1GB", compute=UNIT)
    m = 32
    plan = fixed_plan(prof, c, [["0"], ["1"]], schedule="GPipe", num_microbatches=m)
    with tempfile.TemporaryDirectory(prefix="fleetfit-probe-") as tmp:
        res = launch(plan, "benchmarks.partition_unequal:tiny", tmp, steps=steps)
    # each rank runs 2m actions back to back, plus one action's worth of fill
    return res["step_s"] / (2 * m + 1)


def _time_blocks(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss,
    q: int,
    reps: int = 5,
) -> list[tuple[float, float]]:
    """Forward and backward seconds per block at micro-batch size BATCH/q, 1 thread."""
    blocks = as_blocks(model)
    xs = x[: BATCH // q]
    ys = y[: BATCH // q]
    out = []
    h = xs
    for i, b in enumerate(blocks):
        fw, bw = [], []
        for r in range(reps + 2):
            inp = h.detach()
            if inp.is_floating_point():
                inp.requires_grad_(True)
            t0 = time.perf_counter()
            o = b.module(inp)
            if i == len(blocks) - 1:
                o = loss(o, ys)
            t1 = time.perf_counter()
            o.backward(None if o.dim() == 0 else torch.ones_like(o))
            t2 = time.perf_counter()
            if r >= 2:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
            model.zero_grad(set_to_none=True)
        out.append((min(fw), min(bw)))  # other processes only ever add time
        with torch.no_grad():
            h = b.module(h)
    return out


def probe(q: int = 4, reps: int = 8, seconds: float = 0.0) -> dict[str, float]:
    """What this process delivers, one thread: the whole model's forward and backward
    at micro-batch size BATCH/q, and one AdamW update of all its parameters (min of
    ``reps``, or of as many as fit in ``seconds``, at least 3). Run on every host at
    once (``Fleet.run_on_all``) and outside any quota, the ratio is each host's real
    share of a core."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, (x, y), loss = workload()
    xs, ys = x[: BATCH // q], y[: BATCH // q]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    chain, update = [], []
    end = time.perf_counter() + seconds
    r = 0
    while r <= reps if not seconds else (r <= 3 or time.perf_counter() < end):
        r += 1
        t0 = time.perf_counter()
        loss(model(xs), ys).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if r > 1:  # the first builds the optimizer state
            chain.append(t1 - t0)
            update.append(t2 - t1)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"chain_s": min(chain), "update_s": min(update), "param_bytes": nbytes}


def _probe_argv() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--probe"]


def profile(max_microbatches: int) -> Profile:
    """Bytes from memory.profile (fake tensors); times measured here per micro-batch
    size, one thread, in the UNIT time base."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, (x, y), loss = workload()
    prof = profile_blocks(
        as_blocks(model),
        x,
        y,
        loss,
        measure_time=False,
        max_microbatches=max_microbatches,
    )
    blocks = list(prof.blocks)
    for q in prof.microbatch_options:
        times = _time_blocks(model, x, y, loss, q)
        for i, (f, b) in enumerate(times):
            c = replace(
                blocks[i].costs[q], forward_s=f, backward_s=b, time_source="measured"
            )
            blocks[i] = replace(blocks[i], costs={**blocks[i].costs, q: c})
    return replace(prof, blocks=tuple(blocks), flops_per_s=UNIT, time_source="measured")


def scaled(prof: Profile, factor: float) -> Profile:
    """``prof`` with every block's forward and backward seconds times ``factor``."""
    blocks = tuple(
        replace(
            b,
            costs={
                q: replace(
                    c, forward_s=c.forward_s * factor, backward_s=c.backward_s * factor
                )
                for q, c in b.costs.items()
            },
        )
        for b in prof.blocks
    )
    return replace(prof, blocks=blocks)


def runtime_factor(prof: Profile, cfg) -> tuple[float, float, float]:
    """What blocks cost inside the pipelining runtime against the same blocks timed in
    a loop: the model cut in 2 equal stages, 1F1B, 8 micro-batches, two ranks at full
    speed on loopback (one thread each), measured; then the factor on the blocks'
    times that makes the simulated step equal the measured one. Returns (factor,
    measured s, simulated s before calibration)."""
    from partition.cluster import Cluster
    from partition.evaluate import even_split, fixed_plan
    from partition.runtime import launch

    names = [b.name for b in prof.blocks]
    c = Cluster.uniform(2, memory="10GB", compute=UNIT)

    def sim(p: Profile) -> float:
        plan = fixed_plan(
            p, c, even_split(names, 2), schedule="1F1B", num_microbatches=8, config=cfg
        )
        return plan.predicted_step_s

    plan = fixed_plan(
        prof, c, even_split(names, 2), schedule="1F1B", num_microbatches=8, config=cfg
    )
    with tempfile.TemporaryDirectory(prefix="fleetfit-cal-") as tmp:
        measured = launch(plan, WORKLOAD, tmp, steps=6)["step_s"]
    first = sim(prof)
    factor = 1.0
    for _ in range(4):  # the step is nearly linear in the blocks' times
        factor *= measured / sim(scaled(prof, factor))
    return factor, measured, first


def action_table(plan, res: list[dict], speed: dict[str, float]) -> str:
    """Per rank, the measured forward and backward actions (median wall ms, median CPU
    ms) against the simulator's, and how the step splits into compute and waiting."""
    lines = [
        f"{'rank':>4}  {'device':<8}{'F ms sim':>9}{'F wall':>8}{'F cpu':>7}"
        f"{'B ms sim':>9}{'B wall':>8}{'B cpu':>7}{'busy s':>8}{'wait s':>8}"
    ]
    import statistics as st_

    for r in res[: plan.num_ranks]:
        mine = [s for s in plan.stages if s.rank == r["rank"]]
        steps = r["trace"][1:] or r["trace"]
        acts = [a for t in steps for a in t if a[0] in "FB"]
        f = [a for a in acts if a[0] == "F"]
        b = [a for a in acts if a[0] == "B"]
        busy = st_.median(sum(a[4] - a[3] for a in t if a[0] in "FB") for t in steps)
        step = st_.median(t[-1][4] for t in steps)
        lines.append(
            f"{r['rank']:>4}  {mine[0].devices[0]:<8}"
            f"{sum(s.forward_s for s in mine) * 1e3:>9.1f}"
            f"{st_.median(a[4] - a[3] for a in f) * 1e3:>8.1f}"
            f"{st_.median(a[5] for a in f) * 1e3:>7.1f}"
            f"{sum(s.backward_s for s in mine) * 1e3:>9.1f}"
            f"{st_.median(a[4] - a[3] for a in b) * 1e3:>8.1f}"
            f"{st_.median(a[5] for a in b) * 1e3:>7.1f}"
            f"{busy:>8.3f}{step - busy:>8.3f}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per run (default: 6)")
    ap.add_argument("--fast", type=float, default=0.45, help="fast hosts' core share")
    ap.add_argument("--slow", type=float, default=0.15, help="slow hosts' core share")
    ap.add_argument("--bandwidth", default="20MB/s", help="every host's link rate")
    ap.add_argument(
        "--fast-memory",
        default="",
        help="fast hosts' memory (default: what the even split needs at m=8, +10%%)",
    )
    ap.add_argument("--slow-memory", default="400MB", help="slow hosts' memory")
    ap.add_argument(
        "--nominal",
        action="store_true",
        help="plan with the quotas as given, not with each host's probed speed",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="scale the blocks' times by what a 2-rank full-speed run measures "
        "(a diagnostic: it over-predicts the fleet, see docs/partition.md)",
    )
    ap.add_argument(
        "--quota-model",
        action="store_true",
        help="plan with the hosts' CPU quotas (cpu_limit: full speed in bursts) and "
        "the runtime's send semantics (sends='rendezvous'); by default hosts compute "
        "at their probed sustained rate and tensors move as soon as they are made",
    )
    ap.add_argument(
        "--trace-out", default="", help="write every rank's action trace here (JSON)"
    )
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:  # run by the benchmark itself, on each host
        print(json.dumps(probe(seconds=args.probe_seconds)))
        return 0

    from memory.sizes import format_bytes, parse_bytes
    from partition import netns
    from partition.cluster import Cluster, parse_bandwidth
    from partition.evaluate import even_split, fixed_plan, simulate_plan
    from partition.planner import plan_partition
    from partition.plans import PlannerConfig

    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
        f"{torch.__version__}"
    )
    why = netns.available()
    if why:
        print(f"skipped: the namespace fleet cannot run here: {why}")
        return 0
    overhead = probe_overhead()
    print(
        f"runtime overhead per stage action (probe, full core): {overhead * 1e3:.2f} ms"
    )
    # each host's real speed: the same probe on every host (its namespace and quota)
    # and outside any quota; a CFS quota delivers a little less than its share
    names4 = [f"fast{i}" for i in range(2)] + [f"slow{i}" for i in range(2)]
    shares4 = [args.fast] * 2 + [args.slow] * 2

    def outside() -> dict[str, float]:
        r = subprocess.run(_probe_argv(), capture_output=True, text=True, check=True)
        return json.loads(r.stdout.splitlines()[-1])

    # Per-block times at full speed (one thread), then the same whole-model probe on
    # every host at once: a host's speed is the profile's time for the model over
    # the time measured there, so the two are tied even when the machine drifts.
    prof = profile(max_microbatches=16)
    prof_chain = sum(b.costs[4].forward_s + b.costs[4].backward_s for b in prof.blocks)
    full = outside()
    specs = [
        netns.HostSpec(n, sh, parse_bandwidth(args.bandwidth))
        for n, sh in zip(names4, shares4)
    ]
    host_chain: dict[str, float] = {}
    with netns.Fleet(specs) as fleet:
        outs = fleet.run_on_all(_probe_argv() + ["--probe-seconds", "8"])
        for n, out in zip(names4, outs):
            host_chain[n] = json.loads(out.splitlines()[-1])["chain_s"]
    real = {n: prof_chain / t for n, t in host_chain.items()}
    print(
        f"probe (whole model fwd+bwd, micro-batch {BATCH // 4}, one thread): "
        f"{prof_chain * 1e3:.1f} ms by the profile, {full['chain_s'] * 1e3:.1f} ms "
        f"in a probe outside any quota; AdamW update {full['update_s'] * 1e3:.1f} ms"
    )
    print(f"{'host':<8}{'quota':>8}{'probe ms':>10}{'speed (x profile)':>19}")
    for n, sh in zip(names4, shares4):
        print(f"{n:<8}{sh:>8.2f}{host_chain[n] * 1e3:>10.1f}{real[n]:>19.3f}")
    speed = {n: (sh if args.nominal else real[n]) for n, sh in zip(names4, shares4)}
    to_profile = prof_chain / full["chain_s"]  # the probe's time base -> the profile's
    cfg = PlannerConfig(
        max_microbatches=16,
        schedules=("GPipe", "1F1B", "Interleaved1F1B"),
        action_overhead_s=overhead,
        update_s_per_byte=full["update_s"] * to_profile / full["param_bytes"],
        sends="rendezvous" if args.quota_model else "eager",
    )
    names = [b.name for b in prof.blocks]
    bw = parse_bandwidth(args.bandwidth)
    if args.calibrate:
        factor, cal_meas, cal_sim = runtime_factor(prof, cfg)
        prof = scaled(prof, factor)
        print(
            f"runtime calibration (2 ranks, full speed, loopback, 1F1B, m=8): measured "
            f"{cal_meas:.3f} s, simulated {cal_sim:.3f} s from blocks timed in a loop: "
            f"blocks' times x {factor:.2f} in the runtime"
        )

    def cluster(fast_mem: int, quotas: bool = args.quota_model) -> Cluster:
        def q(share: float) -> dict:
            if not quotas:
                return {}
            return {"cpu_limit": share, "cpu_period": netns.PERIOD_US * 1e-6}

        hosts = [
            {
                "name": f"fast{i}",
                "memory": fast_mem,
                "compute": speed[f"fast{i}"] * UNIT,
                **q(args.fast),
            }
            for i in range(2)
        ] + [
            {
                "name": f"slow{i}",
                "memory": args.slow_memory,
                "compute": speed[f"slow{i}"] * UNIT,
                **q(args.slow),
            }
            for i in range(2)
        ]
        return Cluster.from_dict(
            {
                "name": "unequal-4",
                "network": {"bandwidth": bw, "latency": "0.1ms"},
                "hosts": hosts,
            }
        )

    # The fast hosts' memory: 110% of what the even split's fast stages need at 8
    # micro-batches (fixed, so the setup does not move with the measured speeds).
    # Then torch's even split (4 equal stages in host order, 1F1B) at its best
    # micro-batch count among those that fit, and fleetfit's plan, on that cluster.
    big = cluster(parse_bytes("10GB"))
    at8 = fixed_plan(
        prof,
        big,
        even_split(names, 4),
        schedule="1F1B",
        num_microbatches=8,
        config=cfg,
    )
    need = max(s.peak_bytes for s in at8.stages[:2])
    fast_mem = parse_bytes(args.fast_memory) if args.fast_memory else int(need * 1.1)
    c = cluster(fast_mem)
    evens = [
        fixed_plan(
            prof,
            c,
            even_split(names, 4),
            schedule="1F1B",
            num_microbatches=m,
            config=cfg,
        )
        for m in (4, 8, 16)
    ]
    fits = [e for e in evens if all(s.peak_bytes <= s.memory_bytes for s in e.stages)]
    if not fits:
        print(f"the even split does not fit in {format_bytes(fast_mem)} at any m")
        return 1
    even = min(fits, key=lambda p: p.predicted_step_s)
    planned = plan_partition(prof, c, cfg)
    print(c.table())
    print(
        f"\nfast hosts' memory: {format_bytes(fast_mem)} (the even split's fast stages "
        f"need {format_bytes(need)})\n"
    )
    print("planned:\n" + planned.table() + "\n")
    print("even split:\n" + even.table() + "\n")

    rows = []
    traces: list[dict] = []
    for label, plan in (("even split (torch)", even), ("fleetfit plan", planned)):
        order = [
            plan.stages[r].devices[g]
            for g in range(plan.num_replicas)
            for r in range(plan.num_ranks)
        ]
        hosts = [
            netns.HostSpec(n, args.fast if n.startswith("fast") else args.slow, bw)
            for n in order
        ]
        with tempfile.TemporaryDirectory(prefix="fleetfit-bench-") as tmp:
            pf = Path(tmp) / "plan.json"
            pf.write_text(plan.to_json())
            with netns.Fleet(hosts) as fleet:
                res = fleet.run_ranks(
                    pf, WORKLOAD, tmp, steps=args.steps, extra=["--trace"]
                )
        step = max(r["step_s"] for r in res)
        rows.append((label, plan, step, res[0]["losses"]))
        print(f"{label}, per rank (one replica):")
        print(
            f"{'rank':>4}  {'device':<8}{'busy pred s':>12}{'cpu meas s':>12}{'sys s':>8}{'step s':>9}"
        )
        for r in res[: plan.num_ranks]:
            mine = [st for st in plan.stages if st.rank == r["rank"]]
            busy = sum(
                plan.num_microbatches * (st.forward_s + st.backward_s) for st in mine
            )
            print(
                f"{r['rank']:>4}  {mine[0].devices[0]:<8}{busy:>12.3f}"
                f"{r['cpu_s']:>12.3f}{r['cpu_sys_s']:>8.3f}{r['step_s']:>9.3f}  "
                + ", ".join(
                    f"{k} {v:.1f}"
                    for k, v in sorted(
                        r["thread_cpu_s"].items(), key=lambda kv: -kv[1]
                    )[:4]
                )
            )
        print(action_table(plan, res, speed))
        sim = simulate_plan(plan, prof, c, cfg)
        traces.append(
            {
                "run": label,
                "plan": plan.to_dict(),
                "ranks": res,
                "simulated": [
                    [e.rank, e.kind, e.microbatch, e.start_s, e.end_s]
                    for e in sim.events
                ],
            }
        )
        print()
    if args.trace_out:
        Path(args.trace_out).write_text(
            json.dumps(
                {
                    "speed": speed,
                    "fast_memory": fast_mem,
                    "profile": prof.to_dict(),
                    "config": {
                        "action_overhead_s": cfg.action_overhead_s,
                        "update_s_per_byte": cfg.update_s_per_byte,
                    },
                    "runs": traces,
                }
            )
        )
    # the other model's figure for the same plan, side by side
    other_c = cluster(fast_mem, quotas=not args.quota_model)
    other_cfg = replace(cfg, sends="eager" if args.quota_model else "rendezvous")
    other = "fluid" if args.quota_model else "quota"
    print(
        f"{'run':<20}{'stages (blocks)':<22}{'sched':<10}{'m':>3}{'measured s':>12}"
        f"{'simulated s':>13}{'error':>8}{other + ' s':>9}{'error':>8}{'examples/s':>12}"
    )
    for label, plan, step, _ in rows:
        split = "+".join(str(len(s.blocks)) for s in plan.stages)
        if plan.num_replicas > 1:
            split += f" x{plan.num_replicas}"
        err = (plan.predicted_step_s - step) / step
        alt = simulate_plan(plan, prof, other_c, other_cfg).step_s
        print(
            f"{label:<20}{split:<22}{plan.schedule_name:<10}{plan.num_microbatches:>3}"
            f"{step:>12.3f}{plan.predicted_step_s:>13.3f}{err:>+8.1%}"
            f"{alt:>9.3f}{(alt - step) / step:>+8.1%}"
            f"{plan.batch_size / step:>12.2f}"
        )
    speedup = rows[0][2] / rows[1][2]
    print(f"\nthroughput, planned / even: {speedup:.2f}x (target >= 1.3x)")
    print(
        "losses equal across runs: "
        + str(all(abs(a - b) < 1e-4 for a, b in zip(rows[0][3], rows[1][3])))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
