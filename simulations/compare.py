"""Strategies compared on one fleet, data split and seed.

- ``fleetfit``: the memory-aware federation: every device trains what fits its budget
  (a plan for the whole model, a window of blocks, or evaluation only).
- ``exclude``: the status quo: plain FedAvg where a device whose plain training step
  does not fit its budget (by the memory model, as a real device would fail) takes no
  part.
- ``smallest-model``: the model shrunk (``NAME@SCALE``) until every device of the fleet
  can train it plainly; then plain FedAvg with everyone.
- ``heterofl``, ``fedrolex``: each device trains the widest width-scaled sub-model
  whose plain step fits its budget, static (HeteroFL) or rolling (FedRolex) indices,
  averaged entry by entry (``server.submodel``, ``simulations.baselines``).
- ``fleetfit-adapter``, ``adapters``: fleetfit with LoRA adapters (``VARIANTS``): a
  whole-model plan where one fits, else adapters on a frozen base (``adapters =
  auto``), or adapters on every device (``adapters = all``, the practitioner's
  default for fine-tuning). Plain ``fleetfit`` gives the devices no whole-model plan
  fits a ``part`` window (``adapters = off``).

Example:
    >>> from simulations.compare import compare
    >>> from simulations.fleet import load_fleet
    >>> result = compare(load_fleet("edge"), ["fleetfit", "exclude"], "runs/edge")

``compare`` writes ``OUT/NAME/`` (a run folder per strategy), ``OUT/summary.json``
(``{"fleet": ..., "strategies": {NAME: {...}}}``) and the report files of
``simulations.report``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memory.sizes import format_bytes
from server.class_metrics import class_metrics, class_test_items
from server.config import AdapterConfig, ExportConfig, ServerConfig
from server.fedopt import ServerOptConfig
from simulations.fleet import Fleet
from simulations.run import SimulationSettings, simulate
from workloads import Workload, get_workload
from workloads.splits import split_indices

log = logging.getLogger(__name__)

VARIANTS: dict[str, str | None] = {
    "fleetfit": None,  # the fleet file's adapters (default off: full, else a part window)
    "fleetfit-adapter": "auto",  # full where a plan fits, else adapters
    "adapters": "all",  # adapters on every device
}
"""fleetfit and its variants: strategy name -> the run config's ``adapters`` mode it
sets over the fleet file's (``AdapterConfig``, server/config.py; None: the file's
own), keeping the file's ``lora-*`` keys; each runs the server's ``strategy =
fleetfit``."""
STRATEGIES = (
    "fleetfit",
    "exclude",
    "smallest-model",
    "heterofl",
    "fedrolex",
    *(n for n in VARIANTS if n != "fleetfit"),
)
SUBMODEL_STRATEGIES = ("heterofl", "fedrolex")
TRAINING_KINDS = ("full", "part", "adapter")
"""The assignment kinds that train (``server.assign``); ``none`` does not."""
SCALES = (1.0, 0.75, 0.5, 0.375, 0.25, 0.1875, 0.125, 0.0625)
"""The model sizes ``smallest-model`` tries, largest first (``NAME@SCALE``)."""


def check_strategies(names: Sequence[str]) -> list[str]:
    """Validate a list of strategy names (no duplicates, each known)."""
    out: list[str] = []
    for name in names:
        name = name.strip()
        if name not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}"
            )
        if name in out:
            raise ValueError(f"strategy {name!r} is listed twice")
        out.append(name)
    if not out:
        raise ValueError(f"name at least one strategy: {', '.join(STRATEGIES)}")
    return out


def server_strategy(name: str) -> str:
    """The run config's ``strategy`` of comparison strategy ``name``."""
    if name in VARIANTS:
        return "fleetfit"
    return "exclude" if name == "smallest-model" else name


