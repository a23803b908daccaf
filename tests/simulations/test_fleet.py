"""Fleet files: the shipped fleets load and look as documented; bad files fail with
a message naming the field and the value, before Ray starts. The run settings are
the run config's keys and defaults; the names fleet files had before still load, with a
warning naming the new key."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import tomllib
from dataclasses import replace

import pytest

from server.config import FleetConfig, ServerConfig
from simulations.compare import (
    base_workload,
    check_strategies,
    plain_need_bytes,
    settings_for,
    smallest_model,
)
from simulations.fleet import (
    RENAMED,
    FleetError,
    _apportion,
    load_fleet,
    parse_fleet,
)
from wire.shape import RunShape


def small(**over):
    base = {
        "name": "t",
        "clients": 4,
        "workload": "digits-cnn",
        "local-steps": 5,
        "split": "natural",
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
    fleet = load_fleet(
        "edge", clients=20, num_server_rounds=2, fraction_train=0.5, lr=0.01, seed=None
    )
    assert (fleet.clients, fleet.num_server_rounds, fleet.fraction_train) == (
        20,
        2,
        0.5,
    )
    assert (fleet.shape.lr, fleet.shape.seed) == (0.01, 0)


# What the shipped fleet files loaded to on main, before they took the run config's
# names: the rename must not change a single setting or budget.
SHIPPED = {
    "phones": dict(
        shape=RunShape("gpt-byte", 5, 0.003, 0, "natural", 0.5, 8, 128),
        num_server_rounds=4,
        fraction_train=0.5,
        eval_windows=256,
        clients=12,
        partition_class=(0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4),
        budgets=(
            210087014,
            291643218,
            300732079,
            430133183,
            417766527,
            424575387,
            411249274,
            559766756,
            570798370,
            630458423,
            586902738,
            791326730,
        ),
    ),
    "sbc": dict(
        shape=RunShape("gpt-byte", 3, 0.003, 0, "natural", 0.5, 16, 256),
        num_server_rounds=3,
        fraction_train=0.5,
        eval_windows=256,
        clients=8,
        partition_class=(0, 0, 1, 1, 2, 2, 3, 3),
        budgets=tuple(n * 10**8 for n in (4, 4, 8, 8, 16, 16, 32, 32)),
    ),
    "edge": dict(
        shape=RunShape("gpt-byte", 5, 0.003, 0, "natural", 0.5, 4, 64),
        num_server_rounds=5,
        fraction_train=1.0,
        eval_windows=256,
        clients=6,
        partition_class=(0, 0, 1, 2, 3, 4),
        budgets=(200116019, 214428812, 300000000, 320000000, 10**9, 2 * 10**9),
    ),
    "examples/transformers_fleet.toml": dict(
        shape=RunShape(
            "examples.transformers_gpt2:build", 8, 0.001, 0, "natural", 0.5, 0, 0
        ),
        num_server_rounds=5,
        fraction_train=1.0,
        eval_windows=256,
        clients=3,
        partition_class=(0, 1, 2),
        budgets=(10**9, 118489088, 110100480),
    ),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_fleets_load_as_before_without_warnings(name, caplog):
    with caplog.at_level(logging.WARNING, logger="simulations.fleet"):
        fleet = load_fleet(name)
    assert not caplog.records, caplog.text
    want = SHIPPED[name]
    got = {k: getattr(fleet, k) for k in want}
    assert got == want


OLD = {  # the phones fleet in the names fleet files had before the run config's
    "name": "phones",
    "clients": 12,
    "rounds": 4,
    "fraction": 0.5,
    "local_steps": 5,
    "seed": 0,
    "eval_windows": 256,
    "workload": {"name": "gpt-byte", "batch": 8, "seq": 128, "lr": 0.003},
    "split": {"kind": "natural", "alpha": 0.5},
}


def test_old_names_load_the_same_fleet_with_a_warning_each(caplog):
    new = load_fleet("phones")
    with open(new.file, "rb") as f:
        old = {**OLD, "classes": tomllib.load(f)["classes"]}
    with caplog.at_level(logging.WARNING, logger="simulations.fleet"):
        fleet = parse_fleet(old, file=new.file, description=new.description)
    assert fleet == new
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(RENAMED) == 10
    for name, key in RENAMED.items():
        line = next(x for x in lines if f": {name} is deprecated" in x)
        assert f"write {key} = " in line and "\n" not in line, line


def test_old_and_new_name_together_is_an_error():
    with pytest.raises(FleetError, match="rounds and num-server-rounds are the same"):
        parse_fleet(small(rounds=2, **{"num-server-rounds": 3}))
    with pytest.raises(FleetError, match="split.alpha and dirichlet-alpha are the"):
        parse_fleet(small(split={"alpha": 1.0}, **{"dirichlet-alpha": 1.0}))


def test_defaults_are_the_run_configs_and_a_changed_one_warns(caplog):
    data = small()
    del data["local-steps"], data["split"], data["workload"]
    with caplog.at_level(logging.WARNING, logger="simulations.fleet"):
        fleet = parse_fleet(data, file="f.toml")
    server = ServerConfig()
    assert fleet.shape == server.shape == RunShape()
    assert fleet.num_server_rounds == server.num_server_rounds
    assert fleet.fraction_train == server.fraction_train
    assert fleet.eval_windows == server.eval_windows
    assert fleet.fleet_config().classes == ()  # iid: the classes do not split data
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "local-steps is not set" in lines[0] and "write local-steps = 5" in lines[0]
    assert "split is not set" in lines[1] and 'write split = "natural"' in lines[1]


def test_a_fleet_is_the_run_configs_keys():
    fleet = parse_fleet(small(**{"dirichlet-alpha": 2, "batch-size": 3, "seq-len": 7}))
    cfg = ServerConfig.from_run_config(
        {k: v for k, v in small().items() if k in ("workload", "local-steps", "split")}
        | {"dirichlet-alpha": 2, "batch-size": 3, "seq-len": 7}
    )
    assert fleet.shape == cfg.shape
    assert isinstance(fleet.fleet_config(), FleetConfig)


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
        ({"eval-windows": 0}, ["eval-windows=0", "at least 1"]),
        ({"eval-windows": "many"}, ["eval-windows='many'", "must be a int"]),
        ({"fraction-train": 1.5}, ["fraction-train=1.5", "(0, 1]"]),
        ({"split": "random"}, ["split='random'", "iid"]),
        ({"split": {"kind": "random"}}, ["split='random'"]),  # the old name too
        ({"lr": -1}, ["lr=-1.0", "positive"]),
        ({"local-steps": 0}, ["local-steps=0", "at least 1"]),
        ({"local-steps": True}, ["local-steps=True", "int"]),
        ({"dirichlet-alpha": 0}, ["dirichlet-alpha=0.0", "> 0"]),
        ({"seed": -1}, ["seed = -1", ">= 0"]),
        ({"workload": {"name": "x", "bath": 2}}, ["unknown field workload.bath"]),
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
    assert check_strategies(["fleetfit-adapter", "adapters"]) == [
        "fleetfit-adapter",
        "adapters",
    ]
    with pytest.raises(ValueError, match="unknown strategy 'greedy'") as e:
        check_strategies(["greedy"])
    assert "\n" not in str(e.value) and "fleetfit-adapter" in str(e.value)
    with pytest.raises(ValueError, match="twice"):
        check_strategies(["exclude", "exclude"])


@pytest.mark.parametrize(
    "strategy, server, mode",
    [
        ("fleetfit", "fleetfit", "off"),  # full where a plan fits, else part
        ("fleetfit-adapter", "fleetfit", "auto"),  # full, else adapter
        ("adapters", "fleetfit", "all"),  # adapters everywhere
        ("exclude", "exclude", "off"),
        ("heterofl", "heterofl", "off"),
    ],
)
def test_fleetfit_variants_differ_only_in_the_adapters_key(
    strategy, server, mode, tmp_path
):
    fleet = load_fleet("phones")
    got = settings_for(fleet, strategy, tmp_path).validate()
    assert got.strategy == server and got.adapters.mode == mode
    assert ServerConfig.from_run_config(got.to_run_config()).adapters.mode == mode
    if server == "fleetfit":  # everything else as plain fleetfit's
        plain = settings_for(fleet, "fleetfit", tmp_path).validate()
        assert replace(got, adapters=plain.adapters) == plain
        assert got.adapters.spec() == plain.adapters.spec()


@pytest.mark.child
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


def test_a_fleet_file_sets_the_adapters_and_the_variants_keep_its_lora_keys(
    tmp_path,
):
    """The fleet file's adapters and lora-* keys reach the run config of plain
    fleetfit; the variants set only the mode over them; other strategies train no
    adapters; a bad value is one line naming the key."""
    keys = {
        "workload": "gpt-tiny",
        "adapters": "auto",
        "lora-rank": 4,
        "lora-alpha": 8.0,
        "lora-targets": "qkv,fc",
    }
    fleet = parse_fleet(small(**keys), "t.toml")
    assert fleet.adapters.mode == "auto" and fleet.adapters.rank == 4
    for strategy, mode in [("fleetfit", "auto"), ("adapters", "all")]:
        got = settings_for(fleet, strategy, tmp_path).validate()
        assert got.adapters.mode == mode
        assert (got.adapters.rank, got.adapters.alpha) == (4, 8.0)
        assert got.adapters.targets == ("qkv", "fc")
    assert settings_for(fleet, "exclude", tmp_path).validate().adapters.mode == "off"
    with pytest.raises(FleetError, match="lora-rank") as e:
        parse_fleet(small(**{"lora-rank": 0}), "t.toml")
    assert "\n" not in str(e.value)
    with pytest.raises(FleetError, match="adapters"):
        parse_fleet(small(adapters="some"), "t.toml")
