"""Memory plans for transformers models as they are (the unit path), measured.

Part 1, GPT-2: transformers ``GPT2LMHeadModel`` with GPT-2's own config (124M, vocab
50,257; ``--model medium`` for 355M), AdamW fp32, batch 4 x 512 random tokens. Rows:
plain training, then fleetfit's plans at budgets (``plain`` = plain's measured peak;
``min`` = the smallest plan), each trained 3 steps in a fresh measured child process
(peak RSS above the import baseline, transformers imported before it), side by side in
one run: predicted and measured peak, step time (median after the first) and its ratio
to plain's.

By default every child reads the model's weights from a state file written once by the
parent (``memory.materialize``: built without weights, read unit by unit, streamed units
straight into the store), as a user's pretrained checkpoint would be read, so loading
counts inside the plan; ``--in-memory`` has each child build the model itself instead
(its whole construction then counts, whatever the plan).

Part 2 (``--suite``): the test suite's architectures (GPT-2, Llama, BERT, ViT, T5) at
larger sizes: plain peak, smallest plan, their ratio, predicted vs measured, and the
step-time ratio of the plans at 1/3 and 1/4 of plain's peak.

    python benchmarks/memory_transformers.py                      # GPT-2 small
    python benchmarks/memory_transformers.py --budgets plain,384MiB,256MiB,min
    python benchmarks/memory_transformers.py --model medium --budgets 512MiB
    python benchmarks/memory_transformers.py --suite
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from memory.cost import predict  # noqa: E402
from memory.errors import BudgetError, MeasurementError  # noqa: E402
from memory.measure import measure_in_child  # noqa: E402
from memory.overhead import workload_runtime_bytes  # noqa: E402
from memory.sizes import format_bytes, parse_bytes  # noqa: E402
from memory.spec import MemoryPlan  # noqa: E402
from memory.unit_profile import plan_units, unit_profiles  # noqa: E402


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )


def gpt2(size: str = "small", batch: int = 4, seq: int = 512, seed: int = 0):
    """GPT-2 with its own config (random weights): the benchmark's factory."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    dims = {"small": (768, 12, 12), "medium": (1024, 24, 16)}[size]
    cfg = tf.GPT2Config(n_embd=dims[0], n_layer=dims[1], n_head=dims[2])
    cfg.use_cache = False
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator())
    return model, ({"input_ids": ids, "labels": ids.clone()}, None)


def suite(name: str):
    """A test-suite architecture at the benchmark's size."""
    from tests.hf.models import build

    return build(name, "bench")


def _run(
    factory: str,
    kwargs: dict,
    plan: MemoryPlan | None,
    steps: int,
    tmp: str,
    init_state: str | None,
):
    return measure_in_child(
        "memory.step:train_measured",
        dict(
            factory=factory,
            factory_kwargs=kwargs,
            plan=None if plan is None else plan.to_dict(),
            steps=steps,
            offload_dir=tmp,
            init_state=init_state,
        ),
        preload=("transformers", "benchmarks.memory_transformers", "tests.hf.models"),
        warmup=("memory.step:warm_up", {"factory": factory, "factory_kwargs": kwargs}),
        timeout_s=3600,
    )


def _plan_str(plan: MemoryPlan) -> str:
    rec = sum(b.activations == "recompute" for b in plan.blocks)
    stream = sum(b.state == "stream" for b in plan.blocks)
    disk = sum(b.offload_inputs for b in plan.blocks)
    off = sum(b.activations == "offload" for b in plan.blocks)
    return (
        f"m={plan.num_microbatches} c={plan.loss_chunks} R{rec} O{off} S{stream} "
        f"D{disk}/{len(plan.blocks)}"
    )