def adapter_config(name: str, fleet: AdapterConfig | None = None) -> AdapterConfig:
    """The run config's adapter settings of comparison strategy ``name``: the fleet
    file's (``fleet``; default: the run config's defaults, adapters off) with the
    variant's mode over them; adapters off for a strategy that is no fleetfit
    variant (the server trains adapters with fleetfit only)."""
    if name not in VARIANTS:
        return AdapterConfig()
    base = fleet or AdapterConfig()
    mode = VARIANTS[name]
    return base if mode is None else replace(base, mode=mode)


def base_workload(fleet: Fleet) -> Workload:
    return get_workload(
        fleet.shape.workload,
        batch_size=fleet.shape.batch_size or None,
        seq_len=fleet.shape.seq_len or None,
    )


def plain_need_bytes(workload: Workload, reserve_bytes: int) -> int:
    """The budget a device needs to train ``workload`` plainly (memory model)."""
    from server.assign import Assigner

    a = Assigner(
        workload,
        workload.make_model(0),
        local_steps=1,
        runtime_reserve_bytes=reserve_bytes,
        train_time_s=math.inf,
        strategy="exclude",
    )
    return a.plain_need_bytes()


@functools.lru_cache(maxsize=8)
def smallest_model(fleet: Fleet) -> tuple[Workload, int]:
    """The largest shrunk model every device of ``fleet`` trains plainly, and its need.

    Raises:
        ValueError: the workload cannot be shrunk (a custom one), or even the smallest
            scale does not fit the smallest budget.
    """
    wl = base_workload(fleet)
    if wl.kind == "custom":
        raise ValueError(
            f"smallest-model shrinks built-in workloads only; {wl.name} is custom"
        )
    reserve = ServerConfig().reserve_bytes
    smallest = min(fleet.budgets)
    need = 0
    for scale in SCALES:
        cand = wl.scaled(scale)
        need = plain_need_bytes(cand, reserve)
        if need <= smallest:
            return cand, need
    raise ValueError(
        f"smallest-model: even {wl.base_name}@{SCALES[-1]:g} needs "
        f"{format_bytes(need)} to train plainly, more than the fleet's smallest "
        f"budget of {format_bytes(smallest)}"
    )


def settings_for(
    fleet: Fleet,
    strategy: str,
    out: str | Path,
    *,
    workload: str | None = None,
    init_model: str = "",
    server_opt: ServerOptConfig | None = None,
    **engine: Any,
) -> SimulationSettings:
    """The simulation of one strategy on ``fleet``.

    ``engine``: ``SimulationSettings`` fields of how it runs, not what it simulates:
    ``cpus_per_client``, ``progress``, ``ray_address``, ``client_measure`` (``auto``
    measures every training in a child process, ``inline`` in the client's own, which
    is quicker and coarser). ``server_opt``: the server optimiser (default FedAvg),
    the same for every strategy of a comparison.
    """
    check_strategies([strategy])
    allowed = {"cpus_per_client", "progress", "ray_address", "client_measure"}
    if set(engine) - allowed:
        raise TypeError(f"unknown engine option(s) {sorted(set(engine) - allowed)}")
    return SimulationSettings(
        shape=replace(fleet.shape, workload=workload or fleet.shape.workload),
        num_clients=fleet.clients,
        num_server_rounds=fleet.num_server_rounds,
        fraction_train=fleet.fraction_train,
        out=str(out),
        fleet=fleet.fleet_config(),
        strategy=server_strategy(strategy),
        adapters=adapter_config(strategy, fleet.adapters),
        export=ExportConfig(
            onnx="off",
            eval_only="onnxruntime" if strategy in VARIANTS else "off",
        ),
        eval_windows=fleet.eval_windows,
        round_deadline_s=fleet.round_deadline_s,
        init_model=init_model,
        server_opt=server_opt or ServerOptConfig(),
        **engine,
    )


