"""The GPU layout model against published runs (partition/references.toml): the
held-out errors docs/partition.md reports, fit verdicts, flag validation, the
TP-divided recompute memory and the command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from partition import gpu
from partition.gpu import GpuSystem, evaluate_given, memory_bytes
from partition.gpu_refs import errors, load, summary
from partition.gpu_spec import MODELS, TransformerSpec

DOCS = Path(__file__).resolve().parents[2] / "docs" / "partition.md"


@pytest.fixture(scope="module")
def runs():
    sources, rows = load()
    assert len({s["id"] for s in sources}) >= 3
    return rows


def _stated(half: str) -> tuple[float, float]:
    m = re.search(
        rf"{half}: median \|error\| ([0-9.]+)%, worst ([0-9.]+)%", DOCS.read_text()
    )
    assert m, f"docs/partition.md states no {half} error"
    return float(m.group(1)) / 100, float(m.group(2)) / 100


@pytest.mark.parametrize("half", ["calibration", "held-out"])
def test_errors_are_what_the_docs_report(runs, half):
    med, worst = summary(errors(runs, half))
    stated_med, stated_worst = _stated(half)
    assert med == pytest.approx(stated_med, abs=0.0006)
    assert worst == pytest.approx(stated_worst, abs=0.0006)


def test_held_out_meets_the_goal_and_the_stated_uncertainty(runs):
    med, worst = summary(errors(runs, "held-out"))
    assert med <= 0.10 and worst <= 0.25
    assert worst <= gpu.UNCERTAINTY


def test_halves_alternate_within_each_source(runs):
    by_source: dict[str, list[str]] = {}
    for r in runs:
        if r.half != "memory":
            by_source.setdefault(r.source, []).append(r.half)
    for halves in by_source.values():
        assert halves[::2] == ["calibration"] * len(halves[::2])
        assert halves[1::2] == ["held-out"] * len(halves[1::2])


def test_fit_verdicts_and_measured_memory(runs):
    not_fitting = [r for r in runs if not r.fits]
    assert len(not_fitting) >= 3
    for r in runs:
        lay = r.predict()
        assert lay.fits == r.fits, r.label
        if r.memory_gib and r.half != "memory":  # bf16 runs; FP8 rows: see docs
            assert lay.memory_bytes / 2**30 == pytest.approx(r.memory_gib, rel=0.15)


def test_full_recompute_keeps_the_input_divided_by_tp():
    spec = MODELS["llama3-70b"]
    kw = dict(dp=1, pp=1, microbatch_size=1, recompute="full", sharding="ddp")
    one = gpu.analytic_profile(spec, tp=1, **kw).blocks[1].costs[1]
    eight = gpu.analytic_profile(spec, tp=8, **kw).blocks[1].costs[1]
    assert one.input_bytes == 2 * spec.seq_len * spec.hidden
    assert eight.input_bytes == one.input_bytes // 8
    # no s x s scores: activations grow linearly with the sequence
    long = spec.with_seq(2 * spec.seq_len)
    per_token = gpu.activation_bytes_per_token(spec, "none")
    assert gpu.activation_bytes_per_token(long, "none") == per_token
    short = memory_bytes(spec, tp=8, **kw)
    assert memory_bytes(long, tp=8, **kw) < 2.2 * short


def test_405b_on_128_h100_fits_with_fsdp_and_tp():
    lay = evaluate_given(
        MODELS["llama3-405b"],
        GpuSystem.of("h100-96", 128),
        32 * 8192,
        dp=16,
        pp=1,
        tp=8,
        microbatch_size=2,
        recompute="full",
        sharding="fsdp",
    )
    assert lay.fits and lay.memory_bytes < 80 * 2**30


@pytest.mark.parametrize(
    "layout,needle",
    [
        (dict(dp=8, pp=3, tp=8), "is not the 64 GPUs"),
        (dict(dp=4, pp=1, tp=16), "does not divide the 8 GPUs of a host"),
        (dict(dp=1, pp=32, tp=2, stages_per_rank=3), "exceed the 80 layers"),
    ],
)
def test_a_given_layout_that_does_not_divide_says_why(layout, needle):
    spec = MODELS["llama3-70b"]
    kw = dict(microbatch_size=1, recompute="full", sharding="fsdp")
    with pytest.raises(ValueError, match=needle) as e:
        evaluate_given(spec, GpuSystem.of("a100-80", 64), 2**22, **layout, **kw)
    assert "\n" not in str(e.value)


def test_unknown_gpu_and_incomplete_config(tmp_path):
    with pytest.raises(ValueError, match="unknown GPU type 'b200'; give one of"):
        GpuSystem.of("b200", 8)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    with pytest.raises(ValueError, match="no num_attention_heads or n_head; add it"):
        TransformerSpec.from_config(cfg)


def test_config_files_of_llama_and_gpt2(tmp_path):
    llama = tmp_path / "llama.json"
    llama.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "vocab_size": 128256,
                "hidden_act": "silu",
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
            }
        )
    )
    spec = TransformerSpec.from_config(llama, seq_len=8192)
    assert spec.num_params == pytest.approx(8.03e9, rel=0.01) and spec.gated
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 12,
                "n_embd": 768,
                "n_head": 12,
                "vocab_size": 50257,
                "n_positions": 1024,
                "activation_function": "gelu_new",
            }
        )
    )
    g = TransformerSpec.from_config(gpt2)
    assert (g.tied, g.gated, g.ffn, g.seq_len) == (True, False, 3072, 1024)
    assert g.num_params == pytest.approx(124e6, rel=0.02)


def test_cli_evaluates_a_given_layout_and_refuses_unused_flags(capsys):
    from fleetfit.cli import main

    argv = [
        "partition",
        "plan",
        "--model",
        "llama3-8b",
        "--gpu",
        "h100-96",
        "--num-gpus",
        "8",
        "--pp",
        "1",
        "--tp",
        "1",
        "--micro-batch",
        "2",
        "--global-batch-tokens",
        str(16 * 8192),
        "--json",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "uncertainty" in out and json.loads(out.splitlines()[-1])["fits"]
    assert (
        main(
            [
                "partition",
                "plan",
                "--model",
                "llama3-8b",
                "--gpu",
                "h100-80",
                "--num-gpus",
                "8",
                "--max-microbatches",
                "4",
            ]
        )
        == 2
    )
    assert "--max-microbatches apply to --workload" in capsys.readouterr().err
    assert (
        main(
            [
                "partition",
                "plan",
                "--workload",
                "gpt-tiny",
                "--cluster",
                "c.toml",
                "--tp",
                "2",
            ]
        )
        == 2
    )
    assert "--tp apply to a GPU model" in capsys.readouterr().err
