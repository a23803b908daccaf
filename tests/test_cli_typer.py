"""The ``fleetfit`` command as a typer application, through typer's own test runner:
every option documented, one name and one meaning per option across commands,
``--version``, shell completion, one-line errors."""

from __future__ import annotations

import subprocess

import click
import pytest
import typer
from typer.testing import CliRunner

import fleetfit.cmd_federation as fed
from fleetfit import __version__
from fleetfit.cli import app

runner = CliRunner()


def commands() -> dict[str, click.Command]:
    """Every runnable command, by its path ("memory plan")."""
    found: dict[str, click.Command] = {}

    def walk(cmd: click.Command, path: str) -> None:
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd)
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), f"{path} {name}".strip())
        else:
            found[path] = cmd

    walk(typer.main.get_command(app), "")
    return found


def options(cmd: click.Command) -> dict[str, click.Option]:
    return {
        p.opts[0]: p
        for p in cmd.params
        if isinstance(p, click.Option) and p.opts[0] != "--help"
    }


def test_every_command_and_option_is_documented():
    found = commands()
    assert set(found) == {
        "simulate",
        "memory profile",
        "memory plan",
        "memory run",
        "partition plan",
        "partition simulate",
        "partition run",
        "server",
        "client",
        "export",
    }
    for path, cmd in found.items():
        assert cmd.help, path
        for name, opt in options(cmd).items():
            assert opt.help and len(opt.help) > 10, f"fleetfit {path} {name}"
        result = runner.invoke(app, [*path.split(), "--help"])
        assert result.exit_code == 0, result.output
        assert "--help" in result.output


# Options that mean the same in every command that takes them: same help text (with
# its default) and same default.
SHARED = [
    "--workload",
    "--rounds",
    "--local-steps",
    "--fraction",
    "--split",
    "--alpha",
    "--batch",
    "--seq",
    "--disk-budget",
    "--offload-dir",
    "--json",
    "--progress",
]


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_means_the_same_everywhere(name):
    seen = {
        path: (opt.help, opt.default, opt.type.name)
        for path, cmd in commands().items()
        if (opt := options(cmd).get(name)) is not None
    }
    assert len(seen) >= 2, f"{name} is in one command only: {list(seen)}"
    assert len(set(seen.values())) == 1, seen


def test_no_command_uses_the_old_or_odd_names():
    """``--budget`` was ``memory``'s name for ``client``'s ``--memory-budget``."""
    for path, cmd in commands().items():
        names = set(options(cmd))
        assert not names & {"--budget", "--no-progress"}, path
        if "--memory-budget" in names or "--disk-budget" in names:
            assert "--offload-dir" in names, path


def test_server_and_simulate_take_the_same_run_options():
    """Everything `simulate` sets about training, `server` sets too."""
    found = commands()
    run = {"--workload", "--rounds", "--local-steps", "--lr", "--seed", "--fraction"}
    run |= {"--split", "--alpha", "--batch", "--seq", "--out", "--progress"}
    assert run <= set(options(found["simulate"]))
    assert run <= set(options(found["server"]))


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith(f"fleetfit {__version__} (flwr 1.42")
    assert "torch" in result.output


def test_shell_completion():
    script = runner.invoke(app, ["--show-completion", "bash"])
    assert script.exit_code == 0
    assert "_FLEETFIT_COMPLETE=complete_bash" in script.output
    words = runner.invoke(
        app,
        [],
        prog_name="fleetfit",
        env={
            "_FLEETFIT_COMPLETE": "complete_bash",
            "COMP_WORDS": "fleetfit memory pl",
            "COMP_CWORD": "2",
        },
    )
    assert words.exit_code == 0 and words.output.split() == ["plan"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["server", "--port", "70000"], "'--port': 70000 is not in the range"),
        (["client", "--memory-budget", "lots"], "cannot parse size 'lots'"),
        (["client", "--partition-id", "3", "--num-partitions", "2"], "in 0..1"),
        (["memory", "plan", "--disk-budget", "-1"], "negative"),
        (["simulate", "--split", "shards"], "give one of iid, dirichlet, natural"),
        (["server", "--resume"], "--resume continues a run: give its folder"),
        (["memory", "plna"], "No such command 'plna'"),
        (
            [
                "partition",
                "plan",
                "--cluster",
                "c.toml",
                "--model",
                "m",
                "--workload",
                "x",
            ],
            "not both",
        ),
    ],
)
def test_errors_are_one_line_naming_the_command(argv, needle):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"fleetfit {argv[0]}"), lines[0]
    assert needle in lines[0]
    assert "Traceback" not in result.output


class FakeSuperNode:
    """What ``subprocess.Popen`` returns, for a SuperNode that ends at once."""

    seen: list[list[str]] = []

    def __init__(self, cmd, **kwargs):
        FakeSuperNode.seen.append(cmd)
        self.returncode = 0

    def wait(self, timeout=None):
        return 0

    def poll(self):
        return 0


@pytest.mark.parametrize("port", [None, 9190])
def test_client_port_is_the_supernodes(port, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", FakeSuperNode)
    FakeSuperNode.seen.clear()
    argv = ["client", "--partition-id", "1", "--num-partitions", "3"]
    result = runner.invoke(app, argv + ([] if port is None else ["--port", str(port)]))
    assert result.exit_code == 0, result.output
    cmd = FakeSuperNode.seen[0]
    assert cmd[0].endswith("flower-supernode")
    assert cmd[cmd.index("--superlink") + 1] == "127.0.0.1:9091"  # server's default
    chosen = int(cmd[cmd.index("--port") + 1])
    assert chosen == port if port else 1 <= chosen <= 65535
    assert "partition-id=1 num-partitions=3" in cmd[cmd.index("--node-config") + 1]


def test_server_out_defaults_to_a_timestamped_folder(monkeypatch):
    seen = []
    monkeypatch.setattr(fed, "run_server", lambda args: seen.append(args) or 0)
    assert runner.invoke(app, ["server"]).exit_code == 0
    assert seen[0].out.startswith("runs/server-")
    assert seen[0].register == [] and seen[0].progress is True


def test_memory_runs_budget_is_documented_as_required():
    """`memory run` refuses to run without a budget (its guard needs one): its help
    says so, where `memory plan`'s says no budget means the smallest plan (issue 34,
    item 5: the help said the smallest plan for both)."""
    found = commands()
    run_help = options(found["memory run"])["--memory-budget"].help or ""
    plan_help = options(found["memory plan"])["--memory-budget"].help or ""
    assert "required unless --plain" in run_help and "smallest" not in run_help
    assert "the smallest plan" in plan_help
    result = runner.invoke(app, ["memory", "run", "--workload", "digits-mlp"])
    assert result.exit_code != 0
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--memory-budget is required" in lines[0], lines
    assert "--plain" in lines[0]
