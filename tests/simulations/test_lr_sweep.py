"""The learning-rate rule (issue 16 item 5) on a stubbed run function (no Ray)."""

from __future__ import annotations

import math

import pytest

from simulations.fleet import load_fleet
from simulations.lr_sweep import choose, format_sweep, lr_grid, sweep, with_lr


def test_grid_is_log_spaced_and_ascending():
    assert lr_grid(0.003) == (0.001, 0.003, 0.009)
    assert lr_grid(0.01, num=1) == (0.01,)
    five = lr_grid(1.0, num=5, factor=10.0)
    assert five == (0.01, 0.1, 1.0, 10.0, 100.0)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="positive"):
            lr_grid(bad)


def test_choose_best_ties_to_smaller_and_missing_loses():
    rows = [
        {"strategy": "a", "lr": 0.01, "final_metric": 20.0},
        {"strategy": "a", "lr": 0.001, "final_metric": 20.0},  # tie: smaller wins
        {"strategy": "a", "lr": 0.003, "final_metric": 25.0},
        {"strategy": "b", "lr": 0.001, "final_metric": None},
        {"strategy": "b", "lr": 0.003, "final_metric": math.nan},
        {"strategy": "b", "lr": 0.01, "final_metric": 90.0},
        {"strategy": "c", "lr": 0.003, "final_metric": None},
    ]
    assert choose(rows, "perplexity") == {"a": 0.001, "b": 0.01, "c": 0.003}
    acc = [
        {"strategy": "a", "lr": 0.1, "final_metric": 0.5},
        {"strategy": "a", "lr": 0.3, "final_metric": 0.7},
    ]
    assert choose(acc, "accuracy") == {"a": 0.3}
    assert choose(list(reversed(rows)), "perplexity") == choose(rows, "perplexity")


def test_sweep_runs_every_candidate_the_same_way_and_records_the_table(tmp_path):
    fleet = load_fleet("phones")
    calls = []
    score = {  # perplexity by (strategy, lr): each strategy has its own optimum
        ("fleetfit", 0.001): 30.0,
        ("fleetfit", 0.003): 22.0,
        ("fleetfit", 0.009): 22.0,  # tie with 0.003: the smaller lr is chosen
        ("exclude", 0.001): 40.0,
        ("exclude", 0.003): 35.0,
        ("exclude", 0.009): 31.0,
    }

    def run(f, strategy, out, **kw):
        calls.append((strategy, f.shape.lr, f.num_server_rounds, out.name, kw))
        return {
            "metric_name": "perplexity",
            "final_metric": score[(strategy, f.shape.lr)],
            "wall_s": 1.0,
            "sim_s": 2.0,
        }

    table = sweep(
        fleet,
        ["fleetfit", "exclude"],
        [0.009, 0.001, 0.003],
        tmp_path,
        rounds=2,
        run=run,
        client_measure="inline",
    )
    assert table["chosen"] == {"fleetfit": 0.003, "exclude": 0.009}
    assert table["lrs"] == [0.001, 0.003, 0.009]
    assert table["rounds"] == 2 and table["metric_name"] == "perplexity"
    assert len(table["rows"]) == 6
    assert {c[2] for c in calls} == {2}  # one horizon for all
    assert all(c[4]["pretrain_dir"] == tmp_path / "pretrain" for c in calls)
    assert all(c[4]["client_measure"] == "inline" for c in calls)
    assert calls[0][3] == "fleetfit-lr0.001"
    md = format_sweep(table)
    assert "| fleetfit | 30 | 22* | 22 | 0.003 |" in md
    assert "| exclude | 40 | 35 | 31* | 0.009 |" in md


def test_with_lr_keeps_the_pretraining_lr(tmp_path):
    import tomllib

    from simulations.fleet import parse_fleet, shipped_fleet

    data = tomllib.loads(shipped_fleet("phones").read_text())
    data["pretrain"] = {"steps": 5}
    fleet = parse_fleet(data)
    moved = with_lr(fleet, 0.01)
    assert moved.shape.lr == 0.01
    assert moved.pretrain is not None and fleet.pretrain is not None
    assert moved.pretrain.lr == fleet.pretrain.lr == fleet.shape.lr


def test_sweep_rejects_bad_input(tmp_path):
    fleet = load_fleet("phones")
    with pytest.raises(ValueError, match="rounds"):
        sweep(fleet, ["fleetfit"], [0.001], tmp_path, rounds=0, run=lambda *a, **k: {})
    with pytest.raises(ValueError, match="positive"):
        sweep(fleet, ["fleetfit"], [0.0], tmp_path, rounds=1, run=lambda *a, **k: {})


def test_report_records_the_sweep():
    from simulations.report import _lr_lines

    rows = [
        {"strategy": "fleetfit", "lr": 0.001, "final_metric": 18.5},
        {"strategy": "fleetfit", "lr": 0.003, "final_metric": 19.2},
    ]
    table = {
        "metric_name": "perplexity",
        "rounds": 1,
        "local_steps": 5,
        "lrs": [0.001, 0.003],
        "rows": rows,
        "chosen": choose(rows, "perplexity"),
    }
    compare = {
        "server_opt": {"name": "fedavg", "lr": 1.0},
        "lr_sweep": table,
        "strategies": {"fleetfit": {"lr": 0.001}},
    }
    text = "\n".join(_lr_lines(compare))
    assert "## Learning rates" in text and "fleetfit 0.001" in text
    assert "| fleetfit | 18.5* | 19.2 | 0.001 |" in text
    assert _lr_lines({"strategies": {}}) == []
