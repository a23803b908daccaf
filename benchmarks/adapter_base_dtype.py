"""The frozen base of an adapter assignment in float32, bfloat16 and int8: predicted
and measured peak, step time and loss, side by side in one run.

For each base dtype the server's assigner (``server.assign.Assigner``, adapters on
every layer, rank 8, the server's default runtime reserve) plans an adapter
assignment for a roomy budget and for the smallest budget that trains any adapter; each plan trains a few steps in a measured
child (``memory.measure``: peak RSS above the import baseline, the model's loading
included) on the same batches.

    .venv/bin/python benchmarks/adapter_base_dtype.py                 # gpt-byte, ~1 min
    .venv/bin/python benchmarks/adapter_base_dtype.py --workload gpt2-small --steps 2
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from client.train import draw_batches, train_assigned  # noqa: E402
from memory.lora import BASE_DTYPES, LoraSpec  # noqa: E402
from memory.sizes import format_bytes, parse_bytes  # noqa: E402
from server.assign import Assigner  # noqa: E402
from wire.facts import NodeFacts  # noqa: E402
from wire.shape import RUNTIME_RESERVE  # noqa: E402
from workloads import get_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpt-byte")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--roomy", default="8GiB", help="the roomy budget")
    args = ap.parse_args()
    wl = get_workload(args.workload)
    model = wl.make_model(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches, n, seed = draw_batches(
        wl,
        0,
        2,
        split="iid",
        alpha=0.5,
        seed=0,
        server_round=1,
        local_steps=args.steps,
    )
    print(
        f"# {args.workload}, adapters rank {args.rank} on every layer, "
        f"{args.steps} steps; {platform.node()} {platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        "| base | budget | plan | predicted | measured | measured/predicted "
        "| step s | mean loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for dtype in BASE_DTYPES:
        a = Assigner(
            wl,
            model,
            local_steps=args.steps,
            runtime_reserve_bytes=parse_bytes(RUNTIME_RESERVE),
            train_time_s=1e9,
            adapters="all",
            lora=LoraSpec(rank=args.rank, alpha=2.0 * args.rank, base_dtype=dtype),
        )
        for label, budget in (
            ("roomy", parse_bytes(args.roomy)),
            ("smallest", a.adapter_min_budget()),
        ):
            asg = a.assign(NodeFacts(budget_bytes=budget, disk_budget_bytes=0), 1)
            assert asg.kind == "adapter" and asg.plan is not None, asg
            t0 = time.perf_counter()
            r = train_assigned(
                state,
                wl,
                batches,
                num_examples=n,
                torch_seed=seed,
                plan=asg.plan,
                window=None,
                lr=1e-3,
                measure="child",
                adapters=asg.adapters,
            )
            wall = time.perf_counter() - t0
            acts = {b.activations for b in asg.plan.blocks}
            print(
                f"| {dtype} | {label} {format_bytes(budget)} | "
                f"{'/'.join(sorted(acts))}, {asg.plan.num_microbatches} mb | "
                f"{format_bytes(asg.predicted_peak_bytes)} | "
                f"{format_bytes(r.peak_bytes)} | "
                f"{r.peak_bytes / asg.predicted_peak_bytes:.3f} | "
                f"{wall / args.steps:.2f} | {r.mean_loss:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