def run_strategy(
    fleet: Fleet,
    strategy: str,
    out: str | Path,
    *,
    pretrain_dir: str | Path | None = None,
    server_opt: ServerOptConfig | None = None,
    lr_from_pretrain: bool = False,
    **engine: Any,
) -> dict[str, Any]:
    """Simulate ``strategy`` on ``fleet`` into run folder ``out``; its summary entry
    (``engine``: see ``settings_for``). With a ``[pretrain]`` table the strategy's
    model is pretrained first, or taken from the cache in ``pretrain_dir`` (default
    ``out/pretrain``); ``lr_from_pretrain``: the clients train at the lr the
    pretraining kept for this model (its candidate lrs, ``simulations.pretrain``)."""
    workload = None
    if strategy == "smallest-model":
        shrunk, need = smallest_model(fleet)
        workload = shrunk.name
        log.info(
            "smallest-model: %s (plain step needs %s)", workload, format_bytes(need)
        )
    init_model, pretrained = "", None
    if fleet.pretrain is not None:
        from simulations.pretrain import pretrained_model

        pretrained = pretrained_model(
            fleet,
            workload or fleet.shape.workload,
            Path(out) / "pretrain" if pretrain_dir is None else pretrain_dir,
        )
        init_model = str(pretrained.path)
        if lr_from_pretrain:
            from simulations.lr_sweep import with_lr

            fleet = with_lr(fleet, float(pretrained.record["lr"]))
    elif lr_from_pretrain:
        raise ValueError(
            "lr_from_pretrain: the fleet has no [pretrain] table to take an lr from"
        )
    settings = settings_for(
        fleet,
        strategy,
        out,
        workload=workload,
        init_model=init_model,
        server_opt=server_opt,
        **engine,
    )
    t0 = time.monotonic()
    summary = simulate(settings)
    wall = time.monotonic() - t0
    entry = summarize(fleet, summary, Path(out), wall_s=wall, workload=workload)
    entry["lr"] = fleet.shape.lr
    if strategy in SUBMODEL_STRATEGIES:
        from simulations.baselines import sizing

        entry["sizing"] = sizing(fleet, strategy)
    if pretrained is not None:
        entry["pretrain"] = {**pretrained.record, "cached": pretrained.cached}
    return entry


def compare(
    fleet: Fleet,
    strategies: Sequence[str],
    out: str | Path,
    *,
    target: float | None = None,
    report: bool = True,
    server_opt: ServerOptConfig | None = None,
    lrs: dict[str, float] | None = None,
    lr_sweep: dict[str, Any] | None = None,
    lr_from_pretrain: bool = False,
    pretrain_dir: str | Path | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """Run each strategy on the same fleet, split and seed; write the comparison.

    ``target``: the metric for "rounds to target" (default: the worst final metric
    among the strategies, the quality every one of them reaches). ``server_opt``: the
    server optimiser of every strategy (default FedAvg). ``lrs``: a client lr per
    strategy (``simulations.lr_sweep``; default the fleet's for all), and
    ``lr_sweep`` the sweep that chose them, recorded in the summary and report.
    ``lr_from_pretrain``: instead, each strategy's clients train at the lr its
    model's pretraining kept (``[pretrain]`` with candidate lrs: the same rule for
    every model). ``pretrain_dir``: the pretrained models' cache (default
    ``out/pretrain``; comparisons of one workload can share one). ``engine``: see ``settings_for``.
    """
    names = check_strategies(strategies)
    if lr_from_pretrain and (lrs or fleet.pretrain is None or not fleet.pretrain.lrs):
        raise ValueError(
            "lr_from_pretrain takes each model's lr from its pretraining's candidate "
            "lrs: give the fleet a [pretrain] table with lr = [a list], and no lrs"
        )
    if target is not None and not (math.isfinite(target) and target > 0):
        raise ValueError(f"target={target!r} must be a positive number")
    if "smallest-model" in names:
        smallest_model(fleet)  # fails here, before any simulation, if none fits
    for name in set(names) & set(SUBMODEL_STRATEGIES):
        from simulations.baselines import assigner

        assigner(fleet, name)  # fails here if the workload has no sub-models
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict[str, Any]] = {}
    for name in names:
        log.info("strategy %s on fleet %s", name, fleet.name)
        mine = fleet
        if lrs and name in lrs:
            from simulations.lr_sweep import with_lr

            mine = with_lr(fleet, lrs[name])
        entries[name] = run_strategy(
            mine,
            name,
            out / name,
            pretrain_dir=Path(pretrain_dir) if pretrain_dir else out / "pretrain",
            server_opt=server_opt,
            lr_from_pretrain=lr_from_pretrain,
            **engine,
        )
        entries[name]["run_folder"] = name
    metric = next(iter(entries.values()))["metric_name"]
    higher = metric == "accuracy"
    if target is None:
        finals = [e["final_metric"] for e in entries.values()]
        target = min(finals) if higher else max(finals)
    for e in entries.values():
        e["rounds_to_target"] = rounds_to(e["rounds"], metric, target)
    result = {
        "fleet": fleet.describe(),
        "metric_name": metric,
        "target": target,
        "server_opt": {
            "name": (server_opt or ServerOptConfig()).name,
            "lr": (server_opt or ServerOptConfig()).resolved_lr,
        },
        "strategies": entries,
    }
    if lr_sweep is not None:
        result["lr_sweep"] = lr_sweep
    if lr_from_pretrain:
        result["lr_rule"] = "pretrain"
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    if report:
        from simulations.report import write_report

        write_report(out, result)
    return result


