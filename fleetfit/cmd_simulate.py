"""``fleetfit simulate``: a federation on Flower's simulation engine.

fleetfit simulate                                    # digits CNN, 10 clients, 5 rounds
fleetfit simulate --fleet phones --strategy exclude  # one strategy on a fleet file
fleetfit simulate --fleet edge --compare fleetfit,exclude,smallest-model --out runs/e
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Annotated, Any

import typer

from fleetfit import options as opt
from fleetfit.args import output_dir, positive_float
from simulations.run import SimulationSettings, check_ray_address
from wire.shape import RunShape

_SHAPE = RunShape()  # the defaults: the run config's, one source
_SIM = SimulationSettings()

# flag -> the run-config setting it gives (a RunShape field, else SimulationSettings')
SHAPE_FLAGS = {
    "workload": "workload",
    "local_steps": "local_steps",
    "lr": "lr",
    "seed": "seed",
    "split": "split",
    "alpha": "dirichlet_alpha",
    "batch": "batch_size",
    "seq": "seq_len",
}
RUN_FLAGS = {
    "clients": "num_clients",
    "rounds": "num_server_rounds",
    "fraction": "fraction_train",
}


def given(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, Any]:
    """The settings of the flags the user gave (a flag not given is ``None``), by
    field name: what is not given keeps its dataclass's default."""
    return {
        name: getattr(args, flag)
        for flag, name in flags.items()
        if getattr(args, flag) is not None
    }


def register(app: typer.Typer) -> None:
    app.command(
        "simulate",
        help="Simulate a federation locally (Flower's simulation engine on Ray), print "
        "a per-round table and write a run folder.",
        short_help="simulate a federation on Flower's simulation engine",
    )(simulate_command)


def simulate_command(
    workload: opt.Workload = None,
    fleet: Annotated[
        str | None,
        typer.Option(
            metavar="FILE|NAME",
            help="a fleet file (TOML) or a shipped fleet: phones, sbc, edge; it sets "
            "the workload, devices, budgets and split (the options given override it)",
            rich_help_panel="Fleet",
        ),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(
            metavar="NAME",
            help="with --fleet: fleetfit, exclude, smallest-model, heterofl, fedrolex, "
            "fleetfit-adapter (LoRA where no whole-model plan fits) or adapters (LoRA "
            "on every device) (default: fleetfit)",
            rich_help_panel="Fleet",
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            metavar="A,B,...",
            help="with --fleet: strategies to run side by side, e.g. "
            "fleetfit,exclude,smallest-model,heterofl,fedrolex (a run folder each "
            "under --out)",
            rich_help_panel="Fleet",
        ),
    ] = None,
    target: Annotated[
        float | None,
        typer.Option(
            parser=opt.checked(positive_float),
            metavar="METRIC",
            help="with --compare: the metric for 'rounds to target' (default: the "
            "worst final metric among the strategies)",
            rich_help_panel="Fleet",
        ),
    ] = None,
    clients: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"virtual clients (default: {_SIM.num_clients}, or the fleet's)",
            rich_help_panel=opt.TRAINING,
        ),
    ] = None,
    rounds: opt.Rounds = None,
    local_steps: opt.LocalSteps = None,
    lr: opt.Lr = None,
    fraction: opt.Fraction = None,
    seed: opt.Seed = None,
    split: opt.Split = None,
    alpha: opt.Alpha = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    ray_address: Annotated[
        str,
        typer.Option(
            metavar="auto|HOST:PORT",
            help="run on an existing Ray cluster (auto, or HEAD:6379) instead of a "
            "local Ray (see docs/simulations.md) (default: a local Ray)",
            show_default=False,
        ),
    ] = "",
    progress: opt.Progress = True,
    out: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="run folder (default: runs/simulate-<timestamp>, with --fleet "
            "runs/<fleet>-<timestamp>)",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = None,
) -> int:
    """The fleet's values are the defaults of a ``--fleet`` run; an option given
    overrides them."""
    args = argparse.Namespace(**locals())
    args.no_progress = not progress
    return run(args)


