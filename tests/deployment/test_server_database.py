"""``fleetfit server --database``: the SuperLink's state kept across server restarts, so
SuperNodes that keep running are found again by a resumed server; and the option's
input checks."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from fleetfit.cmd_federation import superlink_database
from tests.deployment.test_commands import FLEETFIT, env
from tests.deployment.test_loopback import ROOT, Processes, free_port


def test_default_is_a_fresh_file_in_the_work_folder(tmp_path):
    assert superlink_database(None, tmp_path) == tmp_path / "state.db"
    assert superlink_database("", tmp_path) == tmp_path / "state.db"


def test_a_given_path_is_used_and_its_folder_made(tmp_path):
    db = tmp_path / "deep" / "er" / "state.db"
    assert superlink_database(str(db), tmp_path / "work") == db.resolve()
    assert db.parent.is_dir() and not db.exists()  # the SuperLink creates the file


def test_a_sqlite_file_is_accepted(tmp_path):
    import sqlite3

    db = tmp_path / "state.db"
    with sqlite3.connect(db) as c:
        c.execute("create table t (x)")
    assert superlink_database(str(db), tmp_path) == db.resolve()


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: p.mkdir(), "is a folder"),
        (lambda p: p.write_text("not a database"), "is not a SQLite database"),
        (lambda p: p.write_bytes(b"\x00" * 100), "is not a SQLite database"),
    ],
)
def test_bad_databases_are_refused_naming_the_path(tmp_path, make, why):
    bad = tmp_path / "state.db"
    make(bad)
    before = bad.read_bytes() if bad.is_file() else None
    with pytest.raises(ValueError, match=why) as e:
        superlink_database(str(bad), tmp_path)
    assert str(bad) in str(e.value)
    if before is not None:
        assert bad.read_bytes() == before  # left as it was


@pytest.mark.child
def test_the_cli_reports_a_bad_database_before_starting(tmp_path, capsys, monkeypatch):
    from fleetfit import cmd_federation
    from fleetfit.cli import main

    monkeypatch.setattr(cmd_federation, "_exit_on_sigterm", lambda: None)
    monkeypatch.setattr(
        cmd_federation, "_start", lambda *a: pytest.fail("started a SuperLink")
    )

    bad = tmp_path / "state.db"
    bad.write_text("hello")
    code = main(["server", "--out", str(tmp_path / "run"), "--database", str(bad)])
    assert code == 2
    assert "is not a SQLite database" in capsys.readouterr().err


@pytest.mark.heavy
@pytest.mark.deployment
def test_a_restarted_server_on_its_database_finds_the_running_supernodes(tmp_path):
    """Server run 1 (1 round) ends and its SuperLink stops; the two SuperNodes keep
    running, never restarted; server run 2 on the same database with --resume finds
    them and completes round 2 with both."""
    port = free_port()
    out, db = tmp_path / "run", tmp_path / "link" / "state.db"
    procs = Processes(tmp_path)
    try:
        for i in range(2):
            procs.start(
                f"client{i}",
                [
                    *FLEETFIT,
                    "client",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--memory-budget",
                    "512MB",
                    "--partition-id",
                    str(i),
                    "--num-partitions",
                    "2",
                ],
                env(),
            )
        common = [
            *FLEETFIT,
            "server",
            "--port",
            str(port),
            "--local-steps",
            "2",
            "--out",
            str(out),
            "--database",
            str(db),
            "--node-wait",
            "120",
            "--round-timeout",
            "240",
        ]
        for rounds, extra in ((1, []), (2, ["--resume"])):
            done = subprocess.run(
                [*common, "--rounds", str(rounds), *extra],
                env=env(),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        rounds = json.loads((out / "summary.json").read_text())["rounds"]
        assert [r["round"] for r in rounds] == [1, 2]
        # what the resumed server showed: a row per round, then the table
        assert "round 2/2  accuracy " in done.stderr, done.stderr[-3000:]
        table = done.stdout.splitlines()
        assert table[0].split()[:3] == ["round", "clients", "accuracy"], done.stdout
        assert [row.split()[:2] for row in table[1:3]] == [["1", "2/2"], ["2", "2/2"]]
        # and each device: a line per round it trained in, with its peak and budget
        deadline = time.monotonic() + 10
        while "round 2: full" not in (log := (tmp_path / "client0.log").read_text()):
            assert time.monotonic() < deadline, log[-3000:]
            time.sleep(0.5)
        assert "round 1: full, 2 steps on " in log
        assert "(budget 488.28 MiB, runtime " in log, log[-3000:]
        for r in rounds:
            ok = [a for a in r["assignments"] if a["status"] == "ok"]
            assert len(ok) == 2, r["assignments"]
        assert Path(db).stat().st_size > 0
    finally:
        procs.stop()
