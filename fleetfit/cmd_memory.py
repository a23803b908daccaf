"""``fleetfit memory profile|plan|run``: what a training step costs, the plan that fits
a budget, and a measured run under it.

    fleetfit memory profile --workload gpt-byte
    fleetfit memory plan --workload gpt2-small --memory-budget 2GiB
    fleetfit memory run --workload gpt-byte --memory-budget 300MB --steps 3 --json
    fleetfit memory run --workload gpt-byte --plain --steps 3

With ``--json`` each prints one JSON object on one line, the last line of standard
output; logs and progress go to standard error.

A ``module:function`` workload may return any model: inputs as a tensor, a tuple or a
dict (``model(**inputs)``), no targets, and no loss_fn (the model's own
``output.loss``, as transformers computes it from ``labels``). Such a workload, and one
whose children do not run as a chain, is profiled, planned and run per unit
(``memory.units``: the model's layers and the modules around them, its own forward
unchanged); the JSON then also has ``"any_model": true`` and the ``"units"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Annotated, Any

import typer

from fleetfit import options as opt
from fleetfit.args import output_dir, output_file, positive_float
from wire.shape import RunShape

# Budgets and peaks count what training adds above the runtime's import footprint
# (torch and the workload's imports, about 290-350 MiB on CPU): a process trained
# under --memory-budget 300MB peaks near 300 MiB + that footprint.
NOT_INCLUDED = (
    "above the runtime's import footprint (torch and the workload's imports, "
    "about 290-350 MiB, not included here; {where})"
)


def register(app: typer.Typer) -> None:
    memory = typer.Typer(
        help="Know what a training step costs, plan it into a byte budget, and run it "
        "with its real peak measured.",
        short_help="profile a training step, plan it into a budget, run it measured",
        no_args_is_help=True,
    )
    memory.command(
        "profile", help="Per-block costs of one training step: memory and time."
    )(profile_command)
    memory.command(
        "plan",
        help="The fastest plan that fits --memory-budget (without it, the smallest "
        "plan).",
    )(plan_command)
    memory.command(
        "run",
        help="Train --steps steps under the plan (or --plain) in a child process, "
        "its peak memory measured.",
    )(run_command)
    app.add_typer(memory, name="memory")


InitState = Annotated[
    str | None,
    typer.Option(
        metavar="FILE",
        help="module:function workloads: read the model's weights from this "
        "safetensors file unit by unit, streamed units straight to disk, so that "
        "loading stays within the plan (default: the factory builds the model whole, "
        "which then counts in the peak)",
        rich_help_panel=opt.MEMORY,
    ),
]
AllowMicrobatching = Annotated[
    bool,
    typer.Option(
        "--allow-microbatching",
        help="allow micro-batches for models with batch-dependent layers "
        "(BatchNorm); results then differ from plain training",
        rich_help_panel=opt.MEMORY,
    ),
]


def profile_command(
    workload: opt.Workload = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    offload_dir: opt.OffloadDir = None,
    json: opt.Json = False,
) -> int:
    return run(_namespace("profile", locals()))


def plan_command(
    workload: opt.Workload = None,
    memory_budget: opt.MemoryBudget = None,
    disk_budget: opt.DiskBudget = None,
    offload_dir: opt.OffloadDir = None,
    init_state: InitState = None,
    allow_microbatching: AllowMicrobatching = False,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    json: opt.Json = False,
) -> int:
    return run(_namespace("plan", locals()))


def run_command(
    workload: opt.Workload = None,
    memory_budget: opt.RunMemoryBudget = None,
    plain: Annotated[
        bool,
        typer.Option(
            "--plain",
            help="plain training (no plan), measured the same way",
            rich_help_panel=opt.MEMORY,
        ),
    ] = False,
    disk_budget: opt.DiskBudget = None,
    offload_dir: opt.OffloadDir = None,
    init_state: InitState = None,
    allow_microbatching: AllowMicrobatching = False,
    steps: Annotated[
        int,
        typer.Option(min=1, help="training steps", rich_help_panel=opt.TRAINING),
    ] = 3,
    lr: Annotated[
        float,
        typer.Option(
            parser=opt.checked(positive_float),
            metavar="RATE",
            help="AdamW learning rate",
            rich_help_panel=opt.TRAINING,
        ),
    ] = 1e-3,
    seed: Annotated[
        int, typer.Option(help="seed of all randomness", rich_help_panel=opt.TRAINING)
    ] = 0,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    save: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="write the final parameters and buffers (safetensors)",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = None,
    json: opt.Json = False,
) -> int:
    return run(_namespace("run", locals()))


def _namespace(verb: str, given: dict[str, Any]) -> argparse.Namespace:
    """The options of ``verb`` with those it lacks at their defaults."""
    args = argparse.Namespace(
        verb=verb,
        memory_budget=None,
        disk_budget=None,
        init_state=None,
        allow_microbatching=False,
        plain=False,
        save=None,
    )
    vars(args).update(given)
    args.workload = args.workload or RunShape().workload
    return args


def _check_init_state(path: str, units: bool) -> None:
    """Refuse an ``--init-state`` that cannot be read, in one line."""
    from memory.errors import MemoryPlanError
    from memory.tensorfile import TensorFile

    if not units:
        raise ValueError(
            "--init-state is for module:function workloads planned per unit; a "
            "built-in workload reads its weights from a file already"
        )
    try:
        TensorFile(path).close()
    except MemoryPlanError as e:
        raise ValueError(f"--init-state {path}: {e}") from e


def _emit(args: argparse.Namespace, text: str, obj: dict[str, Any]) -> None:
    if args.json:
        print(text, file=sys.stderr)
        print(json.dumps(obj, sort_keys=True))
    else:
        print(text)


def run(args: argparse.Namespace) -> int:
    from memory.chain_costs import is_batch_dependent
    from memory.cost import predict
    from memory.plan import min_budget_bytes, plan_memory
    from memory.profile import loading_from_file
    from memory.sizes import format_bytes, parse_bytes
    from memory.spec import MemoryPlan
    from memory.unit_profile import plan_units
    from partition.run import (
        measured_any_model_run,
        measured_run,
        profile_any_model,
        profile_workload,
        uses_units,
    )
    from workloads import get_workload

    wl = get_workload(
        args.workload, batch_size=args.batch or None, seq_len=args.seq or None
    )
    if args.offload_dir is not None:
        output_dir("--offload-dir", args.offload_dir)
    if getattr(args, "save", None) is not None:
        output_file("--save", args.save, "model.safetensors")
    budget = disk = None
    if args.verb != "profile":
        if args.memory_budget is not None:
            budget = parse_bytes(args.memory_budget, what="--memory-budget")
        elif args.verb == "run" and not args.plain:
            raise ValueError("--memory-budget is required for run (or use --plain)")
        if args.disk_budget is not None:
            disk = parse_bytes(args.disk_budget, what="--disk-budget", allow_zero=True)
    units = uses_units(wl)
    init_state = getattr(args, "init_state", None)
    if init_state is not None:
        _check_init_state(init_state, units)
    print(
        f"profiling {wl.name} (batch {wl.batch_size}"
        + (f" x {wl.seq_len} tokens" if wl.seq_len else "")
        + ")"
        + (f" per unit: {_why_units(wl)}" if units else ""),
        file=sys.stderr,
    )
    profiles = None
    if units:
        profiles = profile_any_model(wl, offload_dir=args.offload_dir)
        profile = profiles[1]
    else:
        profile = profile_workload(wl, offload_dir=args.offload_dir)
    names = [b.name for b in profile.blocks]
    extra: dict[str, Any] = {"any_model": units}
    if units:
        extra["units"] = names
    if args.verb == "profile":
        _emit(
            args,
            _units_table(profile) if units else profile.table(),
            {"workload": wl.name, "profile": profile.to_dict(), **extra},
        )
        return 0

    plain_profile = profile
    if units:  # the child builds the model whole, unless it reads --init-state
        batch_dependent = profile.batch_dependent
        if init_state is not None and profiles is not None:
            profiles = {c: loading_from_file(p) for c, p in profiles.items()}
            profile = profiles[1]
    else:
        profile = loading_from_file(profile)
        with _torch_meta():
            model = wl.make_model(0)
        batch_dependent = is_batch_dependent(model)
    common = dict(
        disk_budget_bytes=disk,
        offload_dir=args.offload_dir,
        allow_microbatching=args.allow_microbatching or None,
        batch_dependent=batch_dependent,
    )
    smallest = min(
        min_budget_bytes(p, **common)  # type: ignore[arg-type]
        for p in (profiles.values() if profiles else [profile])
    )
    plan: MemoryPlan | None
    if args.verb == "run" and args.plain:
        plan = None
        pred = predict(plain_profile, MemoryPlan.plain(names))
        predicted_peak, predicted_s = pred.peak_bytes, pred.step_s
    else:
        if profiles:  # every loss chunk count the head allows
            plan, _ = plan_units(profiles, budget, **common)
        else:
            plan = plan_memory(profile, budget, batch_size=wl.batch_size, **common)  # type: ignore[arg-type]
        predicted_peak, predicted_s = plan.predicted_peak_bytes, plan.predicted_step_s
    summary: dict[str, Any] = {
        "workload": wl.name,
        "budget_bytes": budget,
        "disk_budget_bytes": disk,
        "min_budget_bytes": smallest,
        "predicted_peak_bytes": predicted_peak,
        "predicted_step_s": predicted_s,
        "plan": None if plan is None else plan.to_dict(),
        **extra,
    }
    lines = [
        _describe(plan) if plan is not None else "plain training",
        f"predicted peak {format_bytes(predicted_peak)}, step "
        f"{predicted_s:.3f} s; smallest budget that fits: {format_bytes(smallest)}",
        ("" if budget is None else f"budget {format_bytes(budget)}; ")
        + "budgets and peaks are "
        + NOT_INCLUDED.format(
            where="measured below"
            if args.verb == "run"
            else "`fleetfit memory run` measures it"
        ),
    ]
    if units and plan is not None:
        lines.insert(1, _unit_choices(plan))
    if args.verb == "plan":
        _emit(args, "\n".join(lines), summary)
        return 0

    print("\n".join(lines), file=sys.stderr)
    print(f"running {args.steps} steps in a measured child process", file=sys.stderr)
    if units:
        m, result = measured_any_model_run(
            wl,
            plan,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            offload_dir=args.offload_dir,
            save=args.save,
            init_state=init_state,
        )
    else:
        m, result = measured_run(
            wl.name,
            plan,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            batch_size=args.batch or None,
            seq_len=args.seq or None,
            offload_dir=args.offload_dir,
            save=args.save,
        )
    summary.update(
        measured_peak_bytes=m.peak_bytes,
        baseline_bytes=m.baseline_bytes,
        step_s=result["step_s"],
        step_times_s=result["step_times_s"],
        losses=result["losses"],
        within_budget=None if budget is None else m.peak_bytes <= budget,
    )
    base = m.baseline_bytes
    above = "above the import footprint"
    rows = [
        (
            "budget",
            "-"
            if budget is None
            else f"{format_bytes(budget)} above the runtime's {format_bytes(base)} "
            f"import footprint (process peak up to ~{format_bytes(budget + base)})",
        ),
        (
            "predicted peak",
            f"{format_bytes(predicted_peak)} {above} "
            f"(process ~{format_bytes(predicted_peak + base)})",
        ),
        (
            "measured peak",
            f"{format_bytes(m.peak_bytes)} {above} "
            f"(process {format_bytes(m.peak_bytes + base)})",
        ),
        ("import baseline (not counted)", format_bytes(base)),
        ("predicted step", f"{predicted_s:.3f} s"),
        ("measured step (median after the first)", f"{result['step_s']:.3f} s"),
        ("losses", " ".join(f"{x:.4f}" for x in result["losses"])),
    ]
    width = max(len(k) for k, _ in rows)
    _emit(args, "\n".join(f"{k:<{width}}  {v}" for k, v in rows), summary)
    if budget is not None and m.peak_bytes > budget:
        print(
            f"fleetfit: warning: the measured peak {format_bytes(m.peak_bytes)} "
            f"exceeds the budget {format_bytes(budget)} (both above the runtime's "
            f"{format_bytes(base)} import footprint)",
            file=sys.stderr,
        )
    return 0


def _describe(plan: Any) -> str:
    code = {
        ("keep", "resident"): "K",
        ("recompute", "resident"): "R",
        ("offload", "resident"): "O",
        ("recompute", "stream"): "S",
        ("keep", "stream"): "S",
        ("offload", "stream"): "S",
    }
    blocks = "".join(
        "D"
        if b.offload_inputs and b.state != "stream"
        else code[(b.activations, b.state)]
        for b in plan.blocks
    )
    legend = "K keep, R recompute, O offload, S stream"
    if "D" in blocks:  # units only: recompute with the inputs on disk
        legend += ", D recompute with inputs on disk"
    return (
        f"plan: {blocks} ({legend}), "
        f"{plan.num_microbatches} micro-batch(es), {plan.loss_chunks} loss chunk(s)"
    )


def _why_units(wl: Any) -> str:
    """Why ``wl`` is planned per unit, for people."""
    if not wl.any_model:
        return "its children do not run as a chain"
    import torch

    inputs, targets, loss_fn = wl.example
    why = (
        [] if isinstance(inputs, torch.Tensor) else [f"{type(inputs).__name__} inputs"]
    )
    if targets is None:
        why.append("no targets")
    if loss_fn is None:
        why.append("the model's own loss")
    return ", ".join(why)


def _units_table(profile: Any) -> str:
    """``Profile.table()`` with a name column as wide as the longest unit's, and the
    options the planner has for each unit (``memory.plan``: K keep, R recompute, O
    offload, S stream, D recompute with the inputs on disk)."""
    rows = profile.table().splitlines()
    names = [b.name for b in profile.blocks]
    width = max([14, *(len(n) + 2 for n in names)])
    out = [f"{'unit':<{width}}{rows[0][14:]}  options"]
    for row, b in zip(rows[1:], profile.blocks):
        rest = row[max(14, len(b.name)) :]
        out.append(f"{b.name:<{width}}{rest}  {' '.join(b.options)}")
    return "\n".join(out)


def _unit_choices(plan: Any) -> str:
    """Each unit with its choice: ``units: transformer.wte K, transformer.h.0 R``
    (the letters of ``_units_table``'s options)."""

    def letter(b: Any) -> str:
        if b.state == "stream":
            return "S"
        if b.offload_inputs:
            return "D"
        return {"keep": "K", "recompute": "R", "offload": "O"}[b.activations]

    return "units: " + ", ".join(f"{b.name} {letter(b)}" for b in plan.blocks)


class _torch_meta:  # noqa: N801
    """Build a model on the meta device (no memory) to inspect its layers."""

    def __enter__(self) -> None:
        import torch

        self._ctx = torch.device("meta")
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
