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
from typing import Any

from fleetfit.args import non_negative_int, positive_float, positive_int
from simulations.run import SimulationSettings, check_ray_address
from wire.shape import RunShape
from workloads.splits import SPLITS

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


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a federation on Flower's simulation engine",
        description="Simulate a federation locally (Flower simulation engine on Ray), "
        "print a per-round table and write a run folder.",
    )
    p.add_argument(
        "--workload",
        default=None,
        help=f"built-in workload or module:function (default: {_SHAPE.workload})",
    )
    p.add_argument(
        "--fleet",
        default=None,
        help="a fleet file (TOML) or a shipped fleet: phones, sbc, edge; it sets the "
        "workload, devices, budgets and split (the options below override it)",
    )
    p.add_argument(
        "--strategy",
        default=None,
        help="with --fleet: fleetfit (default), exclude or smallest-model",
    )
    p.add_argument(
        "--compare",
        default=None,
        help="with --fleet: strategies to run side by side, e.g. "
        "fleetfit,exclude,smallest-model (a run folder each under --out)",
    )
    p.add_argument(
        "--target",
        type=positive_float,
        default=None,
        help="with --compare: the metric for 'rounds to target' (default: the worst "
        "final metric among the strategies)",
    )
    p.add_argument(
        "--ray-address",
        default="",
        help="run on an existing Ray cluster (auto, or HEAD:6379) instead of a local "
        "Ray (see docs/simulations.md)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (one line per round on stderr)",
    )
    p.add_argument(
        "--clients",
        type=positive_int,
        default=None,
        help=f"virtual clients (default: {_SIM.num_clients}, or the fleet's)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help=f"federated rounds (default: {_SIM.num_server_rounds}, or the fleet's)",
    )
    p.add_argument(
        "--local-steps",
        type=positive_int,
        default=None,
        help="optimizer steps per client per round (default: "
        f"{_SHAPE.local_steps}, or the fleet's)",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"client AdamW learning rate (default: {_SHAPE.lr}, or the fleet's)",
    )
    p.add_argument(
        "--split",
        default=None,
        choices=SPLITS,
        help=f"how data is split across clients (default: {_SHAPE.split})",
    )
    p.add_argument(
        "--alpha",
        type=positive_float,
        default=None,
        help="Dirichlet concentration for --split dirichlet (default: "
        f"{_SHAPE.dirichlet_alpha}, or the fleet's)",
    )
    p.add_argument(
        "--fraction",
        type=positive_float,
        default=None,
        help="share of clients sampled per round, in (0, 1] (default: "
        f"{_SIM.fraction_train:g}, or the fleet's)",
    )
    p.add_argument(
        "--batch",
        type=non_negative_int,
        default=None,
        help="local batch size (default: the workload's, or the fleet's)",
    )
    p.add_argument(
        "--seq",
        type=non_negative_int,
        default=None,
        help="sequence length for language models (default: the workload's, or the "
        "fleet's)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"seed of all randomness (default: {_SHAPE.seed}, or the fleet's)",
    )
    p.add_argument(
        "--out", default=None, help="run folder (default: runs/simulate-<timestamp>)"
    )
    p.set_defaults(func=run)


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
