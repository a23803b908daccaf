"""Per-round progress: the row and bar texts, the follower of a summary written round
by round (plain lines off a terminal), and log lines kept above a live bar."""

import io
import json
import logging
import re
import time

from rich.console import Console

from simulations.console import log_handler, say
from simulations.progress import RoundProgress, format_row, format_status

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def round_record(k: int, **kw) -> dict:
    r = {
        "round": k,
        "accuracy": 0.5 + k / 10,
        "loss": 1.2,
        "num_clients": 2,
        "num_sampled": 3,
        "train_loss": 0.75,
        "round_s": 1.25,
    }
    return r | kw


def write_rounds(path, rounds) -> None:
    tmp = path.with_suffix(".tmp")  # atomically, as server.persist does
    tmp.write_text(json.dumps({"rounds": rounds}))
    tmp.replace(path)


def test_row_and_status_texts():
    assert format_row(round_record(3), 10) == (
        "round 3/10  accuracy 0.8000  clients 2/3  train loss 0.7500  1.2 s"
    )
    lm = round_record(1, perplexity=12.345, train_loss=None)
    assert format_row(lm, 2) == (
        "round 1/2  perplexity 12.35  clients 2/3  train loss -  1.2 s"
    )
    status = format_status([round_record(1), round_record(2)], 5, 8.0)
    assert status == "accuracy 0.7000, 2/3 clients, 4.0 s/round, eta 12 s"
    assert format_status([], 5, 3.0).endswith("0.0 s/round, eta 0 s")


def follow(tmp_path, con: Console, rounds: int = 3) -> None:
    path = tmp_path / "summary.json"
    bar = RoundProgress(path, rounds, console=con, interval_s=0.02)
    done = []
    for k in range(1, rounds + 1):
        time.sleep(0.1)
        logging.getLogger("server.loop").info("round %d: aggregated", k)
        done.append(round_record(k))
        write_rounds(path, done)
    time.sleep(0.1)
    bar.close()


def test_off_a_terminal_one_plain_line_per_round(tmp_path):
    (tmp_path / "summary.json").write_text('{"rounds": [{"round": 9}]}')
    time.sleep(0.05)  # a summary older than the follower is an earlier run's
    buf = io.StringIO()
    follow(tmp_path, Console(file=buf, force_terminal=False, width=40))
    lines = buf.getvalue().splitlines()
    assert [line.split("  ")[0] for line in lines] == [
        "round 1/3",
        "round 2/3",
        "round 3/3",
    ]
    assert lines[0].endswith(" s") and "eta" in lines[0]
    assert "\x1b" not in buf.getvalue() and "\r" not in buf.getvalue()


def test_on_a_terminal_log_lines_print_above_the_bar(tmp_path, monkeypatch):
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=150)
    monkeypatch.setattr("simulations.console.bind", lambda: con)
    loop = logging.getLogger("server.loop")
    handler = log_handler()
    monkeypatch.setattr(loop, "handlers", [handler])
    monkeypatch.setattr(loop, "propagate", False)
    level = loop.level
    loop.setLevel(logging.INFO)
    try:
        follow(tmp_path, con)
    finally:
        loop.setLevel(level)
    # What the terminal shows: each redraw erases the bar (\r ESC[2K) and writes
    # the lines printed meanwhile, then the bar again, below them.
    screen = ANSI.sub("", buf.getvalue().split("\r")[-1].strip())
    shown = [ANSI.sub("", part) for part in buf.getvalue().split("\r")]
    logs = [s for s in shown if "round 3: aggregated" in s]
    assert logs and all(s.splitlines()[0].startswith("INFO") for s in logs), logs
    assert all("rounds" not in s.splitlines()[0] for s in logs)  # not in the bar
    assert any("round 3/3  accuracy 0.8000" in s for s in shown)
    assert (
        screen.startswith("rounds") and "3/3" in screen and "accuracy 0.8000" in screen
    )


def test_say_keeps_long_lines_whole_off_a_terminal():
    buf = io.StringIO()
    line = "INFO :      " + "x" * 200
    say(line, Console(file=buf, force_terminal=False, width=40))
    say("\x1b[32mgreen\x1b[0m", Console(file=buf, force_terminal=False))
    assert buf.getvalue() == line + "\ngreen\n"
