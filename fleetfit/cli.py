"""The ``fleetfit`` command.

fleetfit simulate                         # digits CNN, 10 virtual clients, 5 rounds
fleetfit simulate --workload gpt-tiny --clients 4 --rounds 3 --out runs/lm
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("fleetfit")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive number")
    return value


def _add_simulate(sub: argparse._SubParsersAction) -> None:
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
        type=_positive_int,
        default=10,
        help="virtual clients (default: 10)",
    )
    p.add_argument(
        "--rounds", type=_positive_int, default=5, help="federated rounds (default: 5)"
    )
    p.add_argument(
        "--local-steps",
        type=_positive_int,
        default=20,
        help="optimizer steps per client per round (default: 20)",
    )
    p.add_argument(
        "--lr",
        type=_positive_float,
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
        type=_positive_float,
        default=0.5,
        help="Dirichlet concentration for --split dirichlet (default: 0.5)",
    )
    p.add_argument(
        "--fraction",
        type=_positive_float,
        default=1.0,
        help="share of clients sampled per round, in (0, 1] (default: 1)",
    )
    p.add_argument(
        "--batch",
        type=_non_negative_int,
        default=0,
        help="local batch size (default: the workload's)",
    )
    p.add_argument(
        "--seq",
        type=_non_negative_int,
        default=0,
        help="sequence length for language models (default: the workload's)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of all randomness (default: 0)"
    )
    p.add_argument(
        "--out", default=None, help="run folder (default: runs/simulate-<timestamp>)"
    )
    p.set_defaults(func=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
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


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    for name in ("fleetfit", "server", "client", "simulations", "memory", "partition"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_simulate]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetfit",
        description="Train models on devices that do not have the memory to train them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, TimeoutError) as e:
        # Bad input and clear failures: one line naming the value and the fix.
        print(f"fleetfit: error: {e}", file=sys.stderr)
        return 2
    finally:
        _stop_ray()


def _stop_ray() -> None:
    """Stop a Ray runtime this process started (also after Ctrl-C or an error)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