def rounds_to(rounds: list[dict[str, Any]], metric: str, target: float) -> int | None:
    """The first round whose metric reaches ``target`` (None: never)."""
    for r in rounds:
        v = r.get(metric)
        if v is None:
            continue
        if (v >= target) if metric == "accuracy" else (v <= target):
            return int(r["round"])
    return None


def summarize(
    fleet: Fleet,
    summary: dict[str, Any],
    run_folder: Path,
    *,
    wall_s: float,
    workload: str | None = None,
) -> dict[str, Any]:
    """A strategy's entry: participation, data share, metrics, per-class figures."""
    wl = base_workload(fleet)
    metric = wl.metric_name
    sizes = partition_sizes(fleet, wl)
    total = float(sum(sizes))
    names = [c.name for c in fleet.classes]
    cls_of = list(fleet.partition_class)
    contributed_any: set[int] = set()
    per_class: dict[str, dict[str, Any]] = {
        n: {"sampled": 0, "contributed": 0, "worst": None, "kinds": {}} for n in names
    }
    sampled_all = contributed_all = 0
    for r in summary["rounds"]:
        for a in r.get("assignments", []):
            pid = a.get("partition_id")
            if not isinstance(pid, int) or not 0 <= pid < fleet.clients:
                continue
            c = per_class[names[cls_of[pid]]]
            c["sampled"] += 1
            sampled_all += 1
            kind = str(a.get("kind"))
            c["kinds"][kind] = c["kinds"].get(kind, 0) + 1
            if kind in TRAINING_KINDS and a.get("status") == "ok":
                c["contributed"] += 1
                contributed_all += 1
                contributed_any.add(pid)
            peak, budget = a.get("measured_peak_bytes"), a.get("budget_bytes")
            if isinstance(peak, int | float) and isinstance(budget, int) and budget > 0:
                ratio = float(peak) / budget
                c["worst"] = ratio if c["worst"] is None else max(c["worst"], ratio)
    class_metrics = class_eval(fleet, wl, run_folder, workload)
    classes: dict[str, dict[str, Any]] = {}
    for k, n in enumerate(names):
        mine = [p for p in range(fleet.clients) if cls_of[p] == k]
        items = sum(sizes[p] for p in mine)
        got = sum(sizes[p] for p in mine if p in contributed_any)
        c = per_class[n]
        classes[n] = {
            "participation": c["contributed"] / c["sampled"] if c["sampled"] else None,
            "data_share": got / items if items else 0.0,
            "worst_peak_over_budget": c["worst"],
            "metric": class_metrics.get(n),
            "devices": len(mine),
            "kinds": c["kinds"],  # assignments by kind, over all rounds
        }
    values = [r[metric] for r in summary["rounds"] if r.get(metric) is not None]
    rounds = [  # the server's per-class metrics by class name, not index
        r
        if not isinstance(r.get("class_metrics"), dict)
        else {
            **r,
            "class_metrics": {
                names[int(k)]: v
                for k, v in r["class_metrics"].items()
                if str(k).isdigit() and int(k) < len(names)
            },
        }
        for r in summary["rounds"]
    ]
    return {
        "workload": workload or fleet.shape.workload,
        "participation": contributed_all / sampled_all if sampled_all else 0.0,
        "data_share": sum(sizes[p] for p in contributed_any) / total if total else 0.0,
        "final_metric": values[-1] if values else None,
        "best_metric": (max(values) if metric == "accuracy" else min(values))
        if values
        else None,
        "metric_name": metric,
        "rounds_to_target": None,
        "wall_s": wall_s,
        # simulated seconds of all rounds (server/simtime.py; None: an older run)
        "sim_s": summary["rounds"][-1].get("sim_elapsed_s")
        if summary["rounds"]
        else None,
        "classes": classes,
        "rounds": rounds,
    }


