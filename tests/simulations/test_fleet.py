"""Fleet files: the shipped fleets load and look as documented; bad files fail with
a message naming the field and the value, before Ray starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from server.config import ServerConfig
from simulations.compare import (
    base_workload,
    check_strategies,
    plain_need_bytes,
    settings_for,
    smallest_model,
)
from simulations.fleet import FleetError, _apportion, load_fleet, parse_fleet


def small(**over):
    base = {
        "name": "t",
        "clients": 4,
        "workload": {"name": "digits-cnn"},
        "split": {"kind": "natural"},
        "classes": [
            {"name": "low", "share": 0.5, "memory": "120MB", "availability": 0.5},
            {"name": "high", "share": 0.5, "memory": {"min": "1GB", "max": "2GB"}},
        ],
    }
    base.update(over)
    return base


@pytest.mark.parametrize("name", ["phones", "sbc", "edge"])
def test_shipped_fleets_load_and_validate(name, tmp_path):
    fleet = load_fleet(name)
    assert fleet.clients == len(fleet.budgets) == len(fleet.partition_class)
    assert fleet.shape.split == "natural"
    assert sum(fleet.class_counts()) == fleet.clients
    assert all(n >= 1 for n in fleet.class_counts())
    for b, k in zip(fleet.budgets, fleet.partition_class, strict=True):
        lo, hi = fleet.classes[k].budget_range
        assert lo <= b <= hi
    for strategy in ("fleetfit", "exclude", "smallest-model"):
        wl = smallest_model(fleet)[0].name if strategy == "smallest-model" else None
        settings_for(fleet, strategy, tmp_path / strategy, workload=wl).validate()


def test_phone_fleet_mostly_cannot_train_gpt_byte_plainly():
    fleet = load_fleet("phones")
    assert fleet.shape.workload == "gpt-byte"
    need = plain_need_bytes(base_workload(fleet), ServerConfig().reserve_bytes)
    cannot = sum(b < need for b in fleet.budgets) / fleet.clients
    assert cannot >= 0.4, cannot
    # and the smallest model every phone can train plainly is a shrunk gpt-byte
    shrunk, shrunk_need = smallest_model(fleet)
    assert shrunk.name.startswith("gpt-byte@") and shrunk_need <= min(fleet.budgets)


def test_budgets_are_drawn_from_the_seed():
    a, b = load_fleet("phones"), load_fleet("phones")
    assert a.budgets == b.budgets
    assert load_fleet("phones", seed=1).budgets != a.budgets


def test_overrides_replace_top_level_fields():
    fleet = load_fleet("edge", clients=20, rounds=2, fraction=0.5)
    assert (fleet.clients, fleet.rounds, fleet.fraction) == (20, 2, 0.5)


def test_apportion_gives_every_class_a_device_and_sums():
    assert _apportion([0.07, 0.14, 0.32, 0.37, 0.10], 12) == [1, 2, 4, 4, 1]
    assert _apportion([0.07, 0.14, 0.32, 0.37, 0.10], 1000) == [70, 140, 320, 370, 100]
    assert _apportion([0.9, 0.05, 0.05], 3) == [1, 1, 1]


def test_choices_draw_only_listed_sizes():
    fleet = parse_fleet(
        small(
            clients=40,
            classes=[
                {
                    "name": "c",
                    "share": 1.0,
                    "memory": {"choices": ["1GB", "2GB"], "weights": [3, 1]},
                }
            ],
        )
    )
    assert set(fleet.budgets) == {10**9, 2 * 10**9}


@pytest.mark.parametrize(
    "change, needles",
    [
        (
            {
                "classes": [
                    {"name": "a", "share": 0.5, "memory": "1GB"},
                    {"name": "b", "share": 0.4, "memory": "1GB"},
                ]
            },
            ["shares sum to 0.9", "share"],
        ),
        (
            {"classes": [{"name": "a", "share": 1.0, "memory": "-1GB"}]},
            ["classes[0] (a).memory", "'-1GB'", "negative"],
        ),
        (
            {"classes": [{"name": "a", "share": 1.0, "memory": -5}]},
            ["memory", "-5", "negative"],
        ),
        ({"colour": "red"}, ["unknown field colour", "'red'"]),
        (
            {"classes": [{"name": "a", "share": 1.0, "memory": "1GB", "ram": 3}]},
            ["unknown field classes[0].ram"],
        ),
        ({"clients": 0}, ["clients = 0"]),
        ({"eval_windows": 0}, ["eval_windows = 0", ">= 1"]),
        ({"eval_windows": "many"}, ["eval_windows = 'many'"]),
        ({"fraction": 1.5}, ["fraction = 1.5"]),
        ({"split": {"kind": "random"}}, ["split.kind = 'random'"]),
        ({"workload": {"name": "digits-cnn", "lr": -1}}, ["workload.lr = -1"]),
        (
            {
                "classes": [
                    {"name": "a", "share": 1.0, "memory": "1GB", "availability": 0}
                ]
            },
            ["availability = 0"],
        ),
        (
            {"classes": [{"name": "a", "share": 1.0, "memory": "1GB", "speed": 0}]},
            ["speed = 0"],
        ),
        (
            {
                "classes": [
                    {"name": "a", "share": 1.0, "memory": {"min": "2GB", "max": "1GB"}}
                ]
            },
            ["min '2GB' is above max '1GB'"],
        ),
        ({"classes": []}, ["classes is missing"]),
        (
            {
                "classes": [
                    {"name": "a", "share": 0.5, "memory": "1GB"},
                    {"name": "a", "share": 0.5, "memory": "1GB"},
                ]
            },
            ["'a' is used twice"],
        ),
        ({"clients": 1}, ["fewer than the 2 classes"]),
    ],
)
def test_bad_fleets_name_field_and_value(change, needles):
    with pytest.raises(FleetError) as e:
        parse_fleet(small(**change), file="f.toml")
    for needle in needles:
        assert needle in str(e.value), str(e.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(FleetError, match="does not exist"):
        load_fleet(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("clients = [")
    with pytest.raises(FleetError, match="not valid TOML"):
        load_fleet(bad)
    with pytest.raises(FleetError, match="phones"):
        load_fleet("no-such-fleet")


def test_strategy_names_are_checked():
    assert check_strategies(["fleetfit", " exclude"]) == ["fleetfit", "exclude"]
    with pytest.raises(ValueError, match="unknown strategy 'greedy'"):
        check_strategies(["greedy"])
    with pytest.raises(ValueError, match="twice"):
        check_strategies(["exclude", "exclude"])


def test_cli_rejects_a_bad_fleet_before_ray_starts(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        'name = "bad"\nclients = 4\n[[classes]]\nname = "a"\nshare = 0.7\n'
        'memory = "1GB"\n'
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleetfit.cli",
            "simulate",
            "--fleet",
            str(bad),
            "--compare",
            "fleetfit,exclude",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "shares sum to 0.7" in done.stderr
    assert "ray" not in done.stderr.lower()
    assert time.monotonic() - t0 < 60
