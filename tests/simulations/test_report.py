"""Reports of a strategy comparison, from a synthetic ``compare`` dict (no Ray)."""

from __future__ import annotations

import copy
import csv
import re

import pytest

from simulations.report import format_table, write_report

GiB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FILES = [
    "compare.csv",
    "rounds.csv",
    "metric.png",
    "participation.png",
    "peaks.png",
    "class_metric.png",
    "metric_time.png",
    "class_rounds.png",
    "report.md",
]


def _assignment(pid, kind, budget, peak, status="ok"):
    return {
        "node_id": 100 + pid,
        "partition_id": pid,
        "kind": kind,
        "status": status,
        "budget_bytes": budget,
        "measured_peak_bytes": peak,
    }


def _rounds(metric, values, assignments):
    rounds = []
    for i, v in enumerate(values, start=1):
        r = {
            "round": i,
            "accuracy": v if metric == "accuracy" else 0.3,
            "loss": 1.0 / i,
            "num_clients": len([a for a in assignments if a["status"] == "ok"]),
            "num_sampled": len(assignments),
            "assignments": assignments,
            "sim_round_s": 30.0 * len(assignments),
            "sim_elapsed_s": 30.0 * len(assignments) * i,
            "class_metrics": {"low": v, "mid": v},
        }
        if metric == "perplexity":
            r["perplexity"] = v
        rounds.append(r)
    return rounds


def make_compare(metric="accuracy"):
    acc = metric == "accuracy"
    fit = [0.5, 0.7, 0.85] if acc else [40.0, 20.0, 9.0]
    excl = [0.4, 0.55, 0.6] if acc else [50.0, 35.0, 30.0]
    small = [0.3, 0.45, 0.5] if acc else [60.0, 45.0, 40.0]
    full = [
        _assignment(0, "part", 1 * GiB, int(0.93 * GiB)),
        _assignment(1, "full", 4 * GiB, int(2.84 * GiB)),
        _assignment(2, "full", 4 * GiB, None, status="no reply"),
    ]
    excluded = [
        _assignment(0, "none", 1 * GiB, None, status="none"),
        _assignment(1, "full", 4 * GiB, int(2.9 * GiB)),
    ]
    return {
        "fleet": {
            "name": "phones",
            "file": "simulations/fleets/phones.toml",
            "workload": "gpt-byte" if not acc else "digits-cnn",
            "clients": 3,
            "rounds": 3,
            "seed": 7,
            "split": "natural",
            "classes": [
                {"name": "low", "share": 0.4, "clients": 1},
                {"name": "mid", "share": 0.6, "clients": 2},
            ],
            "partition_class": ["low", "mid", "mid"],
        },
        "metric_name": metric,
        "target": 0.8 if acc else 10.0,
        "strategies": {
            "fleetfit": {
                "workload": "gpt-byte",
                "participation": 1.0,
                "data_share": 1.0,
                "final_metric": fit[-1],
                "best_metric": fit[-1],
                "metric_name": metric,
                "rounds_to_target": 3,
                "wall_s": 12.5,
                "classes": {
                    "low": {
                        "participation": 1.0,
                        "data_share": 0.4,
                        "worst_peak_over_budget": 0.93,
                        "metric": 0.8 if acc else 11.0,
                    },
                    "mid": {
                        "participation": 1.0,
                        "data_share": 0.6,
                        "worst_peak_over_budget": 0.71,
                        "metric": 0.9 if acc else 8.0,
                    },
                },
                "run_folder": "fleetfit",
                "rounds": _rounds(metric, fit, full),
            },
            "exclude": {
                "workload": "gpt-byte",
                "participation": 0.6,
                "data_share": 0.6,
                "final_metric": excl[-1],
                "best_metric": excl[-1],
                "metric_name": metric,
                "rounds_to_target": None,
                "wall_s": 8.0,
                "classes": {
                    "low": {
                        "participation": 0.0,
                        "data_share": 0.0,
                        "worst_peak_over_budget": None,
                        "metric": 0.2 if acc else 90.0,
                    },
                    "mid": {
                        "participation": 1.0,
                        "data_share": 0.6,
                        "worst_peak_over_budget": 0.73,
                        "metric": 0.7 if acc else 25.0,
                    },
                },
                "run_folder": "exclude",
                "rounds": _rounds(metric, excl, excluded),
            },
            # optional numbers missing: no classes, no best/rounds_to_target, rounds
            # without assignments, no wall time
            "smallest-model": {
                "workload": "gpt-byte@0.25",
                "participation": 1.0,
                "data_share": 1.0,
                "final_metric": small[-1],
                "metric_name": metric,
                "rounds": [
                    {k: v for k, v in r.items() if k != "assignments"}
                    for r in _rounds(metric, small, [])
                ],
            },
        },
    }


@pytest.mark.parametrize("metric", ["accuracy", "perplexity"])
def test_write_report_files(tmp_path, metric):
    compare = make_compare(metric)
    paths = write_report(tmp_path / "out", compare)
    assert [p.name for p in paths] == FILES
    assert all(p.parent == tmp_path / "out" and p.is_file() for p in paths)
    for p in paths:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data.startswith(PNG_MAGIC), p
            assert len(data) > 5_000, p


