"""Every strategy on the shipped fleets, pretrained and from scratch (issue 16).

fleetfit, ``exclude``, ``smallest-model``, ``heterofl`` and ``fedrolex`` on the phone
fleet (simulations/fleets/phones.toml) in two settings, and on a second shipped fleet
in one:

- ``scratch``: the fleet file as shipped (every model from its seeded init);
- ``pretrained``: the same fleet with a ``[pretrain]`` table added by this script
  (``--pretrain-steps`` AdamW steps on a ``--pretrain-share`` public share held out
  from every device; the shipped files have none), so each strategy's model is
  pretrained centrally and fine-tuned in the federation.

Every strategy runs with the same server optimiser (``--server-opt``), proximal term
(``--proximal-mu``), rounds, local steps, split and seed; each at its own client lr
chosen by one rule for all. By default: every model is pretrained at each candidate
lr (``--pretrain-lrs``, default the fleet's lr times 1/100, 1/30, 1/10 and 1/3) and keeps
its best (``simulations.pretrain``), and its clients train at that lr, in the
pretrained setting and then from scratch on the same fleet. ``--lrs`` gives recorded
choices instead (``name=lr,...``), ``--sweep-rounds N`` runs the federated sweep
first (``simulations.lr_sweep``: 3 candidates per strategy, N rounds each). Prints per setting the final metric overall and on the
data of every device class (``exclude``'s left-out classes marked) at equal rounds and
at equal simulated time (the model at its last round finished by then: every
strategy at the shortest run's end, and fleetfit pair by pair with each strategy at
the shorter of their two runs, which the targets check), participation and wall time; then the targets
and whether each was met, the machine and its own wall time. Plots (metric vs rounds,
vs simulated time, per class) go to ``--figures``.

    python benchmarks/fleet_compare.py                     # the documented benchmark
    python benchmarks/fleet_compare.py --rounds 3 --local-steps 5 --settings scratch
    python benchmarks/fleet_compare.py --smoke             # the machinery only (Ray)

``--strategies`` takes any of ``simulations.compare.STRATEGIES``, among them
fleetfit's adapter variants (issue 17 item 3: ``fleetfit`` full + part windows,
``fleetfit-adapter`` full + adapters, ``adapters`` everywhere); ``--disk 0`` gives
every device class no storage (no offload, no streaming), ``--tag`` names the run
folder and plots apart from the issue 16 ones:

    python benchmarks/fleet_compare.py --settings pretrained --second none \
        --strategies fleetfit,fleetfit-adapter,adapters,exclude --disk 0 \
        --tag adapters-nodisk --rounds 2 --local-steps 5 --pretrain-steps 100
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from memory.sizes import parse_bytes  # noqa: E402
from server.fedopt import SERVER_OPTS, ServerOptConfig  # noqa: E402
from simulations.compare import STRATEGIES  # noqa: E402
from simulations.fleet import Fleet, parse_fleet, shipped_fleet  # noqa: E402

SETTINGS = ("pretrained", "scratch")
DEFAULT_STRATEGIES = ("fleetfit", "exclude", "smallest-model", "heterofl", "fedrolex")
FIGURES = ROOT / "docs" / "figures" / "fleet_compare"
PLOTS = ("metric.png", "metric_time.png", "class_rounds.png")
PRETRAIN_LR_FACTORS = (1 / 100, 1 / 30, 1 / 10, 1 / 3)
"""The default candidate pretraining lrs, times the fleet's lr (0.003 on the shipped
fleets: 3e-5, 1e-4, 3e-4, 1e-3): half-decade steps below the fleet's lr, a grid that
brackets each model's best (docs/simulations.md, The learning-rate rule). The
fleet's own lr (3e-3) lost for both models on both fleets and at every horizon of
the central curves, and gpt-byte's best, 1e-4, was the lowest candidate of the
first grid (1/30 ... 1), so the grid moved half a decade down."""


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run compares (``parse`` builds it from the command line)."""

    fleet: str = "phones"  # the main fleet: both settings
    second: str = "edge"  # the other shipped fleet ("" none)
    second_setting: str = "pretrained"  # its one setting
    settings: tuple[str, ...] = SETTINGS
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES  # any of compare.STRATEGIES
    rounds: int = 5  # rounds per comparison
    local_steps: int = 10  # optimizer steps per device per round
    pretrain_steps: int = 200  # AdamW steps of the [pretrain] table
    pretrain_share: float = 0.2  # of every data group, held out from every device
    pretrain_lrs: tuple[float, ...] = ()  # candidate pretraining lrs; (): the
    #   fleet's lr times PRETRAIN_LR_FACTORS
    server_opt: str = "fedavg"  # the same for every strategy
    server_lr: float = 0.0  # 0: the optimiser's default
    proximal_mu: float = 0.0  # FedProx mu, every client of every strategy
    lrs: tuple[tuple[str, float], ...] = ()  # chosen client lr per strategy
    sweep_rounds: int = 0  # > 0: run the lr sweep first, this many rounds
    client_measure: str = "inline"  # peaks in the client's process (quicker)
    disk: str = ""  # every device class's disk budget ("0": none); "": the file's
    tag: str = ""  # appended to each comparison's name: run folder and plot files
    out: str = ""
    figures: str = str(FIGURES)
    json: str = ""  # also write the results here
    merge: tuple[str, ...] = ()  # report only: these summary.json files, merged
    sweep_from: str = ""  # with merge: a --json file whose lr sweep to record

    def server_opt_config(self) -> ServerOptConfig:
        cfg = ServerOptConfig(name=self.server_opt, lr=self.server_lr)
        cfg.validate("benchmark")
        return cfg


