"""What ``fleetfit server`` and ``fleetfit client`` print while they run, off a
terminal: the run's streamed lines relayed, the per-round table at the end, and a
line per round this node trained in, followed from its round log."""

import io
import json
import time

import pytest

from client.round_log import append
from fleetfit.cmd_federation import _print_rounds, _relay_lines, _RoundLogPrinter


@pytest.fixture(autouse=True)
def unbound_console(monkeypatch):
    """The shared console on this test's sys.stderr, not one an earlier test's
    ``main()`` bound to its own."""
    monkeypatch.setattr("simulations.console._bound", None)


def test_server_relays_the_stream_and_prints_the_table(tmp_path, capsys):
    _relay_lines(io.StringIO("INFO :      Starting\r\n\x1b[92mINFO \x1b[0m:  done\n"))
    _print_rounds(tmp_path)  # no summary: nothing
    rounds = [
        {"round": k, "accuracy": 0.5, "loss": 1.0, "num_clients": 2, "num_sampled": 2}
        for k in (1, 2)
    ]
    (tmp_path / "summary.json").write_text(json.dumps({"rounds": rounds}))
    _print_rounds(tmp_path)
    out, err = capsys.readouterr()
    assert err == "INFO :      Starting\nINFO :  done\n"
    assert out.splitlines()[0].split() == [
        "round", "clients", "accuracy", "loss", "train", "loss", "time", "s",
    ]  # fmt: skip
    assert out.splitlines()[2].split()[:2] == ["2", "2/2"]


def test_client_prints_each_round_it_trained_in(tmp_path, capsys):
    path = tmp_path / "rounds.jsonl"
    printer = _RoundLogPrinter(path, interval_s=0.02)
    entry = {"kind": "full", "steps": 5, "num_examples": 100, "train_loss": 0.5}
    append({"round": 1, **entry}, path)
    time.sleep(0.2)
    assert capsys.readouterr().err.startswith("round 1: full, 5 steps on 100 examples")
    with open(path, "a") as f:
        f.write('{"round": 2, "ki')  # mid-write when the command stops
    append({"round": 3, **entry}, path)  # not a line of its own: skipped
    append({"round": 4, **entry}, path)
    entries = printer.close()
    assert [e["round"] for e in entries] == [1, 4]
    assert capsys.readouterr().err.startswith("round 4: full")
