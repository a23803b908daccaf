"""Published training runs against the GPU layout model: load them, split them,
fit the rate curve on one half, report the error on the other.

    python -m partition.gpu_refs            # the tables of docs/partition.md
    python -m partition.gpu_refs --fit      # refit RATE_MAX / D_HALF (calibration half)

The split is fixed before any fitting: within each source, in its own order, rows
1, 3, 5, ... calibrate and rows 2, 4, 6, ... are held out (``half``). The fit sees
only the calibration rows.
"""

from __future__ import annotations

import math
import statistics
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from partition import gpu_hw
from partition.gpu import GpuSystem, evaluate
from partition.gpu_hw import GiB, gpu_type
from partition.gpu_spec import MODELS, TransformerSpec

REFERENCES = Path(__file__).with_name("references.toml")


@dataclass(frozen=True)
class Run:
    """One published run: what ran, where, and the measured figure."""

    source: str
    label: str
    half: str  # calibration | held-out | memory
    spec: TransformerSpec
    gpu: str
    layout: dict[str, Any]
    tokens_per_s_per_gpu: float | None  # converted to one convention
    memory_gib: float | None
    fits: bool
    flash: bool = True  # a fused attention kernel (not in 2021's Megatron-LM)

    @property
    def global_batch_tokens(self) -> int:
        return int(self.layout["batch"]) * self.spec.seq_len

    def predict(self, gpu: gpu_hw.GpuType | None = None) -> Any:
        lay = self.layout
        system = GpuSystem(gpu or gpu_type(self.gpu), int(lay["gpus"]), self.gpu)
        out = evaluate(
            self.spec,
            system,
            self.global_batch_tokens,
            dp=lay["dp"],
            pp=lay["pp"],
            tp=lay["tp"],
            microbatch_size=lay["microbatch"],
            recompute=lay["recompute"],
            sharding=lay["sharding"],
            stages_per_rank=lay.get("v", 1),
            require_fit=False,
            flash_attention=self.flash,
        )
        assert out is not None, f"{self.label}: not a valid layout"
        return out


def _spec(row: dict[str, Any]) -> TransformerSpec:
    m = row["model"]
    if isinstance(m, str):
        spec = MODELS[m]
    else:
        spec = TransformerSpec(
            row["label"],
            m["layers"],
            m["hidden"],
            m["ffn"],
            m["heads"],
            m.get("kv_heads", m["heads"]),
            m["vocab"],
            m["seq"],
            m.get("gated", True),
            m.get("tied", False),
        )
    return spec.with_seq(row.get("seq"))


def _tokens_per_s(row: dict[str, Any], spec: TransformerSpec) -> float:
    if row["convention"] == "tokens_per_s_per_gpu":
        return float(row["figure"])
    assert row["convention"] == "narayanan_tflops", row["convention"]
    # eq. 3 of Narayanan et al. 2021, per token: 96 l h^2 (1 + s/6h + V/16lh)
    L, h, s, V = spec.num_layers, spec.hidden, spec.seq_len, spec.vocab
    per_token = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return float(row["figure"]) * 1e12 / per_token


def load(path: Path = REFERENCES) -> tuple[list[dict[str, Any]], list[Run]]:
    """The sources and the runs of ``references.toml``, each run with its half."""
    data = tomllib.loads(path.read_text())
    runs: list[Run] = []
    seen: dict[str, int] = {}
    for row in data["runs"]:
        spec = _spec(row)
        k = seen.get(row["source"], 0)
        seen[row["source"]] = k + 1
        runs.append(
            Run(
                row["source"],
                row["label"],
                "calibration" if k % 2 == 0 else "held-out",
                spec,
                row["gpu"],
                row["layout"],
                _tokens_per_s(row, spec),
                row.get("memory_gib"),
                True,
                row.get("flash", True),
            )
        )
    for row in data.get("memory", []):
        runs.append(
            Run(
                row["source"],
                row["label"],
                "memory",
                _spec(row),
                row["gpu"],
                row["layout"],
                None,
                row.get("memory_gib"),
                bool(row["fits"]),
            )
        )
    return data["sources"], runs