def parse(argv: list[str] | None = None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = BenchConfig()
    ap.add_argument("--fleet", default=d.fleet)
    ap.add_argument("--second", default=d.second, help="another fleet; 'none': skip")
    ap.add_argument("--second-setting", default=d.second_setting, choices=SETTINGS)
    ap.add_argument("--settings", default=",".join(d.settings))
    ap.add_argument("--strategies", default=",".join(d.strategies))
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--local-steps", type=int, default=d.local_steps)
    ap.add_argument("--pretrain-steps", type=int, default=d.pretrain_steps)
    ap.add_argument("--pretrain-share", type=float, default=d.pretrain_share)
    ap.add_argument(
        "--pretrain-lrs",
        default="",
        help="candidate pretraining lrs, e.g. 0.0001,0.0003 (each model keeps its "
        "best); default: the fleet's lr times 1/100, 1/30, 1/10 and 1/3",
    )
    ap.add_argument("--server-opt", default=d.server_opt, choices=SERVER_OPTS)
    ap.add_argument("--server-lr", type=float, default=d.server_lr)
    ap.add_argument("--proximal-mu", type=float, default=d.proximal_mu)
    ap.add_argument("--lrs", default="", help="client lr per strategy: name=lr,...")
    ap.add_argument("--sweep-rounds", type=int, default=0)
    ap.add_argument(
        "--disk",
        default="",
        help="every device class's disk budget, e.g. 0 (no storage to offload or "
        "stream to); default: the fleet file's",
    )
    ap.add_argument(
        "--tag",
        default="",
        help="appended to each comparison's name (run folder, plot files), e.g. "
        "adapters: phones-pretrained-adapters-metric.png",
    )
    ap.add_argument(
        "--client-measure", default=d.client_measure, choices=("inline", "auto")
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--figures", default=d.figures, help="'' : no plots copied")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--smoke", action="store_true", help="1 round x 1 step, two strategies"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        default=[],
        help="report only: merge these summary.json files (strategies of one "
        "fleet and setting run separately) into --out",
    )
    ap.add_argument(
        "--sweep-from", default="", help="with --merge: a --json file with the sweep"
    )
    args = ap.parse_args(argv)
    settings = tuple(s for s in args.settings.split(",") if s)
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: {s!r} is not one of {', '.join(SETTINGS)}")
    strategies = tuple(s for s in args.strategies.split(",") if s)
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"--strategies: {s!r} is not one of {', '.join(STRATEGIES)}")
    lrs: list[tuple[str, float]] = []
    for item in (x for x in args.lrs.split(",") if x):
        name, _, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = math.nan
        if name not in STRATEGIES or not (math.isfinite(lr) and lr > 0):
            ap.error(f"--lrs: {item!r} is not STRATEGY=LR with LR > 0")
        lrs.append((name, lr))
    pretrain_lrs: list[float] = []
    for item in (x for x in args.pretrain_lrs.split(",") if x):
        try:
            lr = float(item)
        except ValueError:
            lr = math.nan
        if not (math.isfinite(lr) and lr > 0):
            ap.error(f"--pretrain-lrs: {item!r} is not a number > 0")
        pretrain_lrs.append(lr)
    cfg = BenchConfig(
        fleet=args.fleet,
        second="" if args.second in ("", "none") else args.second,
        second_setting=args.second_setting,
        settings=settings,
        strategies=strategies,
        rounds=args.rounds,
        local_steps=args.local_steps,
        pretrain_steps=args.pretrain_steps,
        pretrain_share=args.pretrain_share,
        pretrain_lrs=tuple(sorted(set(pretrain_lrs))),
        server_opt=args.server_opt,
        server_lr=args.server_lr,
        proximal_mu=args.proximal_mu,
        lrs=tuple(lrs),
        sweep_rounds=args.sweep_rounds,
        client_measure=args.client_measure,
        disk=args.disk,
        tag=args.tag,
        out=args.out,
        figures=args.figures,
        json=args.json or "",
        merge=tuple(args.merge),
        sweep_from=args.sweep_from,
    )
    if args.smoke:
        cfg = replace(
            cfg,
            second="",
            settings=("pretrained",),
            strategies=("fleetfit", "smallest-model"),
            rounds=1,
            local_steps=1,
            pretrain_steps=2,
            sweep_rounds=0,
            figures="",
        )
    if cfg.rounds < 1 or cfg.local_steps < 1 or cfg.pretrain_steps < 1:
        ap.error("--rounds, --local-steps and --pretrain-steps must be >= 1")
    if cfg.disk:
        try:
            parse_bytes(cfg.disk, what="--disk", allow_zero=True)
        except ValueError as e:
            ap.error(str(e))
    if cfg.tag and not cfg.tag.replace("-", "").replace("_", "").isalnum():
        ap.error(f"--tag {cfg.tag!r}: letters, digits, '-' and '_' only")
    cfg.server_opt_config()
    return cfg


