"""``fleetfit partition plan|simulate|run``: cut one training job across devices.

fleetfit partition plan --workload gpt-byte --cluster partition/clusters/unequal-4.toml
fleetfit partition plan --model llama2-70b --cluster partition/clusters/h100-64.toml
fleetfit partition plan --config config.json --seq 8192 --gpu h100-80 --num-gpus 64
fleetfit partition plan --model llama3-70b --gpu a100-80 --num-gpus 64 --pp 1 --tp 8
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


PlanCluster = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        metavar="FILE",
        help="cluster TOML file, e.g. partition/clusters/unequal-4.toml (see "
        "docs/partition.md); for a GPU model, or --gpu and --num-gpus",
        show_default=False,
    ),
]

_MODEL_NUMBERS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
_LAYOUT = ("dp", "pp", "tp", "virtual_stages", "micro_batch", "recompute", "sharding")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def plan_command(
    cluster: PlanCluster = None,
    workload: opt.Workload = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="instead of --workload, a GPU-scale model for the analytic layout "
            "model: llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b, "
            "llama3-405b, gpt3-175b",
            rich_help_panel=opt.GPU_MODEL,
        ),
    ] = None,
    config: opt.ModelConfig = None,
    layers: opt.Layers = None,
    hidden: opt.Hidden = None,
    heads: opt.Heads = None,
    kv_heads: opt.KvHeads = None,
    ffn: opt.Ffn = None,
    vocab: opt.Vocab = None,
    tied: opt.Tied = None,
    gpu: opt.GpuName = None,
    num_gpus: opt.NumGpus = None,
    dp: opt.Dp = None,
    pp: opt.Pp = None,
    tp: opt.Tp = None,
    virtual_stages: opt.VirtualStages = None,
    micro_batch: opt.MicroBatch = None,
    recompute: opt.Recompute = None,
    sharding: opt.Sharding = None,
    global_batch_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="GPU models: tokens per step, a multiple of the sequence length "
            "(default: 4Mi)",
            rich_help_panel=opt.GPU_MODEL,
        ),
    ] = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    schedules: Schedules = "",
    max_microbatches: MaxMicrobatches = 16,
    json: opt.Json = False,
) -> int:
    given = locals()
    numbers = [k for k in _MODEL_NUMBERS if given[k] is not None]
    described = [
        x
        for x, on in (
            ("--model", model),
            ("--config", config),
            ("--layers ...", numbers),
        )
        if on
    ]
    gpu_only = [
        _flag(k)
        for k in (*_LAYOUT, "gpu", "num_gpus", "global_batch_tokens")
        if given[k] is not None
    ] + (["--tied"] if tied is not None else [])
    if not described:
        if gpu_only:
            raise ValueError(
                f"{', '.join(gpu_only)} apply to a GPU model; describe it with "
                "--model, --config or --layers/--hidden/... (or drop them)"
            )
        if cluster is None:
            raise ValueError("give --cluster FILE for the devices to plan across")
        return _run(_namespace("plan", given))
    if workload is not None:
        raise ValueError(f"give --workload or {described[0]}, not both")
    if len(described) > 1:
        raise ValueError(f"give one of {', '.join(described)} to describe the model")
    if batch is not None:
        raise ValueError(
            "--batch applies to --workload; a GPU model's step is --global-batch-tokens"
        )
    if schedules or max_microbatches != 16:
        raise ValueError(
            "--schedules and --max-microbatches apply to --workload; for a GPU model "
            "give --virtual-stages and --micro-batch"
        )
    return _plan_gpu(**given)


def _plan_gpu(**a: Any) -> int:
    from partition.cluster import load_cluster
    from partition.gpu import (
        MODELS,
        GpuSystem,
        TransformerSpec,
        evaluate_given,
        plan_layout,
    )

    if a["model"] is not None:
        if a["model"] not in MODELS:
            raise ValueError(
                f"unknown model {a['model']!r}; give one of {', '.join(MODELS)}, or "
                "--config FILE, or --layers/--hidden/..."
            )
        spec = MODELS[a["model"]].with_seq(a["seq"])
    elif a["config"] is not None:
        spec = TransformerSpec.from_config(a["config"], a["seq"])
    else:
        missing = [
            _flag(k)
            for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq")
            if a[k] is None
        ]
        if missing:
            raise ValueError(
                f"an explicit model needs {', '.join(missing)} as well (or give "
                "--config FILE)"
            )
        spec = TransformerSpec(
            "model",
            a["layers"],
            a["hidden"],
            a["ffn"],
            a["heads"],
            a["kv_heads"] or a["heads"],
            a["vocab"],
            a["seq"],
            True,
            bool(a["tied"]),
        )
    if a["config"] is not None or a["model"] is not None:
        overrides = {k: a[k] for k in _MODEL_NUMBERS if a[k] is not None}
        if a["tied"] is not None:
            overrides["tied"] = a["tied"]
        if overrides:
            renamed = {
                "layers": "num_layers",
                "heads": "num_heads",
                "kv_heads": "num_kv_heads",
            }
            fields = {renamed.get(k, k): v for k, v in overrides.items()}
            spec = TransformerSpec(**{**spec.__dict__, **fields})
    if a["cluster"] is not None:
        if a["gpu"] is not None or a["num_gpus"] is not None:
            raise ValueError("give --cluster FILE or --gpu and --num-gpus, not both")
        system: Any = GpuSystem.from_cluster(load_cluster(a["cluster"]))
    elif a["gpu"] is None or a["num_gpus"] is None:
        raise ValueError(
            "give the GPUs: --gpu TYPE and --num-gpus N (e.g. --gpu h100-80 "
            "--num-gpus 64), or --cluster FILE"
        )
    else:
        system = GpuSystem.of(a["gpu"], a["num_gpus"])
    tokens = a["global_batch_tokens"] or 4 * 2**20
    layout = [k for k in _LAYOUT if a[k] is not None]
    if layout:
        if a["pp"] is None or a["tp"] is None:
            raise ValueError(
                "a given layout needs --pp and --tp (--dp defaults to the rest of "
                "the GPUs)"
            )
        n = system.num_gpus
        if a["dp"] is None and n % (a["pp"] * a["tp"]):
            raise ValueError(
                f"pp {a['pp']} x tp {a['tp']} does not divide the {n} GPUs; give "
                "degrees whose product divides the GPU count"
            )
        v = a["virtual_stages"] or 1
        if v > spec.num_layers:
            raise ValueError(
                f"--virtual-stages {v} exceeds the {spec.num_layers} layers; give "
                "at most the layer count"
            )
        lay = evaluate_given(
            spec,
            system,
            tokens,
            dp=a["dp"] or n // (a["pp"] * a["tp"]),
            pp=a["pp"],
            tp=a["tp"],
            microbatch_size=a["micro_batch"] or 1,
            recompute=a["recompute"] or "selective",
            sharding=a["sharding"] or "fsdp",
            stages_per_rank=v,
        )
    else:
        lay = plan_layout(spec, system, tokens)
    print(f"{system.name}: {system.num_gpus} GPUs, {system.gpu.rate_table()}")
    print(lay.table())
    if a["json"]:
        print(lay.to_json())
    return 0 if lay.fits else 1


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
    device: Annotated[
        str,
        typer.Option(help="cpu (gloo) or cuda (NCCL, one GPU per process)"),
    ] = "cpu",
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
    elif args.partition_command == "run":
        if args.out:
            output_dir("--out", args.out)
        from partition.runtime import check_device

        try:
            check_device(args.device)
        except ValueError as e:
            raise ValueError(f"--device {e}") from None
    cluster = load_cluster(args.cluster)
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
            device=args.device,
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
