"""Client learning rates chosen the same way for every strategy (issue 16, item 5).

The rule: for each strategy, one short run per candidate client ``lr`` (a log grid,
by default the fleet's ``lr`` times 1/3, 1 and 3), all on the same fleet, split,
seed, server optimiser and horizon (``rounds`` rounds of the fleet's local steps);
each strategy then runs its comparison at the candidate whose final model has the
best metric on the central held-out set (accuracy highest, perplexity lowest). A
tie, or a candidate with no metric, is settled deterministically: the smaller
``lr`` wins a tie (the more conservative step), and a missing or non-finite metric
loses to every number. No strategy gets a grid, a horizon or a pick of its own.

Example:
    >>> from simulations.fleet import load_fleet
    >>> from simulations.lr_sweep import lr_grid, sweep
    >>> fleet = load_fleet("phones")
    >>> table = sweep(fleet, ["fleetfit", "exclude"], lr_grid(fleet.shape.lr),
    ...               "runs/sweep", rounds=2)
    >>> table["chosen"]  # doctest: +SKIP
    {'fleetfit': 0.003, 'exclude': 0.01}

``sweep`` returns (and ``compare(..., lr_sweep=table)`` records in the comparison's
summary and report) ``{"metric_name", "rounds", "local_steps", "lrs", "rows",
"chosen"}``: a row per strategy and candidate with its final metric, wall and
simulated seconds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from simulations.fleet import Fleet

log = logging.getLogger(__name__)

GRID_FACTOR = 3.0
"""Ratio between neighbouring candidates of ``lr_grid`` (about half a decade)."""

RunFn = Callable[..., dict[str, Any]]
"""``run(fleet, strategy, out, **kw) -> entry`` (``simulations.compare.run_strategy``
or a stub in tests); the entry has ``final_metric`` and may have ``wall_s``,
``sim_s``."""


def lr_grid(
    center: float, num: int = 3, factor: float = GRID_FACTOR
) -> tuple[float, ...]:
    """``num`` learning rates on a log grid centred on ``center``, ascending.

    >>> lr_grid(0.003)
    (0.001, 0.003, 0.009)
    """
    if not (math.isfinite(center) and center > 0):
        raise ValueError(f"lr grid centre {center!r} must be a positive number")
    if num < 1:
        raise ValueError(f"lr grid size {num} must be at least 1")
    if not factor > 1:
        raise ValueError(f"lr grid factor {factor} must be > 1")
    lo = -(num - 1) / 2
    return tuple(float(f"{center * factor ** (lo + i):.6g}") for i in range(num))


def _score(metric_name: str, value: Any) -> float:
    """A number where smaller is better; missing or non-finite values are worst."""
    if not isinstance(value, int | float) or not math.isfinite(value):
        return math.inf
    return -float(value) if metric_name == "accuracy" else float(value)


def choose(rows: Sequence[dict[str, Any]], metric_name: str) -> dict[str, float]:
    """Each strategy's chosen lr: the best ``final_metric`` among its rows; a tie goes
    to the smaller lr; a row without a finite metric is never preferred to one with.
    """
    best: dict[str, tuple[float, float]] = {}
    for r in rows:
        key = (_score(metric_name, r.get("final_metric")), float(r["lr"]))
        if r["strategy"] not in best or key < best[r["strategy"]]:
            best[r["strategy"]] = key
    return {s: lr for s, (_, lr) in best.items()}


def with_lr(fleet: Fleet, lr: float) -> Fleet:
    """``fleet`` with client learning rate ``lr``; a ``[pretrain]`` phase that took
    the run's lr keeps the fleet's own, so every candidate starts from one model
    (candidate pretraining lrs do not depend on the run's lr)."""
    pretrain = fleet.pretrain
    if pretrain is not None and not pretrain.lr and not pretrain.lrs:
        pretrain = replace(pretrain, lr=fleet.shape.lr)
    return replace(fleet, shape=replace(fleet.shape, lr=lr), pretrain=pretrain)


def sweep(
    fleet: Fleet,
    strategies: Sequence[str],
    lrs: Sequence[float],
    out: str | Path,
    *,
    rounds: int,
    run: RunFn | None = None,
    pretrain_dir: str | Path | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run every strategy at every candidate lr for ``rounds`` rounds; the table and
    each strategy's choice (module doc). ``kwargs`` go to ``run`` (engine options,
    ``server_opt``). Run folders: ``out/STRATEGY-lrLR``; pretrained models are cached
    once in ``pretrain_dir`` (default ``out/pretrain``; give the comparison's to share
    them with it)."""
    if run is None:
        from simulations.compare import run_strategy

        run = run_strategy
    if rounds < 1:
        raise ValueError(f"sweep rounds={rounds} must be at least 1")
    grid = sorted({float(x) for x in lrs})
    if not grid or any(not (math.isfinite(x) and x > 0) for x in grid):
        raise ValueError(f"candidate lrs {list(lrs)} must be positive numbers")
    out = Path(out)
    short = replace(fleet, num_server_rounds=rounds)
    rows: list[dict[str, Any]] = []
    metric_name = ""
    for name in strategies:
        for lr in grid:
            log.info("lr sweep: %s at lr %g, %d rounds", name, lr, rounds)
            entry = run(
                with_lr(short, lr),
                name,
                out / f"{name}-lr{lr:g}",
                pretrain_dir=Path(pretrain_dir or out / "pretrain"),
                **kwargs,
            )
            metric_name = metric_name or str(entry.get("metric_name", ""))
            log.info(
                "lr sweep: %s at lr %g: %s %s",
                name,
                lr,
                metric_name,
                entry.get("final_metric"),
            )
            rows.append(
                {
                    "strategy": name,
                    "lr": lr,
                    "final_metric": entry.get("final_metric"),
                    "wall_s": entry.get("wall_s"),
                    "sim_s": entry.get("sim_s"),
                }
            )
    return {
        "metric_name": metric_name,
        "rounds": rounds,
        "local_steps": fleet.shape.local_steps,
        "lrs": grid,
        "rows": rows,
        "chosen": choose(rows, metric_name),
    }


def format_sweep(table: dict[str, Any]) -> str:
    """The sweep as a Markdown table: a row per strategy, a column per candidate lr
    (the final metric), the chosen lr marked with ``*``."""
    lrs = list(table["lrs"])
    metric = table.get("metric_name") or "metric"
    head = ["strategy", *(f"lr {x:g}" for x in lrs), "chosen lr"]
    lines = [
        f"{metric} after {table['rounds']} rounds x {table['local_steps']} local "
        "steps, per candidate client lr (* chosen: best, ties to the smaller lr)",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    values: dict[str, dict[float, Any]] = {}
    for r in table["rows"]:
        values.setdefault(r["strategy"], {})[float(r["lr"])] = r.get("final_metric")
    for name, by_lr in values.items():
        chosen = table["chosen"].get(name)
        cells = []
        for x in lrs:
            v = by_lr.get(float(x))
            text = f"{v:.4g}" if isinstance(v, int | float) else "-"
            cells.append(text + ("*" if chosen == x else ""))
        lines.append(
            "| " + " | ".join([name, *cells, f"{chosen:g}" if chosen else "-"]) + " |"
        )
    return "\n".join(lines)