def bench_fleet(cfg: BenchConfig, name: str, setting: str) -> Fleet:
    """The shipped fleet ``name`` with the benchmark's rounds, steps, proximal term,
    disk budget and, for ``pretrained``, a ``[pretrain]`` table."""
    path = shipped_fleet(name) if not Path(name).exists() else Path(name)
    data = tomllib.loads(path.read_text())
    data.pop("pretrain", None)
    if setting == "pretrained":
        lr = parse_fleet(data, file=str(path)).shape.lr  # the file's, or the default
        lrs = cfg.pretrain_lrs or tuple(
            float(f"{lr * f:.6g}") for f in PRETRAIN_LR_FACTORS
        )
        data["pretrain"] = {
            "share": cfg.pretrain_share,
            "steps": cfg.pretrain_steps,
            "lr": list(lrs),
        }
    if cfg.proximal_mu:
        data["proximal-mu"] = cfg.proximal_mu
    if cfg.disk:
        for c in data.get("classes", []):
            c["disk"] = cfg.disk
    return parse_fleet(
        data,
        file=str(path),
        num_server_rounds=cfg.rounds,
        local_steps=cfg.local_steps,
    )


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB "
        f"RAM, Python {platform.python_version()}, load average "
        f"{os.getloadavg()[0]:.1f}"
    )


def better(metric: str, a: Any, b: Any) -> bool:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return False
    return a > b if metric == "accuracy" else a < b


def at_time(entry: dict[str, Any], metric: str, t_s: float) -> dict[str, Any]:
    """A strategy's model at simulated time ``t_s``: its last round finished by
    then (``sim_elapsed_s <= t_s``), else the pretrained model (round 0), else
    nothing. ``{"round", "metric", "classes"}``."""
    got: dict[str, Any] = {"round": None, "metric": None, "classes": {}}
    pre = entry.get("pretrain") or {}
    if isinstance(pre.get("metric"), int | float):
        got = {"round": 0, "metric": pre["metric"], "classes": {}}
    for r in entry.get("rounds", []):
        e = r.get("sim_elapsed_s")
        if isinstance(e, int | float) and e <= t_s * (1 + 1e-9):
            got = {
                "round": r.get("round"),
                "metric": r.get(metric),
                "classes": dict(r.get("class_metrics") or {}),
            }
    return got


