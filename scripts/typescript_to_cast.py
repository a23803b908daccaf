"""A terminal recording by util-linux ``script`` (typescript + timing file, classic
format) as an asciinema v2 cast, or (``--text``) as the text left on the screen.

    python scripts/typescript_to_cast.py out.typescript out.timing --command "fleetfit simulate" > simulate.cast
    python scripts/typescript_to_cast.py out.typescript out.timing --text > simulate.txt

Used by ``scripts/record-demo``. The text rendering understands what the commands
write: lines, carriage returns, cursor up, erase line and colours (dropped); rich's
live progress bar redraws in place, so only its last state remains, as on a screen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][A-Z0-9]|\x1b[=>]")


def chunks(typescript: bytes, timing: str) -> list[tuple[float, bytes]]:
    """``(seconds since start, bytes)`` per write, from the classic timing format
    (``delay nbytes`` per line) over the typescript without its header line."""
    data = typescript
    if data.startswith(b"Script started"):
        data = data[data.index(b"\n") + 1 :]
    out, t, pos = [], 0.0, 0
    for line in timing.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        t += float(parts[0])
        n = int(parts[1])
        out.append((t, data[pos : pos + n]))
        pos += n
    return out


def screen_text(stream: str) -> str:
    """What ``stream`` leaves on an endless screen."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(stream):
        m = CSI.match(stream, i)
        if m:
            arg, op = m.group(1) or "", m.group(2)
            n = int(arg) if arg.isdigit() else 1
            if op == "A":
                row = max(0, row - n)
            elif op == "B":
                row += n
            elif op == "K":
                if arg in ("", "0"):
                    del lines[row][col:]
                elif arg == "2":
                    lines[row] = []
            elif op == "G":
                col = n - 1
            i = m.end()
            while len(lines) <= row:
                lines.append([])
            continue
        ch = stream[i]
        i += 1
        if ch == "\n":
            row += 1
            col = 0
            while len(lines) <= row:
                lines.append([])
        elif ch == "\r":
            col = 0
        elif ch == "\x1b" or ord(ch) < 32 and ch != "\t":
            continue
        else:
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
    text = "\n".join("".join(line).rstrip() for line in lines).rstrip("\n") + "\n"
    return re.sub(r"\nScript done.*\n?$", "\n", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("typescript")
    ap.add_argument("timing")
    ap.add_argument("--command", default="", help="the command line the cast shows")
    ap.add_argument("--text", action="store_true", help="the screen's text instead")
    a = ap.parse_args()
    with open(a.typescript, "rb") as f:
        typescript = f.read()
    with open(a.timing) as f:
        events = chunks(typescript, f.read())
    if a.text:
        stream = b"".join(b for _, b in events).decode("utf-8", "replace")
        sys.stdout.write(screen_text(stream))
        return 0
    header = {
        "version": 2,
        "width": int(os.environ.get("COLUMNS", 100)),
        "height": int(os.environ.get("LINES", 30)),
        "env": {"TERM": "xterm-256color", "SHELL": "/bin/bash"},
        "title": a.command,
    }
    print(json.dumps(header))
    if a.command:
        print(json.dumps([0.0, "o", f"$ {a.command}\r\n"]))
    for t, b in events:
        print(json.dumps([round(t, 6), "o", b.decode("utf-8", "replace")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
