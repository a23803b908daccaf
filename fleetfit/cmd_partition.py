"""``fleetfit partition plan|simulate|run``: cut one training job across devices.

fleetfit partition plan --workload gpt-byte --cluster partition/clusters/unequal-4.toml
fleetfit partition plan --model llama2-70b --cluster partition/clusters/h100-64.toml
fleetfit partition simulate --workload gpt-tiny --cluster C.toml --out runs/tl
fleetfit partition run --workload gpt-tiny --cluster C.toml --steps 3

With ``--json`` each prints one JSON object on the last line of standard output.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from fleetfit import options as opt
from fleetfit.args import output_dir, output_file
from wire.shape import RunShape

TIMELINE_FILE = "timeline.png"  # what `partition simulate` writes into its --out folder


def register(app: typer.Typer) -> None:
    partition = typer.Typer(
        help="Cut one training job into pipeline stages (and replicas) across a "
        "cluster's devices; simulate the schedule; run it with torchrun.",
        short_help="plan, simulate and run a training job split across devices",
        no_args_is_help=True,
    )
    partition.command(
        "plan",
        help="Print the plan: stages, schedule, predicted step, bubble, peaks. With "
        "--model, the layout of a GPU-scale model on a GPU cluster.",
    )(plan_command)
    partition.command(
        "simulate", help="Plan, then draw the simulated step as a timeline PNG."
    )(simulate_command)
    partition.command("run", help="Plan, then run it with torchrun on this machine.")(
        run_command
    )
    app.add_typer(partition, name="partition")


Cluster = Annotated[
    str,
    typer.Option(
        metavar="FILE",
        help="cluster TOML file, e.g. partition/clusters/unequal-4.toml "
        "(see docs/partition.md)",
        show_default=False,
    ),
]
Schedules = Annotated[
    str,
    typer.Option(
        metavar="A,B,...",
        help="comma-separated schedules to consider (default: all)",
        show_default=False,
        rich_help_panel=opt.TRAINING,
    ),
]
MaxMicrobatches = Annotated[
    int,
    typer.Option(
        min=1, help="most micro-batches per step", rich_help_panel=opt.TRAINING
    ),
]


def plan_command(
    cluster: Cluster,
    workload: opt.Workload = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="instead of --workload, a GPU-scale model for the analytic layout "
            "model: llama2-7b, llama2-13b, llama2-70b, gpt3-175b",
        ),
    ] = None,
    global_batch_tokens: Annotated[
        int,
        typer.Option(min=1, help="with --model: tokens per step (default: 4Mi)"),
    ] = 4 * 2**20,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    schedules: Schedules = "",
    max_microbatches: MaxMicrobatches = 16,
    json: opt.Json = False,
) -> int:
    if model is not None and workload is not None:
        raise ValueError("give --workload or --model, not both")
    if model is not None and (batch is not None or seq is not None):
        raise ValueError(
            "--batch and --seq apply to --workload; with --model the step's size is "
            "--global-batch-tokens"
        )
    return _run(_namespace("plan", locals()))


def simulate_command(
    cluster: Cluster,
    workload: opt.Workload = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    schedules: Schedules = "",
    max_microbatches: MaxMicrobatches = 16,
    out: Annotated[
        str,
        typer.Option(
            metavar="DIR|FILE.png",
            help="folder to write timeline.png into, or a .png path (default: "
            "runs/partition-<timestamp>/)",
            show_default=False,
            rich_help_panel=opt.OUTPUT,
        ),
    ] = "",
    json: opt.Json = False,
) -> int:
    return _run(_namespace("simulate", locals()))


def run_command(
    cluster: Cluster,
    workload: opt.Workload = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    schedules: Schedules = "",
    max_microbatches: MaxMicrobatches = 16,
    steps: Annotated[
        int, typer.Option(min=1, help="training steps", rich_help_panel=opt.TRAINING)
    ] = 3,
    seed: Annotated[
        int, typer.Option(help="seed of the model", rich_help_panel=opt.TRAINING)
    ] = 0,
    timeout: Annotated[
        int, typer.Option(min=1, help="seconds before the run is killed")
    ] = 900,
    out: Annotated[
        str,
        typer.Option(
            metavar="DIR",
            help="folder for the ranks' results (default: a temporary folder)",
            show_default=False,
            rich_help_panel=opt.OUTPUT,
        ),
    ] = "",
    json: opt.Json = False,
) -> int:
    return _run(_namespace("run", locals()))


def _namespace(command: str, given: dict[str, Any]) -> argparse.Namespace:
    args = argparse.Namespace(partition_command=command, **{"model": None, **given})
    if args.model is None and args.workload is None:
        args.workload = RunShape().workload
    return args


def _profile(args: argparse.Namespace) -> Any:
    from memory.chain_profile import profile_workload_fake
    from workloads import get_workload

    wl = get_workload(
        args.workload, batch_size=args.batch or None, seq_len=args.seq or None
    )
    if wl.any_model:  # a transformers causal LM: planned over its units
        from partition.model_stages import require_causal_lm
        from partition.run import profile_any_model

        require_causal_lm(wl)
        return wl, profile_any_model(wl)[1]
    x, y = wl.example_batch()
    return wl, profile_workload_fake(
        wl.factory, x, y, wl.loss_fn, max_microbatches=args.max_microbatches
    )


def _run(args: argparse.Namespace) -> int:
    from partition.cluster import load_cluster

    if args.partition_command == "simulate":
        output_file("--out", args.out, "timeline.png")
    elif args.partition_command == "run" and args.out:
        output_dir("--out", args.out)
    cluster = load_cluster(args.cluster)
    if getattr(args, "model", None):
        from partition.gpu import plan_layout

        lay = plan_layout(args.model, cluster, args.global_batch_tokens)
        print(cluster.name + ": " + f"{cluster.num_devices} GPUs")
        print(lay.table())
        if args.json:
            print(lay.to_json())
        return 0
    from partition.pipeline import SCHEDULES
    from partition.planner import plan_partition
    from partition.plans import PlannerConfig

    schedules = tuple(s for s in args.schedules.split(",") if s) or SCHEDULES
    cfg = PlannerConfig(schedules=schedules, max_microbatches=args.max_microbatches)
    wl, prof = _profile(args)
    plan = plan_partition(prof, cluster, cfg)
    print(cluster.table())
    print()
    print(plan.table())
    result: dict[str, Any] = {"plan": plan.to_dict()}
    cmd = args.partition_command
    if cmd == "plan":
        print()
        from partition.schedule import format

        text = format(plan.schedule).splitlines()
        print("\n".join(text[:40] + (["..."] if len(text) > 40 else [])))
    elif cmd == "simulate":
        path = _timeline(plan, prof, cluster, args.out)
        print(f"timeline: {path}")
        result["timeline"] = str(path)
    elif cmd == "run":
        if plan.schedule_name == "local":
            print(
                "the plan uses one device: run it with `fleetfit memory run`",
                file=sys.stderr,
            )
            return 2
        from partition.runtime import launch

        out = args.out or tempfile.mkdtemp(prefix="fleetfit-partition-")
        res = launch(
            plan,
            args.workload,
            out,
            steps=args.steps,
            seed=args.seed,
            batch_size=args.batch or None,
            seq_len=args.seq or None,
            timeout_s=args.timeout,
        )
        print(
            f"losses {' '.join(f'{v:.4f}' for v in res['losses'])}; step "
            f"{res['step_s']:.4f} s measured vs {plan.predicted_step_s:.4f} s predicted"
        )
        result.update(
            losses=res["losses"],
            step_s=res["step_s"],
            out=out,
            predicted_step_s=plan.predicted_step_s,
        )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    del wl
    return 0


def _timeline(plan: Any, prof: Any, cluster: Any, out: str) -> Path:
    """Write the timeline PNG: ``out`` itself when it ends in ``.png``, else
    ``timeline.png`` in folder ``out`` (default: ``runs/partition-<timestamp>``)."""
    from partition.evaluate import simulate_plan
    from partition.simulate import timeline_png

    if plan.schedule_name == "local":
        raise ValueError(
            "the plan uses one device (no pipeline to draw); see `fleetfit memory plan`"
        )
    if out.lower().endswith(".png"):
        path = Path(out)
    else:
        folder = Path(out or time.strftime("runs/partition-%Y%m%d-%H%M%S"))
        path = folder / TIMELINE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    res = simulate_plan(plan, prof, cluster)
    timeline_png(res, path, title=f"{plan.schedule_name} on {cluster.name}")
    return path.resolve()