def pairwise(
    entries: dict[str, Any], metric: str
) -> dict[str, tuple[float, dict[str, Any], dict[str, Any]]]:
    """Equal simulated time pair by pair: for each strategy other than fleetfit,
    ``(t, fleetfit at t, it at t)`` with ``t`` the shorter of the two runs'
    simulated seconds (``at_time``: the last round each finished by then). A pair
    where either run trained nothing (0 simulated s) is left out. Comparing every
    strategy at the shortest run of all instead puts each pair of slow runs at a
    time before either finished a round."""
    ff = entries.get("fleetfit")
    if not ff or not isinstance(ff.get("sim_s"), int | float) or ff["sim_s"] <= 0:
        return {}
    out: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
    for name, e in entries.items():
        if name == "fleetfit":
            continue
        sim = e.get("sim_s")
        if not isinstance(sim, int | float) or sim <= 0:
            continue
        t_s = min(float(ff["sim_s"]), float(sim))
        out[name] = (t_s, at_time(ff, metric, t_s), at_time(e, metric, t_s))
    return out


def left_out(entries: dict[str, Any]) -> list[str]:
    """The classes ``exclude`` left out (sampled, never contributed)."""
    ex = entries.get("exclude")
    if not ex:
        return []
    return [
        n
        for n, c in ex["classes"].items()
        if c.get("participation") is not None and c["participation"] == 0.0
    ]


def kinds(counts: Any) -> str:
    """``{"full": 3, "part": 1}`` as ``full 3, part 1`` (``-``: none sampled)."""
    if not isinstance(counts, dict) or not counts:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _f(v: Any, spec: str = ".2f") -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


