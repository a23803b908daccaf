"""``fleetfit memory``: JSON contract, measured runs, bad budgets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fleetfit.cli import main


def fleetfit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fleetfit.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_json(capsys) -> dict:
    """``fleetfit memory plan --workload gpt-tiny --json`` in this process."""
    assert main(["memory", "plan", "--workload", "gpt-tiny", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.child
def test_plan_json_reports_the_smallest_budget(capsys):
    d = plan_json(capsys)
    assert d["min_budget_bytes"] > 0
    assert d["predicted_peak_bytes"] == d["min_budget_bytes"]
    assert [b["name"] for b in d["plan"]["blocks"]] == [
        "embed",
        "layers.0",
        "layers.1",
        "head",
    ]


@pytest.mark.child
def test_run_under_a_budget_equals_plain_and_fits(tmp_path, capsys):
    """Both runs as ``fleetfit`` subprocesses (the command's JSON on stdout), the
    smallest budget planned in this process."""
    plain = last_json(
        fleetfit(
            "memory",
            "run",
            "--workload",
            "gpt-tiny",
            "--plain",
            "--steps",
            "3",
            "--json",
            "--save",
            str(tmp_path / "plain.safetensors"),
        )
    )
    smallest = plan_json(capsys)
    budget = str(smallest["min_budget_bytes"] + 2**20)
    planned = last_json(
        fleetfit(
            "memory",
            "run",
            "--workload",
            "gpt-tiny",
            "--memory-budget",
            budget,
            "--steps",
            "3",
            "--json",
            "--offload-dir",
            str(tmp_path),
        )
    )
    for d in (plain, planned):
        for key in (
            "budget_bytes",
            "predicted_peak_bytes",
            "measured_peak_bytes",
            "baseline_bytes",
            "step_s",
            "losses",
        ):
            assert key in d
        assert len(d["losses"]) == 3
    assert planned["measured_peak_bytes"] <= planned["budget_bytes"]
    assert planned["losses"] == pytest.approx(plain["losses"], rel=1e-6)


@pytest.mark.parametrize(
    "budget,needle",
    [
        ("0", "greater than zero"),
        ("-5MB", "negative"),
        ("lots", "'--memory-budget': cannot parse size 'lots'"),
    ],
)
def test_bad_budgets_fail_clearly(budget, needle, capsys):
    code = main(
        ["memory", "plan", "--workload", "gpt-tiny", f"--memory-budget={budget}"]
    )
    assert code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.child
def test_budget_below_the_smallest_plan_names_it(capsys):
    code = main(["memory", "plan", "--workload", "gpt-tiny", "--memory-budget", "1kB"])
    err = capsys.readouterr().err
    assert code == 2
    assert "smallest budget" in err.lower(), err


def test_run_needs_a_budget_or_plain(capsys):
    assert main(["memory", "run", "--workload", "gpt-tiny"]) == 2
    assert "--memory-budget is required" in capsys.readouterr().err