def partition_sizes(fleet: Fleet, wl: Workload) -> list[int]:
    """Training items of every device, as the clients split them (a workload with
    its own data: the examples of each node's ``load_data``)."""
    if wl.own_data:
        if wl.data_fn is None:  # every node trains the example batch
            return [wl.batch_size] * fleet.clients
        return [
            wl.node_data(p, fleet.clients).num_examples for p in range(fleet.clients)
        ]
    items = wl.private_items(fleet.shape.public_share)
    parts = split_indices(
        items.groups,
        fleet.clients,
        fleet.shape.split,
        seed=fleet.shape.seed,
        alpha=fleet.shape.dirichlet_alpha,
        classes=fleet.partition_class if fleet.shape.split == "natural" else None,
    )
    return [len(p) for p in parts]


def class_eval(
    fleet: Fleet, wl: Workload, run_folder: Path, workload: str | None
) -> dict[str, float]:
    """The final model's metric on each class's own held-out data.

    With a natural split a class's data is the held-out items of the groups it owns
    (for language models its first ``server.class_metrics.CLASS_EVAL_WINDOWS``); with iid or
    Dirichlet splits every class is measured on the whole held-out set.
    """
    import torch

    from server.persist import load_model

    path = run_folder / "model.safetensors"
    if not path.exists():
        return {}
    trained = get_workload(
        workload or fleet.shape.workload,
        batch_size=fleet.shape.batch_size or None,
        seq_len=fleet.shape.seq_len or None,
    )
    model = trained.make_model(0)
    state, _ = load_model(path)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    metric = wl.metric_name
    out: dict[str, float] = {}
    if wl.own_data:  # each class on its devices' own held-out batches
        from workloads.node_data import evaluate_batches

        for k, c in enumerate(fleet.classes):
            batches = [
                b
                for p in range(fleet.clients)
                if fleet.partition_class[p] == k
                for b in trained.eval_batches(p, fleet.clients)
            ]
            if batches:
                out[c.name] = evaluate_batches(model, batches, trained.loss_fn)[metric]
        return out
    if fleet.shape.split == "natural":
        items = class_test_items(
            wl,
            fleet.partition_class,
            public_share=fleet.shape.public_share,
            eval_windows=fleet.eval_windows,
        )
        for index, value in class_metrics(trained, model, items).items():
            out[fleet.classes[int(index)].name] = value
    else:
        whole = trained.evaluate(model, wl.items(train=False))[metric]
        out = {c.name: whole for c in fleet.classes}
    return out
