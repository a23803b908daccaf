"""``fleetfit simulate``: a federation on Flower's simulation engine."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from fleetfit.args import non_negative_int, positive_float, positive_int


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="simulate a federation on Flower's simulation engine",
        description="Simulate a federation locally (Flower simulation engine on Ray), "
        "print a per-round table and write a run folder.",
    )
    p.add_argument(
        "--workload",
        default="digits-cnn",
        help="built-in workload or module:function (default: digits-cnn)",
    )
    p.add_argument(
        "--clients",
        type=positive_int,
        default=10,
        help="virtual clients (default: 10)",
    )
    p.add_argument(
        "--rounds", type=positive_int, default=5, help="federated rounds (default: 5)"
    )
    p.add_argument(
        "--local-steps",
        type=positive_int,
        default=20,
        help="optimizer steps per client per round (default: 20)",
    )
    p.add_argument(
        "--lr",
        type=positive_float,
        default=0.003,
        help="client AdamW learning rate (default: 0.003)",
    )
    p.add_argument(
        "--split",
        default="iid",
        choices=["iid", "dirichlet", "natural"],
        help="how data is split across clients (default: iid)",
    )
    p.add_argument(
        "--alpha",
        type=positive_float,
        default=0.5,
        help="Dirichlet concentration for --split dirichlet (default: 0.5)",
    )
    p.add_argument(
        "--fraction",
        type=positive_float,
        default=1.0,
        help="share of clients sampled per round, in (0, 1] (default: 1)",
    )
    p.add_argument(
        "--batch",
        type=non_negative_int,
        default=0,
        help="local batch size (default: the workload's)",
    )
    p.add_argument(
        "--seq",
        type=non_negative_int,
        default=0,
        help="sequence length for language models (default: the workload's)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of all randomness (default: 0)"
    )
    p.add_argument(
        "--out", default=None, help="run folder (default: runs/simulate-<timestamp>)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from simulations.run import SimulationSettings, simulate

    out = args.out or os.path.join("runs", time.strftime("simulate-%Y%m%d-%H%M%S"))
    settings = SimulationSettings(
        workload=args.workload,
        num_clients=args.clients,
        rounds=args.rounds,
        local_steps=args.local_steps,
        lr=args.lr,
        split=args.split,
        dirichlet_alpha=args.alpha,
        fraction_train=args.fraction,
        seed=args.seed,
        out=out,
        batch_size=args.batch,
        seq_len=args.seq,
    )
    settings.validate()  # bad input fails here, before Ray starts
    print(
        f"fleetfit simulate: {args.workload}, {args.clients} clients, "
        f"{args.rounds} rounds -> {out}",
        file=sys.stderr,
    )
    from fleetfit.cli import interrupted

    signal.signal(signal.SIGINT, interrupted)
    summary = simulate(settings)
    print(format_rounds(summary))
    print(f"\nrun folder: {out}")
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
