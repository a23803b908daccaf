"""The fleetfit command: bad input fails before any work, naming the value."""

import logging
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from fleetfit.cli import main
from fleetfit.cmd_simulate import format_rounds
from server.config import ServerConfig
from wire.shape import RunShape

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "a:b:c"], "malformed workload 'a:b:c'"),
        (["--rounds", "-1"], "'--rounds': -1 is not in the range x>=1"),
        (["--rounds", "zero"], "'--rounds': 'zero' is not a valid integer"),
        (["--clients", "5000"], "5000 clients but only 1442 items"),
        (["--split", "natural", "--clients", "11"], "10 groups for 11 clients"),
        (["--fraction", "2"], "'--fraction': 2 is not a share in (0, 1]"),
        (["--strategy", "exclude"], "--strategy needs --fleet"),
        (["--fleet", "nowhere"], "neither a file nor a shipped fleet"),
        (["--fleet", "edge", "--strategy", "best"], "unknown strategy 'best'"),
        (
            ["--fleet", "edge", "--strategy", "exclude", "--compare", "fleetfit"],
            "not both",
        ),
        (["--fleet", "edge", "--workload", "gpt-tiny"], "--workload comes from"),
        (["--fleet", "edge", "--fraction", "2"], "'--fraction': 2 is not a share"),
        (["--fleet", "edge", "--split", "iid"], "--split comes from"),
        (["--fleet", "edge", "--target", "0.5"], "--target applies to --compare"),
    ],
)
def test_simulate_rejects_bad_input_fast(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        sys.exit(main(["simulate", *args]))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert needle in err
    assert err.startswith("fleetfit simulate: error: ") and err.count("\n") == 1, err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_format_rounds_table():
    text = format_rounds(
        {
            "rounds": [
                {
                    "round": 1,
                    "num_clients": 3,
                    "num_sampled": 4,
                    "accuracy": 0.5,
                    "loss": 1.0,
                    "train_loss": 1.2,
                    "round_s": 2.0,
                }
            ]
        }
    )
    assert (
        "3/4" in text
        and "0.5000" in text
        and text.splitlines()[0].split()[0] == "round"
    )


@pytest.mark.child
def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "fleetfit.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "simulate" in out.stdout


# Every default of a command's flags is the run config's (ServerConfig, RunShape):
# a flag not given is not passed, so the run config's own default applies.
def parsed(monkeypatch, module, function, argv):
    """The Namespace ``fleetfit <argv>`` hands to ``module.function``."""
    seen = []
    monkeypatch.setattr(module, function, lambda args: seen.append(args) or 0)
    assert main(argv) == 0
    return seen[0]


def test_server_passes_only_the_flags_given(tmp_path, monkeypatch):
    import fleetfit.cmd_federation as fed
    from fleetfit.cmd_federation import check_run_config, server_run_config

    out = tmp_path / "run"
    args = parsed(monkeypatch, fed, "run_server", ["server", "--out", str(out)])
    run_config = server_run_config(args, out)
    assert run_config == f'out="{out}"'
    cfg = check_run_config(run_config)
    assert cfg == replace(ServerConfig(), out=str(out))
    assert cfg.shape.local_steps == RunShape().local_steps == 20

    args = parsed(
        monkeypatch,
        fed,
        "run_server",
        [
            "server",
            "--out",
            str(out),
            "--rounds",
            "3",
            "--local-steps",
            "7",
            "--workload",
            "digits-mlp",
            "--round-timeout",
            "30",
            "--seed",
            "-2",
            "--resume",
            "--run-config",
            "min-replies=2",
            "--lr",
            "0.01",
            "--batch",
            "16",
        ],
    )
    cfg = check_run_config(server_run_config(args, out))
    assert (cfg.shape.batch_size, cfg.min_replies) == (16, 2)
    assert (cfg.num_server_rounds, cfg.shape.local_steps, cfg.shape.workload) == (
        3,
        7,
        "digits-mlp",
    )
    assert (cfg.round_timeout_s, cfg.shape.seed, cfg.resume, cfg.shape.lr) == (
        30.0,
        -2,
        True,
        0.01,
    )
    assert (cfg.min_nodes, cfg.node_wait_s) == (
        ServerConfig().min_nodes,
        ServerConfig().node_wait_s,
    )


def test_the_apps_run_config_defaults_are_server_configs():
    """``flwr run`` fills the keys a command does not pass from pyproject.toml's
    [tool.flwr.app.config]: they must be ServerConfig's defaults."""
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    listed = app["config"]
    defaults = ServerConfig().to_run_config()
    assert {k: defaults[k] for k in listed} == listed
    assert set(listed) == set(defaults)  # every key usable through `flwr run`


def test_simulate_flags_default_to_the_run_config(monkeypatch):
    import fleetfit.cmd_simulate as sim
    from fleetfit.cmd_simulate import RUN_FLAGS, SHAPE_FLAGS, given

    args = parsed(monkeypatch, sim, "run", ["simulate"])
    assert given(args, SHAPE_FLAGS) == given(args, RUN_FLAGS) == {}
    args = parsed(
        monkeypatch, sim, "run", ["simulate", "--alpha", "2", "--rounds", "3"]
    )
    assert given(args, SHAPE_FLAGS) == {"dirichlet_alpha": 2.0}
    assert given(args, RUN_FLAGS) == {"num_server_rounds": 3}


def test_simulate_fleet_takes_only_the_flags_given(monkeypatch):
    import simulations.fleet

    seen = {}

    def load_fleet(source, **overrides):
        seen.update(overrides)
        raise ValueError("stop here")

    monkeypatch.setattr(simulations.fleet, "load_fleet", load_fleet)
    code = main(["simulate", "--fleet", "edge", "--lr", "0.01", "--seq", "32"])
    assert code == 2
    given = {k: v for k, v in seen.items() if v is not None}
    assert given == {"lr": 0.01, "seq_len": 32}


@pytest.fixture
def restore_logging():
    """Put back what ``_setup_logging`` changes in this process's loggers."""
    names = ["", "flwr", "fleetfit", "server", "client", "simulations", "memory"]
    saved = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level) for n in names
    }
    propagate = logging.getLogger("flwr").propagate
    yield
    for n, (handlers, level) in saved.items():
        logging.getLogger(n).handlers[:] = handlers
        logging.getLogger(n).setLevel(level)
    logging.getLogger("flwr").propagate = propagate


@pytest.mark.parametrize("verbose", [False, True])
def test_flower_logs_once_and_debug_only_with_v(verbose, capsys, restore_logging):
    from fleetfit.cli import _setup_logging

    _setup_logging(verbose)
    flwr, loop = logging.getLogger("flwr"), logging.getLogger("server.loop")
    flwr.debug("flower debug")
    flwr.warning("flower warning")
    loop.debug("round 1: node 7 (budget 1.00 GiB) gets full")
    loop.info("round 1: accuracy")
    err = capsys.readouterr().err
    assert err.count("flower warning") == 1, err  # not Flower's handler and ours
    assert "round 1: accuracy" in err
    assert ("flower debug" in err) == verbose
    assert ("gets full" in err) == verbose


def test_only_flowers_run_simulation_deprecation_is_dropped(caplog):
    from flwr.supercore.logger import warn_deprecated_feature

    from simulations.run import _quiet_deprecated_entry_point

    with caplog.at_level(logging.WARNING), _quiet_deprecated_entry_point():
        warn_deprecated_feature("The `run_simulation` function is deprecated and ...")
        warn_deprecated_feature("Another feature")
    assert "run_simulation" not in caplog.text
    assert "Another feature" in caplog.text
