"""benchmarks/fleet_compare.py: its arguments, fleets and tables (no Ray)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "fleet_compare", ROOT / "benchmarks" / "fleet_compare.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_compare"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_defaults_and_options(bench):
    cfg = bench.parse([])
    assert cfg.fleet == "phones" and cfg.settings == ("pretrained", "scratch")
    assert set(cfg.strategies) == {
        "fleetfit",
        "exclude",
        "smallest-model",
        "heterofl",
        "fedrolex",
    }
    cfg = bench.parse(
        [
            "--lrs",
            "fleetfit=0.01,exclude=0.003",
            "--server-opt",
            "fedadam",
            "--second",
            "none",
            "--proximal-mu",
            "0.01",
        ]
    )
    assert dict(cfg.lrs) == {"fleetfit": 0.01, "exclude": 0.003}
    assert cfg.server_opt_config().name == "fedadam" and cfg.second == ""
    smoke = bench.parse(["--smoke"])
    assert smoke.rounds == 1 and smoke.local_steps == 1 and smoke.figures == ""
    variants = bench.parse(
        ["--strategies", "fleetfit,fleetfit-adapter,adapters", "--tag", "adapters"]
    )
    assert variants.strategies == ("fleetfit", "fleetfit-adapter", "adapters")
    assert variants.tag == "adapters"
    for bad in (
        ["--lrs", "fleetfit=x"],
        ["--settings", "warm"],
        ["--rounds", "0"],
        ["--strategies", "fleetfit,lora"],
        ["--tag", "a/b"],
        ["--disk", "lots"],
        ["--pretrain-lrs", "0.001,-1"],
        ["--pretrain-lrs", "fast"],
    ):
        with pytest.raises(SystemExit):
            bench.parse(bad)


def test_fleets_of_both_settings(bench):
    cfg = bench.parse(["--rounds", "3", "--local-steps", "4", "--proximal-mu", "0.1"])
    pre = bench.bench_fleet(cfg, "phones", "pretrained")
    scratch = bench.bench_fleet(cfg, "phones", "scratch")
    assert pre.pretrain is not None and pre.pretrain.steps == cfg.pretrain_steps
    # the default candidates: the fleet's lr (0.003) times 1/100, 1/30, 1/10, 1/3
    assert pre.pretrain.lrs == (0.00003, 0.0001, 0.0003, 0.001)
    given = bench.parse(["--pretrain-lrs", "0.01,0.001,0.001"])
    assert given.pretrain_lrs == (0.001, 0.01)
    assert bench.bench_fleet(given, "phones", "pretrained").pretrain.lrs == (
        0.001,
        0.01,
    )
    assert pre.shape.public_share == cfg.pretrain_share
    assert scratch.pretrain is None and scratch.shape.public_share == 0
    for f in (pre, scratch):
        assert f.num_server_rounds == 3 and f.shape.local_steps == 4
        assert f.shape.proximal_mu == 0.1
    assert any(c.disk_bytes > 0 for c in pre.classes)
    no_disk = bench.bench_fleet(bench.parse(["--disk", "0"]), "phones", "pretrained")
    assert all(c.disk_bytes == 0 for c in no_disk.classes)
    assert no_disk.budgets == pre.budgets


def _entry(final, sim, rounds, classes, participation=1.0):
    return {
        "workload": "w",
        "lr": 0.003,
        "participation": participation,
        "data_share": participation,
        "final_metric": final,
        "sim_s": sim,
        "wall_s": 1.0,
        "classes": {
            c: {"metric": m, "participation": p} for c, (m, p) in classes.items()
        },
        "rounds": rounds,
    }


def test_tables_at_equal_rounds_and_equal_time(bench):
    def r(n, t, m, lo):
        return {
            "round": n,
            "sim_elapsed_s": t,
            "perplexity": m,
            "class_metrics": {"lo": lo, "hi": m},
        }

    result = {
        "metric_name": "perplexity",
        "strategies": {
            # slower per round: at 20 simulated s it has done one round only
            "fleetfit": _entry(
                10.0,
                40.0,
                [r(1, 20.0, 30.0, 31.0), r(2, 40.0, 10.0, 11.0)],
                {"lo": (11.0, 1.0), "hi": (10.0, 1.0)},
            ),
            "exclude": _entry(
                15.0,
                20.0,
                [r(1, 10.0, 25.0, 40.0), r(2, 20.0, 15.0, 35.0)],
                {"lo": (35.0, 0.0), "hi": (15.0, 1.0)},
                participation=0.5,
            ),
        },
    }
    result["strategies"]["fleetfit"]["classes"]["lo"]["kinds"] = {"part": 1, "full": 2}
    # slower still: at 40 s (fleetfit's end) it has done one of its rounds, which
    # the shortest run's end (20 s) would not separate from fleetfit's first round
    result["strategies"]["slow"] = _entry(
        12.0,
        60.0,
        [r(1, 30.0, 20.0, 21.0), r(2, 60.0, 12.0, 12.5)],
        {"lo": (12.5, 1.0), "hi": (12.0, 1.0)},
    )
    text, checks = bench.tables(result)
    c = dict(checks)
    assert c["fleetfit: 100% of sampled devices contribute"]
    assert c["better than exclude, overall, equal rounds"]
    assert not c["better than exclude, overall, equal simulated time"]  # 30 vs 15
    assert c["better than exclude on lo's data, equal rounds"]
    assert c["better than exclude on lo's data, equal simulated time"]  # 31 vs 35
    assert "| lo* |" in text and "| hi |" in text
    assert "30.00 (1)" in text and "15.00 (2)" in text
    assert "| lo | full 2, part 1 | - | - |" in text  # the work each class was given
    # pair by pair: fleetfit and slow at 40 s (fleetfit 10 after 2 rounds, slow 20
    # after 1), fleetfit and exclude at 20 s (30 after 1, 15 after 2)
    assert c["better than slow, overall, equal simulated time"]
    assert c["better than slow on lo's data, equal simulated time"]  # 11 vs 21
    assert "| slow | 40 | 10.00 (2) | 20.00 (1) | 11.00 | 21.00 |" in text
    assert "| exclude | 20 | 30.00 (1) | 15.00 (2) | 31.00 | 35.00 |" in text
    pairs = bench.pairwise(result["strategies"], "perplexity")
    assert set(pairs) == {"exclude", "slow"} and pairs["slow"][0] == 40.0
    result["strategies"]["slow"]["sim_s"] = 0  # trained nothing: no pair
    assert set(bench.pairwise(result["strategies"], "perplexity")) == {"exclude"}
    # without exclude no class is left out: the pair table has no class columns
    del result["strategies"]["exclude"]
    result["strategies"]["slow"]["sim_s"] = 60.0
    text, _ = bench.tables(result)
    assert "| against | at simulated s | fleetfit | other |\n" in text
    assert "| slow | 40 | 10.00 (2) | 20.00 (1) |\n" in text


def test_merge_joins_strategies_of_one_fleet(bench, tmp_path):
    fleet = {"name": "phones", "pretrain": None}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(
        '{"fleet": {"name": "phones", "pretrain": null}, "metric_name": "perplexity",'
        ' "strategies": {"fleetfit": {"final_metric": 1.0}}}'
    )
    b.write_text(
        '{"fleet": {"name": "phones", "pretrain": null}, "metric_name": "perplexity",'
        ' "strategies": {"exclude": {"final_metric": 2.0}}}'
    )
    merged = bench.merge([str(a), str(b)])
    assert merged["fleet"] == fleet
    assert list(merged["strategies"]) == ["fleetfit", "exclude"]
    c = tmp_path / "c.json"
    c.write_text('{"fleet": {"name": "edge"}, "strategies": {}}')
    with pytest.raises(ValueError, match="another fleet"):
        bench.merge([str(a), str(c)])