def bench(
    factory: str,
    kwargs: dict,
    budgets: list[str],
    steps: int,
    tmp: str,
    from_file: bool = True,
    plain_row: bool = True,
) -> list[dict[str, Any]]:
    from memory.materialize import save_state
    from memory.profile import loading_from_file
    from memory.step import load_factory

    model, (x, y) = load_factory(factory)(**kwargs)
    runtime = workload_runtime_bytes(factory, kwargs, offload_dir=tmp)
    profiles = unit_profiles(model, x, y, runtime_bytes=runtime)
    init_state = None
    if from_file:  # the checkpoint every child reads (outside the measurement)
        init_state = os.path.join(tmp, "init.safetensors")
        save_state(model, init_state)
        profiles = {c: loading_from_file(p) for c, p in profiles.items()}
    plain_pred = predict(
        profiles[1], MemoryPlan.plain([b.name for b in profiles[1].blocks])
    ).peak_bytes
    del model
    rows: list[dict[str, Any]] = []
    plain = None
    if plain_row:
        plain = _run(factory, kwargs, None, steps, tmp, init_state)
        rows.append(
            dict(
                row="plain",
                budget=None,
                predicted=plain_pred,
                measured=plain.peak_bytes,
                step_s=plain.result["step_s"],
                ratio=1.0,
                plan="plain",
            )
        )
        print(_fmt(rows[-1]), flush=True)
    else:
        print(
            f"{'plain':>10}  not run (--no-plain); predicted "
            f"{format_bytes(plain_pred)}",
            flush=True,
        )
    for b in budgets:
        if plain is None and (b == "plain" or b.startswith("1/")):
            raise SystemExit(f"budget {b!r} needs the plain row; drop --no-plain")
        if b == "plain":
            budget: int | None = plain.peak_bytes
        elif b == "min":
            budget = None
        elif b.startswith("1/"):
            budget = plain.peak_bytes // int(b[2:])
        else:
            budget = parse_bytes(b)
        try:
            plan, _ = plan_units(profiles, budget, disk_budget_bytes=2**34)
        except BudgetError as e:
            rows.append(dict(row=b, budget=budget, error=str(e)))
            print(f"{b:>10}  no plan: {e}", flush=True)
            continue
        try:
            m = _run(factory, kwargs, plan, steps, tmp, init_state)
        except MeasurementError as e:
            rows.append(dict(row=b, budget=budget, error=str(e)[-300:]))
            print(f"{b:>10}  failed: {str(e)[-300:]}", flush=True)
            continue
        rows.append(
            dict(
                row=b,
                budget=budget,
                predicted=plan.predicted_peak_bytes,
                measured=m.peak_bytes,
                step_s=m.result["step_s"],
                ratio=None
                if plain is None
                else m.result["step_s"] / plain.result["step_s"],
                plan=_plan_str(plan),
                losses_equal=None
                if plain is None
                else max(
                    abs(a - b_) / abs(b_)
                    for a, b_ in zip(m.result["losses"], plain.result["losses"])
                ),
            )
        )
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r: dict) -> str:
    budget = "-" if r.get("budget") is None else format_bytes(r["budget"])
    return (
        f"{r['row']:>10} {budget:>11} {format_bytes(r['predicted']):>11} "
        f"{format_bytes(r['measured']):>11} {r['predicted'] / r['measured']:>6.3f} "
        f"{r['step_s']:>8.2f} "
        f"{'-' if r['ratio'] is None else format(r['ratio'], '.2f'):>6}  {r['plan']}"
    )


HEAD = (
    f"{'row':>10} {'budget':>11} {'predicted':>11} {'measured':>11} {'p/m':>6} "
    f"{'step s':>8} {'x plain':>6}  plan"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", choices=["small", "medium"])
    ap.add_argument("--budgets", default="plain,640MiB,512MiB,384MiB,256MiB,min")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--suite", action="store_true")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument(
        "--in-memory",
        action="store_true",
        help="each child builds the model itself instead of reading a state file",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument(
        "--no-plain",
        action="store_true",
        help="skip the plain row (a model whose plain step does not fit this machine)",
    )
    args = ap.parse_args(argv)
    import tempfile

    print(machine(), flush=True)
    out: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        if args.suite:
            from tests.hf.models import NAMES

            for name in NAMES:
                print(f"\n{name} (tests/hf/models.py, size 'bench')\n{HEAD}")
                rows = bench(
                    "benchmarks.memory_transformers:suite",
                    {"name": name},
                    ["1/3", "1/4", "min"],
                    args.steps,
                    tmp,
                    not args.in_memory,
                )
                out[name] = rows
        else:
            print(
                f"\nGPT-2 {args.model} (transformers GPT2LMHeadModel), batch 4 x 512, "
                f"AdamW fp32, {args.steps} steps, weights "
                f"{'built in memory' if args.in_memory else 'read from a file'}\n{HEAD}"
            )
            out["gpt2"] = bench(
                "benchmarks.memory_transformers:gpt2",
                {"size": args.model},
                args.budgets.split(","),
                args.steps,
                tmp,
                not args.in_memory,
                plain_row=not args.no_plain,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
