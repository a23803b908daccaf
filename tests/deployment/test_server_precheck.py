"""``fleetfit server`` checks its run config (keys, values, the workload) before it
starts the SuperLink: bad input is one line and exit 2, no process, no run folder."""

from __future__ import annotations

import pytest

from fleetfit import cmd_federation
from fleetfit.cli import main


@pytest.fixture
def no_start(monkeypatch):
    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    monkeypatch.setattr(
        cmd_federation, "_start", lambda *a: pytest.fail("started a SuperLink")
    )


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--workload", "nosuch"], ["unknown workload 'nosuch'", "digits-cnn"]),
        (["--workload", "nomodule_xyz:build"], ["nomodule_xyz"]),
        (["--run-config", "lr=-1"], ["lr=-1.0", "positive"]),
        (["--run-config", "colour=1"], ["unknown run-config key(s) colour"]),
        (["--run-config", "eval-windows=0"], ["eval-windows=0"]),
        (["--run-config", "lr=="], ["run config", "key=value", "--run-config"]),
        (
            ["--workload", "gpt-tiny", "--run-config", "seq-len=100000"],
            ["sequence length"],
        ),
    ],
)
def test_bad_run_config_is_refused_before_anything_starts(
    tmp_path, capsys, no_start, extra, needles
):
    out = tmp_path / "run"
    code = main(["server", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    line = next(x for x in err.splitlines() if x.startswith("fleetfit: error:"))
    for needle in needles:
        assert needle in line, line
    assert "Traceback" not in err
    assert not out.exists()