def step_error(run: Run, gpu: gpu_hw.GpuType | None = None) -> float:
    """Predicted over published tokens/s/GPU, minus one."""
    lay = run.predict(gpu)
    assert run.tokens_per_s_per_gpu is not None
    return lay.tokens_per_s / lay.num_gpus / run.tokens_per_s_per_gpu - 1


def errors(runs: list[Run], half: str) -> list[float]:
    return [step_error(r) for r in runs if r.half == half]


def summary(errs: list[float]) -> tuple[float, float]:
    """(median, worst) of the absolute errors."""
    a = [abs(e) for e in errs]
    return statistics.median(a), max(a)


def fit(runs: list[Run]) -> tuple[dict[str, float], float, float]:
    """``RATE_MAX`` per family, the shared ``D_HALF`` and ``MEMORY_PASSES`` that
    minimise the squared log error on the calibration half only (a grid search)."""
    cal = [r for r in runs if r.half == "calibration"]
    best: tuple[float, dict[str, float], float, float] | None = None
    for passes in range(0, 13):
        gpu_hw.MEMORY_PASSES = float(passes)
        for d_half in range(0, 2049, 128):
            tops: dict[str, float] = {}
            loss = 0.0
            for family in sorted({gpu_type(r.gpu).family for r in cal}):
                rows = [r for r in cal if gpu_type(r.gpu).family == family]
                best_f: tuple[float, float] | None = None
                for top in range(100, 801, 5):
                    total = 0.0
                    for r in rows:
                        g = replace(gpu_type(r.gpu), rate_max=top * 1e12, d_half=d_half)
                        total += math.log1p(step_error(r, g)) ** 2
                    if best_f is None or total < best_f[0]:
                        best_f = (total, top * 1e12)
                assert best_f is not None
                tops[family] = best_f[1]
                loss += best_f[0]
            if best is None or loss < best[0]:
                best = (loss, tops, float(d_half), float(passes))
    assert best is not None
    return best[1], best[2], best[3]


def report(runs: list[Run]) -> str:
    """The markdown tables of docs/partition.md."""
    lines = [
        "| half | source | run | GPU | published tok/s/GPU | predicted | error |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in runs:
        if r.half == "memory":
            continue
        lay = r.predict()
        pred = lay.tokens_per_s / lay.num_gpus
        assert r.tokens_per_s_per_gpu is not None
        lines.append(
            f"| {r.half} | {r.source} | {r.label} | {r.gpu} | "
            f"{r.tokens_per_s_per_gpu:,.0f} | {pred:,.0f} | "
            f"{pred / r.tokens_per_s_per_gpu - 1:+.1%} |"
        )
    for half in ("calibration", "held-out"):
        med, worst = summary(errors(runs, half))
        lines.append(f"\n{half}: median |error| {med:.1%}, worst {worst:.1%}")
    lines += [
        "",
        "| source | run | GPU | measured GiB | predicted GiB | error | published "
        "verdict | predicted |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in runs:
        if r.memory_gib is None and r.half != "memory":
            continue
        lay = r.predict()
        pred = lay.memory_bytes / GiB
        meas = f"{r.memory_gib:.1f}" if r.memory_gib else "-"
        err = f"{pred / r.memory_gib - 1:+.1%}" if r.memory_gib else "-"
        lines.append(
            f"| {r.source} | {r.label} | {r.gpu} | {meas} | {pred:.1f} | {err} | "
            f"{'trained' if r.fits else 'does not fit'} | "
            f"{'fits' if lay.fits else 'does not fit'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    _, all_runs = load()
    if "--fit" in sys.argv:
        tops, d_half, passes = fit(all_runs)
        print(f"RATE_MAX = {tops}\nD_HALF = {d_half}\nMEMORY_PASSES = {passes}")
    else:
        print(report(all_runs))
