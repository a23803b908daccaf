"""A SuperNode's round log: the ClientApp appends a JSON line per train instruction
where ``FLEETFIT_ROUND_LOG`` names a file; ``fleetfit client`` reads it back and
prints a line per round and a table, skipping what it cannot parse."""

import logging

from flwr.app import Context, RecordDict

from client.app import app
from client.round_log import (
    ROUND_LOG_ENV,
    RoundLogReader,
    append,
    format_entry,
    format_table,
)
from tests.client.test_app import train_msg

MiB = 2**20


def ctx(node_config):
    return Context(
        run_id=1, node_id=5, node_config=node_config, state=RecordDict(), run_config={}
    )


def test_train_full_none_and_failed_rounds_are_logged(tmp_path, monkeypatch):
    path = tmp_path / "rounds.jsonl"
    monkeypatch.setenv(ROUND_LOG_ENV, str(path))
    node = {"partition-id": 0, "num-partitions": 2, "memory-budget": "512MiB"}
    msg, _ = train_msg()
    assert not app(msg, ctx(node)).has_error()
    msg, _ = train_msg()
    cfg = msg.content.config_records["config"]
    cfg["server-round"], cfg["kind"], cfg["reason"] = 2, "none", "too small"
    cfg["min-budget-bytes"] = 600 * MiB
    assert not app(msg, ctx(node)).has_error()
    msg, _ = train_msg()
    cfg = msg.content.config_records["config"]
    cfg["server-round"], cfg["workload"] = 3, "nope"
    assert app(msg, ctx(node)).has_error()

    full, none, failed = RoundLogReader(path).read()
    assert full["round"] == 1 and full["kind"] == "full" and full["steps"] == 3
    assert full["budget_bytes"] == 512 * MiB and full["num_examples"] > 300
    assert full["train_loss"] > 0 and full["train_s"] > 0
    line = format_entry(full)
    assert line.startswith("round 1: full, 3 steps on ") and "budget 512.00 MiB" in line
    assert (none["round"], none["kind"], none["min_budget_bytes"]) == (
        2,
        "none",
        600 * MiB,
    )
    assert format_entry(none) == (
        "round 2: none, nothing fits (budget 512.00 MiB, needs 600.00 MiB): too small"
    )
    assert (failed["round"], failed["kind"]) == (3, "error")
    assert (
        format_entry(failed).startswith("round 3: error: ")
        and "nope" in failed["error"]
    )


def test_a_log_that_cannot_be_written_never_fails_the_reply(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv(ROUND_LOG_ENV, str(tmp_path))  # a folder: open() fails
    msg, _ = train_msg()
    with caplog.at_level(logging.WARNING, logger="client.round_log"):
        reply = app(msg, ctx({"partition-id": 0, "num-partitions": 2}))
    assert not reply.has_error()
    assert "cannot write the round log" in caplog.text


def test_reader_skips_corrupt_lines_and_waits_for_a_partial_one(tmp_path):
    path = tmp_path / "rounds.jsonl"
    reader = RoundLogReader(path)
    assert reader.read() == []  # not there yet
    entry = {
        "round": 4,
        "kind": "part",
        "window": [2, 6],
        "steps": 20,
        "num_examples": 1240,
        "train_loss": 0.512,
        "train_s": 3.21,
        "peak_bytes": 412 * MiB,
        "baseline_bytes": 300 * MiB,
        "budget_bytes": 512 * MiB,
    }
    append(entry, path)
    with open(path, "a") as f:
        f.write("not json\n[1, 2]\n")
        f.write('{"round": 5, "kind": "fu')  # the writer is not done yet
    assert reader.read() == [entry]
    with open(path, "a") as f:
        f.write('ll", "train_loss": NaN}\n')
    append({"round": 6, "kind": "full", "train_loss": float("nan")}, path)
    fifth, sixth = reader.read()
    assert fifth["round"] == 5 and sixth == {
        "round": 6,
        "kind": "full",
        "train_loss": None,
    }
    assert format_entry(entry) == (
        "round 4: part (blocks 2-5), 20 steps on 1,240 examples, loss 0.5120, "
        "peak 412.00 MiB (budget 512.00 MiB, runtime 300.00 MiB), 3.2 s"
    )
    assert format_entry({"round": 7}).startswith("round 7: ?")  # never a crash
    table = format_table(reader.entries).splitlines()
    assert table[0].split() == [
        "round", "work", "steps", "examples", "loss", "peak", "budget", "runtime",
        "time", "s",
    ]  # fmt: skip
    assert len(table) == 4 and "412.00 MiB" in table[1]
    assert format_table([]).split()[0] == "round"