def run(args: argparse.Namespace) -> int:
    # A Ray cluster that is not there fails now, not after minutes of retries.
    check_ray_address(args.ray_address)
    if args.fleet is not None:
        return run_fleet(args)
    for flag in ("strategy", "compare", "target"):
        if getattr(args, flag) is not None:
            raise ValueError(
                f"--{flag} needs --fleet: give a fleet file or one of phones, sbc, edge"
            )
    from simulations.run import simulate

    out = args.out or os.path.join("runs", time.strftime("simulate-%Y%m%d-%H%M%S"))
    settings = SimulationSettings(
        shape=RunShape(**given(args, SHAPE_FLAGS)),
        **given(args, RUN_FLAGS),
        out=out,
        progress=not args.no_progress,
        ray_address=args.ray_address,
    )
    settings.validate()  # bad input fails here, before Ray starts
    output_dir("--out", out)
    print(
        f"fleetfit simulate: {settings.shape.workload}, {settings.num_clients} clients, "
        f"{settings.num_server_rounds} rounds -> {out}",
        file=sys.stderr,
    )
    from fleetfit.cli import stop_on_signals

    stop_on_signals()  # Ctrl-C and SIGTERM stop Ray and exit
    summary = simulate(settings)
    print(format_rounds(summary))
    print(f"\nrun folder: {out}")
    from server.loop import no_update_reason

    failure = no_update_reason(summary)  # a run that trained nothing is no success
    if failure:
        print(f"fleetfit simulate: {failure}; see {out}", file=sys.stderr)
        return 1
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    """``--fleet``: one strategy, or ``--compare`` several, on a fleet file."""
    from simulations.compare import (
        check_strategies,
        compare,
        run_strategy,
        settings_for,
        smallest_model,
    )
    from simulations.fleet import load_fleet

    if args.strategy is not None and args.compare is not None:
        raise ValueError("give --strategy or --compare, not both")
    for flag in ("workload", "split"):
        if getattr(args, flag) is not None:
            raise ValueError(
                f"--{flag} comes from the fleet file with --fleet: edit the file's "
                f"{flag} field instead"
            )
    if args.target is not None and args.compare is None:
        raise ValueError("--target applies to --compare")
    fleet = load_fleet(
        args.fleet,
        **given(args, SHAPE_FLAGS),  # the file's, where a flag is not given
        clients=args.clients,
        num_server_rounds=args.rounds,
        fraction_train=args.fraction,
    )
    names = check_strategies((args.compare or args.strategy or "fleetfit").split(","))
    out = args.out or os.path.join("runs", time.strftime(f"{fleet.name}-%Y%m%d-%H%M%S"))
    # Everything that can fail on input fails here, before Ray starts.
    for name in names:
        wl = smallest_model(fleet)[0].name if name == "smallest-model" else None
        settings_for(fleet, name, out, workload=wl).validate()
    output_dir("--out", out)
    print(
        f"fleetfit simulate: fleet {fleet.name} ({fleet.clients} devices, "
        f"{fleet.shape.workload}), {fleet.num_server_rounds} rounds, strategies {', '.join(names)} "
        f"-> {out}",
        file=sys.stderr,
    )
    from fleetfit.cli import stop_on_signals

    stop_on_signals()  # Ctrl-C and SIGTERM stop Ray and exit
    engine = {"progress": not args.no_progress, "ray_address": args.ray_address}
    if args.compare is None:
        entry = run_strategy(fleet, names[0], out, **engine)
        from simulations.report import format_table

        result = {
            "fleet": fleet.describe(),
            "metric_name": entry["metric_name"],
            "target": entry["final_metric"],
            "strategies": {names[0]: {**entry, "run_folder": "."}},
        }
        print(format_rounds({"metric_name": entry["metric_name"], **entry}))
        print()
        print(format_table(result))
        print(f"\nrun folder: {out}")
        return 0
    from simulations.report import format_table

    result = compare(fleet, names, out, target=args.target, **engine)
    print(format_table(result))
    print(f"\nrun folders: {out}/<strategy>; report: {out}/report.md")
    return 0


def format_rounds(summary: dict[str, Any]) -> str:
    """The per-round table of a run summary."""
    lm = summary.get("metric_name") == "perplexity"
    head = (
        ["round", "clients", "accuracy", "loss"]
        + (["perplexity"] if lm else [])
        + ["train loss", "time s"]
    )
    rows = []
    for r in summary["rounds"]:
        row = [
            str(r["round"]),
            f"{r['num_clients']}/{r.get('num_sampled', r['num_clients'])}",
            f"{r['accuracy']:.4f}",
            f"{r['loss']:.4f}",
        ]
        if lm:
            row.append(f"{r['perplexity']:.2f}")
        tl = r.get("train_loss")
        row += ["-" if tl is None else f"{tl:.4f}", f"{r.get('round_s', 0):.1f}"]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