def tables(result: dict[str, Any]) -> tuple[str, list[tuple[str, bool]]]:
    """The Markdown tables of one comparison, and its targets ``(what, met)``."""
    entries = result["strategies"]
    metric = result["metric_name"]
    names = list(entries)
    classes = list(next(iter(entries.values()))["classes"])
    out_cls = left_out(entries)
    # equal simulated time: the shortest run among those that trained at all (a
    # strategy with no accepted update has 0 simulated seconds)
    sims = [
        e["sim_s"]
        for e in entries.values()
        if isinstance(e.get("sim_s"), int | float) and e["sim_s"] > 0
    ]
    t_eq = min(sims) if sims else math.nan
    timed = {n: at_time(e, metric, t_eq) for n, e in entries.items()}
    lines = [
        f"| strategy | workload | client lr | participation | data share | final "
        f"{metric} | {metric} at {t_eq:.0f} simulated s (round) | simulated s | "
        "wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, e in entries.items():
        lines.append(
            f"| {n} | {e['workload']} | {_f(e.get('lr'), 'g')} | "
            f"{_f(100 * e['participation'], '.1f')}% | "
            f"{_f(100 * e['data_share'], '.1f')}% | {_f(e['final_metric'])} | "
            f"{_f(timed[n]['metric'])} ({_f(timed[n]['round'], 'd')}) | "
            f"{_f(e.get('sim_s'), '.0f')} | {_f(e.get('wall_s'), '.0f')} |"
        )
    lines += [
        "",
        f"{metric} on each device class's own held-out data, final model (equal "
        f"rounds) / at {t_eq:.0f} simulated s; * a class exclude leaves out",
        "",
        "| class | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for c in classes:
        cells = [
            f"{_f(entries[n]['classes'][c].get('metric'))} / "
            f"{_f(timed[n]['classes'].get(c))}"
            for n in names
        ]
        lines.append(
            f"| {c}{'*' if c in out_cls else ''} | " + " | ".join(cells) + " |"
        )
    pairs = pairwise(entries, metric)
    if pairs:
        lines += [
            "",
            f"equal simulated time, pair by pair: fleetfit and each strategy at the "
            f"end of the shorter of their two runs, {metric} (round)"
            + ("; " + ", ".join(f"{c}'s data" for c in out_cls) if out_cls else ""),
            "",
            "| against | at simulated s | fleetfit | other |"
            + "".join(f" {c}: fleetfit | {c}: other |" for c in out_cls),
            "|---|---:|---:|---:|" + "---:|---:|" * len(out_cls),
        ]
        for other, (t_s, ff_at, o_at) in pairs.items():
            cells = [
                f"{_f(ff_at['classes'].get(c))} | {_f(o_at['classes'].get(c))}"
                for c in out_cls
            ]
            lines.append(
                f"| {other} | {t_s:.0f} | {_f(ff_at['metric'])} "
                f"({_f(ff_at['round'], 'd')}) | {_f(o_at['metric'])} "
                f"({_f(o_at['round'], 'd')}) |" + "".join(f" {c} |" for c in cells)
            )
    lines += ["", "assignments per class, over all rounds (kind: count)", ""]
    lines += ["| class | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in classes:
        cells = [kinds(entries[n]["classes"][c].get("kinds")) for n in names]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    checks: list[tuple[str, bool]] = []
    timed_none: dict[str, Any] = {"round": None, "metric": None, "classes": {}}
    if "fleetfit" in entries:
        ff = entries["fleetfit"]
        checks.append(
            ("fleetfit: 100% of sampled devices contribute", ff["participation"] == 1.0)
        )
        for other in (n for n in names if n != "fleetfit"):
            o = entries[other]
            checks.append(
                (
                    f"better than {other}, overall, equal rounds",
                    better(metric, ff["final_metric"], o["final_metric"]),
                )
            )
            _, ff_at, o_at = pairs.get(other, (math.nan, timed_none, timed_none))
            checks.append(
                (
                    f"better than {other}, overall, equal simulated time",
                    better(metric, ff_at["metric"], o_at["metric"]),
                )
            )
            for c in out_cls:
                checks.append(
                    (
                        f"better than {other} on {c}'s data, equal rounds",
                        better(
                            metric,
                            ff["classes"][c].get("metric"),
                            o["classes"][c].get("metric"),
                        ),
                    )
                )
                checks.append(
                    (
                        f"better than {other} on {c}'s data, equal simulated time",
                        better(metric, ff_at["classes"].get(c), o_at["classes"].get(c)),
                    )
                )
    return "\n".join(lines), checks


def copy_plots(run_dir: Path, figures: str, stem: str) -> list[str]:
    if not figures:
        return []
    dest = Path(figures)
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for p in PLOTS:
        if (run_dir / p).exists():
            target = dest / f"{stem}-{p}"
            shutil.copyfile(run_dir / p, target)
            done.append(str(target))
    return done


def run(cfg: BenchConfig) -> dict[str, Any]:
    from simulations.compare import compare
    from simulations.lr_sweep import format_sweep, lr_grid, sweep

    out = Path(cfg.out or tempfile.mkdtemp(prefix="fleetfit-compare-"))
    server_opt = cfg.server_opt_config()
    engine: dict[str, Any] = {"client_measure": cfg.client_measure}
    jobs = [(cfg.fleet, s) for s in cfg.settings]
    if cfg.second:
        jobs.append((cfg.second, cfg.second_setting))
    results: dict[str, Any] = {}
    # per fleet: each strategy's lr as its model's pretraining kept it, for the
    # fleet's from-scratch comparison (the same lr rule in both settings)
    kept: dict[str, dict[str, float]] = {}
    for name, setting in jobs:
        fleet = bench_fleet(cfg, name, setting)
        stem = f"{fleet.name}-{setting}" + (f"-{cfg.tag}" if cfg.tag else "")
        lrs = dict(cfg.lrs)
        rule = "given (--lrs)" if lrs else "the fleet's"
        if not lrs and not cfg.sweep_rounds:
            if fleet.pretrain is not None and fleet.pretrain.lrs:
                rule = "pretrain"
            elif fleet.name in kept:
                lrs = kept[fleet.name]
                rule = "kept by the pretrained setting's pretraining"
        table = None
        if cfg.sweep_rounds:
            table = sweep(
                fleet,
                cfg.strategies,
                lr_grid(fleet.shape.lr),
                out / stem / "lr-sweep",
                rounds=cfg.sweep_rounds,
                pretrain_dir=out / "pretrain",
                server_opt=server_opt,
                **engine,
            )
            lrs = table["chosen"]
            rule = "swept (--sweep-rounds)"
            print(f"\n## lr sweep, {stem}\n\n{format_sweep(table)}", flush=True)
        t0 = time.monotonic()
        result = compare(
            fleet,
            cfg.strategies,
            out / stem,
            server_opt=server_opt,
            lrs=lrs or None,
            lr_sweep=table,
            lr_from_pretrain=rule == "pretrain",
            pretrain_dir=out / "pretrain",
            **engine,
        )
        wall = time.monotonic() - t0
        chosen = {n: float(e["lr"]) for n, e in result["strategies"].items()}
        if rule == "pretrain":
            kept[fleet.name] = chosen
            rule = "each model's pretraining lr (its best candidate)"
        text, checks = tables(result)
        print(
            f"\n## {fleet.name}, {setting}: {fleet.clients} devices, "
            f"{fleet.shape.workload}, {fleet.num_server_rounds} rounds x "
            f"{fleet.shape.local_steps} local steps, fraction {fleet.fraction_train}, "
            f"seed {fleet.shape.seed}, server {server_opt.name}, proximal-mu "
            f"{fleet.shape.proximal_mu:g}"
            + (f", every device's disk {cfg.disk}" if cfg.disk else "")
            + (
                f", pretrained {fleet.pretrain.steps} steps on a "
                f"{fleet.pretrain.share:g} public share"
                if fleet.pretrain
                else ", from scratch"
            )
            + "\n# client lr: "
            + ", ".join(f"{n} {v:g}" for n, v in chosen.items())
            + f" ({rule})"
            + f"\n# machine: {machine()}; comparison wall time {wall:.0f} s\n"
        )
        print(text)
        print("\ntargets")
        for what, ok in checks:
            print(f"  {'met   ' if ok else 'MISSED'}  {what}")
        plots = copy_plots(out / stem, cfg.figures, stem)
        results[stem] = {
            "wall_s": wall,
            "machine": machine(),
            "tables": text,
            "checks": dict(checks),
            "plots": plots,
            "lr_sweep": table,
            "lr_rule": rule,
            "summary": {
                n: {k: v for k, v in e.items() if k != "rounds"}
                for n, e in result["strategies"].items()
            },
        }
    return {"out": str(out), "results": results}


def merge(paths: list[str]) -> dict[str, Any]:
    """One comparison from several ``summary.json`` of the same fleet, setting,
    rounds and seed (strategies run in separate processes); later files win."""
    merged: dict[str, Any] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        if merged and part["fleet"] != merged["fleet"]:
            raise ValueError(f"{path}: another fleet or setting than {paths[0]}")
        strategies = {**merged.get("strategies", {}), **part["strategies"]}
        merged = {**merged, **part, "strategies": strategies}
        merged["lr_sweep"] = part.get("lr_sweep") or merged.get("lr_sweep")
    return merged


def report_merged(
    paths: list[str], out: str, figures: str, sweep: str, tag: str = ""
) -> None:
    """``--merge``: tables, report and plots of ``merge(paths)`` (and a sweep's
    table from ``sweep``, a benchmark ``--json`` file), nothing run."""
    from simulations.lr_sweep import format_sweep
    from simulations.report import write_report

    result = merge(paths)
    if sweep:
        for r in json.loads(Path(sweep).read_text())["results"].values():
            if r.get("lr_sweep"):
                result["lr_sweep"] = r["lr_sweep"]
    if result.get("lr_sweep"):
        print(format_sweep(result["lr_sweep"]) + "\n")
    text, checks = tables(result)
    print(text + "\n\ntargets")
    for what, ok in checks:
        print(f"  {'met   ' if ok else 'MISSED'}  {what}")
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(result, indent=2))
    write_report(dest, result)
    f = result["fleet"]
    stem = f"{f['name']}-{'pretrained' if f.get('pretrain') else 'scratch'}"
    stem += f"-{tag}" if tag else ""
    print("\n".join(copy_plots(dest, figures, stem)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.merge:
        report_merged(
            list(cfg.merge), cfg.out or ".", cfg.figures, cfg.sweep_from, cfg.tag
        )
        return 0
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True
    )
    for quiet in ("flwr", "alembic", "ray"):  # one line per round is enough
        logging.getLogger(quiet).setLevel(logging.WARNING)
    t0 = time.monotonic()
    done = run(cfg)
    wall = time.monotonic() - t0
    print(f"\nrun folders: {done['out']}")
    print(f"# machine: {machine()}")
    print(f"# benchmark wall time {wall:.0f} s ({wall / 60:.1f} min)")
    if cfg.json:
        Path(cfg.json).write_text(
            json.dumps(
                {"config": cfg.__dict__, "wall_s": wall, **done}, indent=2, default=str
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