@pytest.mark.parametrize("metric", ["accuracy", "perplexity"])
def test_csv_rows_and_values(tmp_path, metric):
    compare = make_compare(metric)
    write_report(tmp_path, compare)
    with open(tmp_path / "compare.csv") as f:
        rows = {r["strategy"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["fleetfit", "exclude", "smallest-model"]
    fit, excl, small = rows["fleetfit"], rows["exclude"], rows["smallest-model"]
    assert fit["metric_name"] == metric
    assert float(fit["participation"]) == 1.0
    assert float(excl["data_share"]) == 0.6
    assert (
        float(fit["final_metric"]) == compare["strategies"]["fleetfit"]["final_metric"]
    )
    assert fit["rounds_to_target"] == "3"
    assert excl["rounds_to_target"] == ""
    assert float(fit["worst_peak_over_budget_low"]) == 0.93
    assert excl["worst_peak_over_budget_low"] == ""
    assert small["workload"] == "gpt-byte@0.25"
    assert small["wall_s"] == "" and small["worst_peak_over_budget_mid"] == ""
    # best and rounds-to-target computed from the rounds when the entry lacks them
    best = 0.5 if metric == "accuracy" else 40.0
    assert float(small["best_metric"]) == best
    assert small["rounds_to_target"] == ""

    with open(tmp_path / "rounds.csv") as f:
        rounds = list(csv.DictReader(f))
    assert list(rounds[0]) == [
        "strategy",
        "round",
        "metric",
        "loss",
        "num_clients",
        "num_sampled",
        "sim_round_s",
        "sim_elapsed_s",
        "metric_low",
        "metric_mid",
    ]
    assert len(rounds) == 9
    assert [r["round"] for r in rounds[:3]] == ["1", "2", "3"]
    first_exclude = next(r for r in rounds if r["strategy"] == "exclude")
    assert float(first_exclude["metric"]) == (0.4 if metric == "accuracy" else 50.0)
    assert first_exclude["num_clients"] == "1"
    assert first_exclude["num_sampled"] == "2"
    assert float(first_exclude["sim_elapsed_s"]) == 60.0
    assert float(first_exclude["metric_low"]) == float(first_exclude["metric"])


def test_report_markdown(tmp_path):
    compare = make_compare()
    write_report(tmp_path, compare)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Fleet comparison: phones")
    for fact in ("digits-cnn", "3 clients", "3 rounds", "seed 7"):
        assert fact in md
    links = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md))
    assert links == {
        "metric.png",
        "participation.png",
        "peaks.png",
        "class_metric.png",
        "metric_time.png",
        "class_rounds.png",
    }
    for name in compare["strategies"]:
        assert name in md
    # the headline table has a row per strategy
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + 3
    left_out = md.split("## Classes left out")[1].split("##")[0]
    assert "**exclude**: left out low" in left_out
    assert "**fleetfit**: left no class out" in left_out
    assert "**smallest-model**: no per-class results" in left_out


def test_format_table():
    compare = make_compare("perplexity")
    table = format_table(compare)
    lines = table.splitlines()
    assert len(lines) == 4
    assert "final perplexity" in lines[0] and "rounds to target" in lines[0]
    fit, excl, small = lines[1:]
    assert fit.startswith("fleetfit") and excl.startswith("exclude")
    assert small.startswith("smallest-model")
    assert "low 0.93, mid 0.71" in fit and "100.0" in fit
    assert excl.split()[:4] == ["exclude", "gpt-byte", "60.0", "60.0"]
    assert " - " in excl  # never reached the target
    assert "mid 0.73" in excl and "low" not in excl
    assert small.rstrip().endswith("-")  # no wall time


def test_empty_run_plots_still_written(tmp_path):
    compare = make_compare()
    for s in compare["strategies"].values():
        s["rounds"] = []
        s.pop("classes", None)
    paths = write_report(tmp_path, compare)
    assert all(p.is_file() for p in paths)
    assert (tmp_path / "metric.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c.update(strategies={}), "strategies"),
        (lambda c: c.pop("strategies"), "strategies"),
        (lambda c: c.update(metric_name="bleu"), "metric_name 'bleu'"),
        (
            lambda c: c["strategies"]["exclude"].update(metric_name="perplexity"),
            "'exclude' reports metric_name 'perplexity'",
        ),
        (
            lambda c: c["strategies"]["fleetfit"].pop("data_share"),
            "'fleetfit' lacks data_share",
        ),
        (
            lambda c: c["strategies"]["fleetfit"].update(participation=1.5),
            "participation=1.5",
        ),
        (lambda c: c["strategies"]["fleetfit"].update(rounds=None), "rounds"),
    ],
)
def test_bad_input(tmp_path, change, match):
    compare = copy.deepcopy(make_compare())
    change(compare)
    with pytest.raises(ValueError, match=re.escape(match)):
        write_report(tmp_path / "out", compare)
    with pytest.raises(ValueError, match=re.escape(match)):
        format_table(compare)
    assert not (tmp_path / "out").exists()  # nothing written before the check


def test_rounds_to_target_computed_when_absent():
    for metric in ("accuracy", "perplexity"):
        compare = make_compare(metric)
        del compare["strategies"]["fleetfit"]["rounds_to_target"]
        fit = format_table(compare).splitlines()[1].split()
        assert fit[6] == "3"  # 0.85 >= 0.8 and 9.0 <= 10.0 in round 3


def test_metric_name_from_strategies():
    compare = make_compare("perplexity")
    del compare["metric_name"]
    assert "final perplexity" in format_table(compare)


def test_peak_points_skip_missing_numbers():
    from simulations.report import peak_points

    strategies = make_compare()["strategies"]
    fit = peak_points(strategies["fleetfit"])
    assert (
        len(fit) == 3 * 2
    )  # 3 rounds x 2 assignments with a peak ("no reply" has none)
    assert (GiB, int(0.93 * GiB), "part") in fit
    assert len(peak_points(strategies["exclude"])) == 3
    assert peak_points(strategies["smallest-model"]) == []
