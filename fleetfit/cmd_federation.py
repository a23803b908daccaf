"""``fleetfit server`` and ``fleetfit client``: thin wrappers over Flower's own
``flower-superlink``, ``flwr run`` and ``flower-supernode``.

fleetfit server --port 9091 --rounds 3 --workload digits-cnn --min-nodes 2 --out runs/d
fleetfit client --superlink 127.0.0.1:9091 --memory-budget 512MB \\
    --partition-id 0 --num-partitions 2

``server`` starts a SuperLink, waits for it, registers SuperNode public keys if asked,
starts the run with ``flwr run`` (the ServerApp waits for ``--min-nodes`` nodes and
samples every connected node each round) and returns when the run ends, stopping the
SuperLink (also on Ctrl-C or an error); meanwhile it shows a row per round and a
progress bar (``simulations.progress``) under the run's streamed logs, and at the end
the per-round table. ``client`` starts a SuperNode with its budgets in the node config,
on a free local port, prints a line per round it trains in (``client.round_log``) and
stops it on Ctrl-C, with a table of those rounds. Without TLS options
both run insecure, with a warning; with ``--ssl-*`` (server) and
``--root-certificates`` (client) the links use TLS, and ``--enable-supernode-auth``
with ``--register KEY.pub`` lets only registered SuperNodes (``--auth-private-key``)
join. The SuperLink listens on loopback only; ``--public HOST:PORT`` lets other
machines in through nginx, which forwards only the Fleet API (``fleetfit/proxy.py``).
A busy port is refused before anything starts (``fleetfit/ports.py``); every process
the server runs is started by a supervisor that stops them all when the command ends,
however it ends (``fleetfit/supervise.py``). The exact Flower commands are in the
README's Deploy section.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Annotated

import typer

from fleetfit import options as opt
from fleetfit import ports, proxy, supervise
from fleetfit.args import input_file, output_dir, positive_float
from server.config import ServerConfig
from server.loop import no_update_reason
from server.precheck import check_start

log = logging.getLogger("fleetfit")
BIN = Path(sys.executable).parent
APP_DIR = Path(__file__).resolve().parents[1]  # the Flower app: pyproject.toml
_SERVER = ServerConfig()  # the run config's defaults: a flag not given keeps them

# flag -> the run-config key it sets; only the flags given are written
RUN_FLAGS = {
    "rounds": "num-server-rounds",
    "workload": "workload",
    "min_nodes": "min-nodes",
    "local_steps": "local-steps",
    "round_timeout": "round-timeout",
    "node_wait": "node-wait",
    "seed": "seed",
    "lr": "lr",
    "fraction": "fraction-train",
    "split": "split",
    "alpha": "dirichlet-alpha",
    "batch": "batch-size",
    "seq": "seq-len",
}


def register(app: typer.Typer) -> None:
    app.command(
        "server",
        help="Start a Flower SuperLink on loopback, run the federation with `flwr run` "
        "(progress and metrics as rounds end), stop. Options not given keep the run "
        "config's defaults (the Flower app's pyproject.toml).",
        short_help="run a federation's server: a Flower SuperLink and the run",
    )(server_command)
    app.command(
        "client",
        help="Start a Flower SuperNode with this device's budgets in its node config; "
        "print the rounds it trains; stop on Ctrl-C.",
        short_help="run a device: a Flower SuperNode with its memory budget",
    )(client_command)


def server_command(
    workload: opt.Workload = None,
    rounds: opt.Rounds = None,
    min_nodes: Annotated[
        int | None,
        typer.Option(
            min=1,
            help=f"nodes to wait for before the first round (default: "
            f"{_SERVER.min_nodes})",
            rich_help_panel=opt.TRAINING,
        ),
    ] = None,
    local_steps: opt.LocalSteps = None,
    lr: opt.Lr = None,
    fraction: opt.Fraction = None,
    seed: opt.Seed = None,
    split: opt.Split = None,
    alpha: opt.Alpha = None,
    batch: opt.Batch = None,
    seq: opt.Seq = None,
    round_timeout: Annotated[
        float | None,
        typer.Option(
            parser=opt.checked(positive_float),
            metavar="SECONDS",
            help="seconds to wait for a round's replies (default: "
            f"{_SERVER.round_timeout_s:g})",
            rich_help_panel=opt.TRAINING,
        ),
    ] = None,
    node_wait: Annotated[
        float | None,
        typer.Option(
            parser=opt.checked(positive_float),
            metavar="SECONDS",
            help=f"seconds to wait for --min-nodes (default: {_SERVER.node_wait_s:g})",
            rich_help_panel=opt.TRAINING,
        ),
    ] = None,
    run_config: Annotated[
        str,
        typer.Option(
            metavar="'KEY=VALUE ...'",
            help='more run-config keys, TOML values ("weight-clip=3 min-replies=2"); '
            "the keys are those of pyproject.toml's [tool.flwr.app.config]",
            show_default=False,
            rich_help_panel=opt.TRAINING,
        ),
    ] = "",
    host: Annotated[
        str,
        typer.Option(
            metavar="ADDRESS",
            help="the SuperLink's address: loopback only (its Control API starts runs)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            min=1, max=65535, help="the SuperLink's port", rich_help_panel=opt.NETWORK
        ),
    ] = 9091,
    public: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="let devices on other machines in here (e.g. 0.0.0.0:9092): nginx "
            "listens there with the --ssl-* files and forwards only the Fleet API to "
            "the loopback SuperLink (needs nginx and TLS) (default: loopback only)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    ssl_certfile: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="TLS: the server's certificate, PEM (nginx's, with --public)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    ssl_keyfile: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="TLS: its unencrypted PEM private key",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    ssl_ca_certfile: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="TLS: the CA certificate, PEM (the one devices verify)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    enable_supernode_auth: Annotated[
        bool,
        typer.Option(
            "--enable-supernode-auth",
            help="only registered SuperNodes may join (needs TLS)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = False,
    register: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY.pub",
            help="register a SuperNode's public key (OpenSSH EC key); repeatable",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    database: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="the SuperLink's state file (SQLite), kept across restarts so that "
            "SuperNodes and registered keys stay known (default: a fresh temporary "
            "one)",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="continue the run in --out from its state/ folder",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = False,
    progress: opt.Progress = True,
    out: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="run folder (default: runs/server-<timestamp>)",
            rich_help_panel=opt.OUTPUT,
        ),
    ] = None,
) -> int:
    args = argparse.Namespace(**locals())
    args.register = list(register or [])
    if args.out is None:
        if args.resume:
            raise ValueError("--resume continues a run: give its folder with --out")
        args.out = time.strftime("runs/server-%Y%m%d-%H%M%S")
    return run_server(args)


def client_command(
    superlink: Annotated[
        str,
        typer.Option(
            metavar="HOST:PORT",
            help="the SuperLink's Fleet API (with `fleetfit server --public`, nginx's "
            "address)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = "127.0.0.1:9091",
    memory_budget: Annotated[
        str | None,
        typer.Option(
            parser=opt.checked(opt.size),
            metavar="SIZE",
            help=f"{opt.BUDGET_HELP} (default: measured on this machine)",
            rich_help_panel=opt.MEMORY,
        ),
    ] = None,
    disk_budget: opt.DiskBudget = None,
    offload_dir: opt.OffloadDir = None,
    partition_id: Annotated[
        int,
        typer.Option(
            min=0,
            help="which share of the workload's training data this device holds, "
            "0..--num-partitions - 1 (simulated data; a real device has its own)",
            rich_help_panel=opt.DATA,
        ),
    ] = 0,
    num_partitions: Annotated[
        int,
        typer.Option(
            min=1,
            help="into how many shares the training data is split, one per device",
            rich_help_panel=opt.DATA,
        ),
    ] = 1,
    allow_workloads: Annotated[
        str | None,
        typer.Option(
            metavar="MOD:FN,...",
            help="module:function workloads (or module:*) this node may import, "
            "comma-separated (default: built-in workloads only)",
            rich_help_panel=opt.TRAINING,
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="the SuperNode's own loopback port, for its ClientApp "
            "(default: a free one)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    root_certificates: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="TLS: the CA certificate, PEM (default: no TLS, loopback or a "
            "trusted network only)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
    auth_private_key: Annotated[
        str | None,
        typer.Option(
            metavar="FILE",
            help="SuperNode authentication: this node's OpenSSH EC private key "
            "(its .pub registered with `fleetfit server --register`)",
            rich_help_panel=opt.NETWORK,
        ),
    ] = None,
) -> int:
    return run_client(argparse.Namespace(**locals()))


# ------------------------------------------------------------------- helpers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _env(flwr_home: Path) -> dict[str, str]:
    return dict(
        os.environ,
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_HOME=str(flwr_home),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )


def _start(
    sup: supervise.Supervisor, args: list[str], env: dict[str, str], logfile: Path
) -> supervise.Child:
    # Started by the supervisor, in its session: a signal meant for this command's
    # process group (Ctrl-C) reaches this command only, which stops it in order;
    # if this command dies, the supervisor stops it (fleetfit/supervise.py).
    return sup.spawn(Path(args[0]).name, args, env, log=logfile)


def stop(proc: supervise.Child | subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Stop a Flower process: SIGTERM, then SIGKILL. Its own children (superexec,
    serverapp, clientapp) watch their parent's pid and exit after it; the
    supervisor stops whatever is left when the command ends."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(
    host: str, port: int, ca: str | None, timeout_s: float, proc: supervise.Child
) -> None:
    """Wait until the SuperLink ``proc`` answers its health check on ``host:port``,
    and check that the answer is its own: every socket listening there belongs to
    ``proc`` (``ports.not_owned``). A second SuperLink on a port already taken fails
    to bind while the first one answers.

    Raises:
        ConnectionError: another process holds the port (named).
        RuntimeError: the SuperLink exited.
        TimeoutError: no answer within ``timeout_s``.
    """
    scheme = "https" if ca else "http"
    context = ssl.create_default_context(cafile=ca) if ca else None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            held = ports.holder(host, port)
            if held:
                raise ConnectionError(_taken(host, port, f"it is held by {held}"))
            raise RuntimeError(f"the SuperLink exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(
                f"{scheme}://{host}:{port}/health", timeout=2, context=context
            ):
                pass
        except OSError:
            time.sleep(0.3)
            continue
        check_superlink_is_ours(host, port, proc)
        return
    raise TimeoutError(f"the SuperLink on {host}:{port} was not up in {timeout_s} s")


def check_superlink_is_ours(host: str, port: int, proc: supervise.Child) -> None:
    """Before anything is sent to the SuperLink's Control API (keys, ``flwr run``):
    it is the one this command started, alive, and nothing else listens there.

    Raises:
        ConnectionError: another process holds the port.
        RuntimeError: the SuperLink exited.
    """
    if proc.poll() is not None:
        raise RuntimeError(f"the SuperLink exited with code {proc.returncode}")
    problem = ports.not_owned(host, port, [proc.pid])
    if problem is not None:
        raise ConnectionError(_taken(host, port, problem))


def _taken(host: str, port: int, held: str) -> str:
    return (
        f"the SuperLink this command started could not serve {host}:{port}: {held}; "
        "nothing was sent to it; stop that process, or give another port, e.g. "
        f"--port {ports.free_port_near(host, port)}"
    )


def _check_tls(files: dict[str, str | None]) -> bool:
    """Whether TLS is asked for: all of ``files`` (flag -> path) or none. Each is
    read and parsed here (certificates as PEM certificates, a key as the private key
    of the certificate), so a bad file fails before any process starts, naming its
    flag, rather than in the SuperLink, the SuperNode or the health check.

    Raises:
        ValueError: some but not all given; a file missing, unreadable or not PEM.
    """
    given = {flag: f for flag, f in files.items() if f}
    if given and len(given) != len(files):
        missing = ", ".join(flag for flag in files if flag not in given)
        raise ValueError(
            f"TLS needs all of {', '.join(files)}, or none of them; give {missing}"
        )
    for flag, f in given.items():
        kind = "a PEM private key" if flag == "--ssl-keyfile" else "a PEM certificate"
        input_file(flag, f, kind)
        if flag == "--ssl-keyfile":
            continue
        try:
            ssl.create_default_context().load_verify_locations(cafile=f)
        except ssl.SSLError as e:
            raise ValueError(
                f"{flag} {f!r} holds no PEM certificate ({e.reason or e}); give {kind} "
                "(a file that starts with -----BEGIN CERTIFICATE-----)"
            ) from None
    cert, key = given.get("--ssl-certfile"), given.get("--ssl-keyfile")
    if cert and key:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                cert, key, password=lambda: b""
            )
        except ssl.SSLError as e:
            raise ValueError(
                f"--ssl-keyfile {key!r} is not the unencrypted PEM private key of "
                f"--ssl-certfile {cert!r} ({e.reason or e}); give the key the certificate "
                "was made for"
            ) from None
    return bool(given)


def _check_ssh_key(flag: str, path: str, private: bool) -> None:
    """An OpenSSH EC key file as Flower reads it (SuperNode authentication)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_ssh_private_key,
        load_ssh_public_key,
    )

    kind = f"an OpenSSH EC {'private' if private else 'public'} key"
    data = input_file(flag, path, kind)
    try:
        key = load_ssh_private_key(data, None) if private else load_ssh_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ValueError(
            f"{flag} {path!r} is not {kind} ({e}); make one with "
            "ssh-keygen -t ecdsa -b 384 -N '' -f KEY (KEY.pub is the public one)"
        ) from None
    wanted = ec.EllipticCurvePrivateKey if private else ec.EllipticCurvePublicKey
    if not isinstance(key, wanted):
        raise ValueError(
            f"{flag} {path!r} is not {kind} but {type(key).__name__}; make one with "
            "ssh-keygen -t ecdsa -b 384 -N '' -f KEY (KEY.pub is the public one)"
        )


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``finally`` stops what was started."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _toml_str(value: str, flag: str = "") -> str:
    """``value`` as a TOML string that Flower's ``--run-config`` / ``--node-config``
    parser reads back: it splits ``key="..."`` or ``key='...'`` at the first closing
    quote and knows no escapes, so a ``"`` goes in a literal ``'...'`` string.

    Raises:
        ValueError: ``value`` holds both quotes, or ``"`` and a control character
            (naming ``flag``).
    """
    if '"' not in value:
        return json.dumps(value)  # a TOML basic string
    if "'" not in value and value.isprintable():
        return f"'{value}'"  # a TOML literal string: no escapes at all
    raise ValueError(
        f"{flag or 'value'} {value!r} holds both quote characters (or a quote and a "
        "control character), which Flower's key=value config cannot carry; give a "
        "path without them"
    )


# ------------------------------------------------------------------- server
_SQLITE_MAGIC = b"SQLite format 3\x00"


def superlink_database(path: str | None, work: Path) -> Path:
    """The SuperLink's state file: ``path`` (checked, its folder made), or a fresh one
    in ``work``. A kept database lets a restarted server find its SuperNodes (their
    ids) and registered keys again, so they need not restart before ``--resume``.

    Raises:
        ValueError: ``path`` is a folder, or a file that is not a SQLite database.
    """
    if not path:
        return work / "state.db"
    db = Path(path).expanduser().resolve()
    if db.is_dir():
        raise ValueError(
            f"--database {path!r} is a folder; give a file path, e.g. {db / 'state.db'}"
        )
    if db.is_file() and db.stat().st_size > 0:
        with open(db, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
        if head != _SQLITE_MAGIC:
            raise ValueError(
                f"--database {path!r} is not a SQLite database (a SuperLink's state); "
                "give a new path or the file an earlier `fleetfit server` wrote"
            )
    db.parent.mkdir(parents=True, exist_ok=True)
    return db


def server_run_config(args: argparse.Namespace, out: Path) -> str:
    """The ``--run-config`` of ``flwr run``: ``out``, the flags the user gave (a flag
    not given leaves its key to the app's run config, whose defaults are
    ``ServerConfig``'s), ``resume`` if asked, then ``--run-config``'s own keys."""
    pairs = [f"out={_toml_str(str(out), '--out')}"]
    for flag, key in RUN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            pairs.append(f"{key}={_toml_value(value)}")
    if args.resume:
        pairs.append("resume=true")
    return " ".join([*pairs, args.run_config]).strip()


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return _toml_str(value)
    return repr(value)  # an int, or a float (repr keeps its point: TOML's float)


def check_run_config(run_config: str) -> ServerConfig:
    """The server app's run config checked here, before any process starts: keys and
    values (``ServerConfig``) and the workload with its shape (a name that is no
    workload, a ``module:function`` that does not load). ``ValueError`` with one line
    naming the value; the ServerApp would otherwise fail only after the SuperLink and
    the run have started."""
    from flwr.common.config import parse_config_args

    try:
        parsed = parse_config_args([run_config])
    except Exception as e:  # flwr raises click's exception, whatever the fault
        raise ValueError(
            f"run config {run_config!r} is not space-separated key=value pairs with "
            f"TOML values ({getattr(e, 'message', e)}); fix --run-config, e.g. "
            '--run-config "lr=0.01 min-replies=2"'
        ) from None
    cfg = ServerConfig.from_run_config(parsed)
    app_keys = app_run_config_keys()
    foreign = [k for k in parsed if k not in app_keys]
    if foreign:
        # `flwr run` takes only the keys of the app's pyproject.toml and refuses any
        # other with a bare "Invalid run configuration", after the SuperLink started.
        raise ValueError(
            f"--run-config key(s) {', '.join(foreign)}: the Flower app's "
            f"{APP_DIR / 'pyproject.toml'} [tool.flwr.app.config] does not declare "
            "them, so `flwr run` would refuse the run; drop them; "
            f"fleetfit server takes: {', '.join(app_keys)}"
        )
    cfg.load_workload()
    return cfg


def app_run_config_keys() -> list[str]:
    """The run-config keys the Flower app declares (its pyproject.toml), in order:
    the only ones ``flwr run --run-config`` accepts."""
    import tomllib

    with open(APP_DIR / "pyproject.toml", "rb") as f:
        app = tomllib.load(f)
    return list(app["tool"]["flwr"]["app"]["config"])


def check_exposure(args: argparse.Namespace, tls: bool) -> tuple[str, int] | None:
    """Where devices reach the server: ``None`` (the SuperLink itself, on loopback)
    or ``--public``'s address, checked. The SuperLink's port also serves the Control
    API (start runs, register keys) to anyone, so it never leaves loopback; other
    machines come in through nginx, with TLS, to the Fleet API only.

    Raises:
        ValueError: ``--host`` is not loopback; ``--public`` without TLS, without
            nginx installed, or on the SuperLink's own port.
    """
    if not proxy.is_loopback(args.host):
        wanted = f"[{args.host}]" if ":" in args.host else args.host
        raise ValueError(
            f"--host {args.host} would put the SuperLink's Control API (anyone could "
            "start runs and register keys) on the network; keep --host on loopback "
            f"and let devices in with --public {wanted}:{args.port + 1} (nginx "
            "forwards only the Fleet API)"
        )
    if not args.public:
        return None
    public = proxy.parse_public(args.public)
    if not tls:
        raise ValueError(
            "--public needs TLS: give --ssl-certfile, --ssl-keyfile and "
            "--ssl-ca-certfile (the certificate devices verify, for the public name)"
        )
    host = public[0].strip("[]")
    if public[1] == args.port and host in ("0.0.0.0", "::", "", args.host):
        raise ValueError(
            f"--public {args.public} takes the SuperLink's own port {args.port}; "
            f"give another, e.g. --public {public[0]}:{args.port + 1}"
        )
    proxy.find_nginx()  # fails early, naming the package
    return public


def check_run_folder_free(args: argparse.Namespace) -> None:
    """Before anything starts or is read from ``--out``: no earlier ``fleetfit
    server`` of the run folder still runs (its processes, recorded in the folder's
    ``supervise.LOCK_NAME``, alive), which would write the same folder, or be
    resumed twice.

    Raises:
        ValueError: one line naming the run folder, the processes, the fix.
    """
    out = Path(args.out).expanduser()
    alive = supervise.survivors(out / supervise.LOCK_NAME)
    if alive:
        words = {"command": "fleetfit server", "supervisor": "its supervisor"}
        running = ", ".join(
            f"pid {pid} ({words.get(role, what)})" for pid, role, what in alive
        )
        command = [pid for pid, role, _ in alive if role == "command"]
        sup = [pid for pid, role, _ in alive if role == "supervisor"]
        if command:
            how = f"stop that server first (Ctrl-C there, or kill {command[0]})"
        elif sup:
            how = f"stop them first: kill {sup[0]} (their supervisor stops the rest)"
        else:
            how = "stop them first: kill " + " ".join(str(p) for p, _, _ in alive)
        flag = "--resume --out" if args.resume else "--out"
        raise ValueError(
            f"{flag} {args.out}: an earlier fleetfit server of this run folder "
            f"still runs: {running}; {how}, or give another --out"
        )


def check_ports_free(args: argparse.Namespace, public: tuple[str, int] | None) -> None:
    """Before anything starts: the SuperLink's port, and ``--public``'s, are free.

    Raises:
        ValueError: one line naming the port, what holds it, a free one.
    """
    held = ports.holder(args.host, args.port)
    if held:
        skip = [public[1]] if public else []
        raise ValueError(
            f"--port {args.port}: {args.host}:{args.port} is in use by {held}; stop "
            f"it, or give a free port, e.g. --port "
            f"{ports.free_port_near(args.host, args.port, skip)}"
        )
    if public:
        held = ports.holder(public[0], public[1])
        if held:
            example = ports.free_port_near(public[0], public[1], [args.port])
            raise ValueError(
                f"--public {args.public}: port {public[1]} is in use by {held}; stop "
                f"it, or give a free port, e.g. --public {public[0]}:{example}"
            )


def run_server(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    tls = _check_tls(
        {
            "--ssl-certfile": args.ssl_certfile,
            "--ssl-keyfile": args.ssl_keyfile,
            "--ssl-ca-certfile": args.ssl_ca_certfile,
        }
    )
    for key in args.register:
        _check_ssh_key("--register", key, private=False)
    if args.enable_supernode_auth and not tls:
        raise ValueError("--enable-supernode-auth needs TLS: give the --ssl-* files")
    public = check_exposure(args, tls)
    if not (APP_DIR / "pyproject.toml").is_file():
        raise FileNotFoundError(
            f"the fleetfit Flower app (pyproject.toml) is not in {APP_DIR}; run from a "
            "source checkout"
        )
    out = Path(args.out).resolve()
    check_run_folder_free(args)
    run_config = server_run_config(args, out)
    cfg = check_run_config(run_config)
    check_start(cfg)  # init-model and --resume state, as the ServerApp reads them
    num_rounds = cfg.num_server_rounds
    check_ports_free(args, public)
    output_dir("--out", args.out)
    if not tls:
        log.warning(
            "running WITHOUT TLS: messages travel in the clear; keep the SuperNodes "
            "on this machine, or give --ssl-certfile/--ssl-keyfile/--ssl-ca-certfile"
        )
    if public and not args.enable_supernode_auth:
        log.warning(
            "--public without --enable-supernode-auth: any device that holds the CA "
            "certificate can join as a SuperNode and receive the model"
        )
    # Every process from here on is started by the supervisor, which stops them all
    # and removes its work folder when this command ends, however it ends
    # (fleetfit/supervise.py); the finally below stops them in order first.
    sup = supervise.Supervisor(lock=out / supervise.LOCK_NAME)
    superlink: supervise.Child | None = None
    nginx: supervise.Child | None = None
    try:
        work = sup.work
        link_home, cli_home = work / "link", work / "cli"
        link_home.mkdir()
        cli_home.mkdir()
        # The SuperLink's own TLS files: the operator's, or (behind nginx) those of
        # a loopback CA made for this start, which nginx and the operator's `flwr`
        # verify.
        link_tls: tuple[str, str, str] | None = None
        nginx_cmd: list[str] | None = None
        if public:
            ca, cert, key = proxy.loopback_certificates(work / "loopback", args.host)
            link_tls = (str(cert), str(key), str(ca))
            config = proxy.nginx_config(
                public=public,
                certfile=str(Path(args.ssl_certfile).resolve()),
                keyfile=str(Path(args.ssl_keyfile).resolve()),
                upstream=(args.host, args.port),
                upstream_ca=ca,
                work=work / "nginx",
                logs=out,
            )
            nginx_cmd = proxy.prepare_nginx(
                proxy.find_nginx(), config, work / "nginx", out
            )
        elif tls:
            link_tls = (args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certfile)
        cmd = [
            str(BIN / "flower-superlink"),
            "--host",
            args.host,
            "--port",
            str(args.port),
            "--database",
            str(superlink_database(args.database, work)),
            "--disable-runtime-dependency-installation",
        ]
        if link_tls:
            cmd += ["--ssl-certfile", link_tls[0], "--ssl-keyfile", link_tls[1]]
            cmd += ["--ssl-ca-certfile", link_tls[2]]
        else:
            cmd.append("--insecure")
        if args.enable_supernode_auth:
            cmd.append("--enable-supernode-auth")
        conn = [f"address = {_toml_str(f'{args.host}:{args.port}')}"]
        if link_tls:
            ca_path = str(Path(link_tls[2]).resolve())
            conn.append(f"root-certificates = {_toml_str(ca_path)}")
        else:
            conn.append("insecure = true")
        (cli_home / "config.toml").write_text(
            '[superlink]\ndefault = "fleetfit"\n\n[superlink.fleetfit]\n'
            + "\n".join(conn)
            + "\n"
        )
        superlink = _start(sup, cmd, _env(link_home), out / "superlink.log")
        say = "fleetfit server:"
        print(
            f"{say} SuperLink (Fleet, Control and Runtime APIs) on "
            f"{args.host}:{args.port}{', TLS' if link_tls else ''}, loopback only",
            file=sys.stderr,
        )
        # Answers only from the SuperLink started here count (wait_healthy), and it
        # is checked again before each use of its Control API below.
        wait_healthy(
            args.host, args.port, link_tls[2] if link_tls else None, 60.0, superlink
        )
        if public and nginx_cmd:
            nginx = proxy.start_nginx(sup, nginx_cmd, out)  # once the SuperLink answers
            proxy.wait_listening(public, nginx, 30.0, out / "proxy.log")
            print(
                f"{say} nginx on {args.public} (TLS, {args.ssl_certfile}) forwards "
                f"only the Fleet API (POST {proxy.FLEET_PREFIX}...) to the SuperLink; "
                f"devices: fleetfit client --superlink <this host>:{public[1]} "
                f"--root-certificates {args.ssl_ca_certfile}",
                file=sys.stderr,
            )
        print(
            f"{say} the operator's flwr commands go to {args.host}:{args.port}: "
            f'FLWR_HOME={cli_home} flwr ls fleetfit (connection "fleetfit")',
            file=sys.stderr,
        )
        for key in args.register:  # the Control API, on loopback
            check_superlink_is_ours(args.host, args.port, superlink)
            code, said = sup.run(
                "flwr supernode register",
                [str(BIN / "flwr"), "supernode", "register", key, "fleetfit"],
                _env(cli_home),
                timeout_s=120,
            )
            if code != 0:
                raise RuntimeError(f"registering {key} failed: {said}")
            print(f"registered SuperNode key {key}", file=sys.stderr)
        print(f"{say} run config {run_config}", file=sys.stderr)
        check_superlink_is_ours(args.host, args.port, superlink)
        returncode = _flwr_run(
            sup,
            [
                str(BIN / "flwr"),
                "run",
                str(APP_DIR),
                "fleetfit",
                "--stream",
                "--run-config",
                run_config,
            ],
            _env(cli_home),
            out,
            num_rounds,
            bar=getattr(args, "progress", True),
        )
        _print_rounds(out)
        failure = run_failure(out, num_rounds, returncode)
        if failure:
            print(f"{say} {failure}; see {out}/superlink.log", file=sys.stderr)
            return 1
        print(f"run folder: {out}")
        return 0
    finally:
        if nginx is not None:
            stop(nginx)
        if superlink is not None:
            stop(superlink)
        sup.close()  # whatever is left; the work folder, with the loopback CA's key


def _flwr_run(
    sup: supervise.Supervisor,
    cmd: list[str],
    env: dict[str, str],
    out: Path,
    num_rounds: int,
    bar: bool = True,
) -> int:
    """Run ``flwr run --stream`` (started by the supervisor) to its end with a
    progress bar that follows the run folder's summary (``simulations.progress``);
    the run's streamed logs are read line by line from a pipe and printed above the
    bar. Returns its exit code; stops it on Ctrl-C or SIGTERM."""
    from simulations.progress import RoundProgress

    progress = RoundProgress(out / "summary.json", num_rounds, bar=bar)
    read_end, write_end = os.pipe()
    try:
        proc = sup.spawn(
            "flwr run",
            cmd,
            dict(env, PYTHONUNBUFFERED="1"),  # lines as they come, not in blocks
            stdout=write_end,
            cwd=APP_DIR,
        )
    except BaseException:
        os.close(read_end)
        progress.close()
        raise
    finally:
        os.close(write_end)
    stream = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115
    relay = threading.Thread(target=_relay_lines, args=(stream,), daemon=True)
    relay.start()
    try:
        returncode = proc.wait()
        relay.join(timeout=5)  # the last lines, once the pipe closes
        return returncode
    finally:
        stop(proc)
        progress.close()
        if not relay.is_alive():
            stream.close()


def _relay_lines(stream: IO[str] | None) -> None:
    """Print each line of ``stream`` through the shared console, above the bar."""
    from simulations.console import say

    if stream is None:
        return
    for line in stream:
        say(line.rstrip("\r\n"))


def _print_rounds(out: Path) -> None:
    """The per-round table of the run folder's summary (as ``fleetfit simulate``
    prints it), when it has rounds."""
    from fleetfit.cmd_simulate import format_rounds

    try:
        summary = json.loads((out / "summary.json").read_text())
        if summary.get("rounds"):
            print(format_rounds(summary))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # run_failure says why


def run_failure(out: Path, num_rounds: int, returncode: int) -> str:
    """Why a finished run failed, in one line ("" when it did not): ``flwr run``
    failed, the summary has fewer than ``num_rounds`` rounds, or no round accepted
    an update (``server.loop.no_update_reason``)."""
    summary_path = out / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    except (OSError, ValueError) as e:
        return f"the run folder's summary.json cannot be read ({e})"
    rounds = len(summary.get("rounds", []))
    if returncode != 0 or rounds < num_rounds:
        return (
            f"the run ended after {rounds} of {num_rounds} rounds "
            f"(flwr run exit {returncode})"
        )
    return no_update_reason(summary) or ""


# ------------------------------------------------------------------- client
def _warn_small_budget(text: str, budget: int) -> None:
    """Warn when ``--memory-budget`` cannot train anything: plans are made for the
    budget minus the runtime reserve (run config ``runtime-reserve``, default
    ``wire.shape.RUNTIME_RESERVE``), so a budget at or below the default reserve
    leaves nothing for training. Only a warning: the server's run config may set a
    smaller reserve."""
    from memory.sizes import format_bytes, parse_bytes
    from wire.shape import RUNTIME_RESERVE

    reserve = parse_bytes(RUNTIME_RESERVE)
    if budget <= reserve:
        log.warning(
            "--memory-budget %s (%s) is not above the default runtime reserve %s "
            "(run config runtime-reserve) that plans keep out of a budget: this node "
            "can train nothing under the default and will reply with an error each "
            "round; give more, e.g. --memory-budget 512MB",
            text,
            format_bytes(budget),
            format_bytes(reserve),
        )


def run_client(args: argparse.Namespace) -> int:
    from memory.sizes import parse_bytes

    _exit_on_sigterm()
    node = [
        f"partition-id={args.partition_id}",
        f"num-partitions={args.num_partitions}",
    ]
    if not 0 <= args.partition_id < args.num_partitions:
        raise ValueError(
            f"--partition-id {args.partition_id} must be in 0..{args.num_partitions - 1}"
        )
    if args.memory_budget is not None:
        budget = parse_bytes(args.memory_budget, what="--memory-budget")
        _warn_small_budget(args.memory_budget, budget)
        node.append(f"memory-budget={_toml_str(args.memory_budget)}")
    if args.disk_budget is not None:
        parse_bytes(args.disk_budget, what="--disk-budget", allow_zero=True)
        node.append(f"disk-budget={_toml_str(args.disk_budget)}")
    if args.offload_dir:
        from client.config import offload_dir_problem

        problem = offload_dir_problem(args.offload_dir)
        if problem is not None:
            raise ValueError(
                f"--offload-dir {args.offload_dir!r} cannot hold files ({problem}); "
                "give a folder you can write (made if missing), or leave "
                f"--offload-dir out to use {tempfile.gettempdir()}"
            )
        node.append(f"offload-dir={_toml_str(args.offload_dir, '--offload-dir')}")
    if args.allow_workloads is not None:
        from client.config import ALLOW_WORKLOADS, allowed_workloads

        allowed_workloads({ALLOW_WORKLOADS: args.allow_workloads})  # fails early
        node.append(f"{ALLOW_WORKLOADS}={_toml_str(args.allow_workloads)}")
    tls = _check_tls({"--root-certificates": args.root_certificates})
    if args.auth_private_key:
        _check_ssh_key("--auth-private-key", args.auth_private_key, private=True)
    if not tls:
        log.warning(
            "running WITHOUT TLS: connect only over loopback or a trusted network, "
            "or give --root-certificates"
        )
    home = Path(tempfile.mkdtemp(prefix="fleetfit-client-"))
    cmd = [
        str(BIN / "flower-supernode"),
        "--superlink",
        args.superlink,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port or free_port()),
        "--node-config",
        " ".join(node),
    ]
    cmd += ["--root-certificates", args.root_certificates] if tls else ["--insecure"]
    if args.auth_private_key:
        cmd += ["--auth-supernode-private-key", args.auth_private_key]
    print(f"fleetfit client: {' '.join(node)} -> {args.superlink}", file=sys.stderr)
    from client.round_log import ROUND_LOG_ENV, format_table

    # The ClientApp (a child of the SuperNode, same environment) appends a line per
    # round to this file; a thread prints each as it comes.
    rounds = _RoundLogPrinter(home / "rounds.jsonl")
    env = dict(_env(home), **{ROUND_LOG_ENV: str(rounds.path)})
    proc = subprocess.Popen(cmd, env=env)  # same process group: see _start
    try:
        return proc.wait()
    finally:
        stop(proc)
        entries = rounds.close()
        if entries:
            print(f"\nthe rounds this node took part in:\n{format_table(entries)}")


class _RoundLogPrinter:
    """Follows a SuperNode's round log (``client.round_log``) from a thread and
    prints one line per round through the shared console."""

    def __init__(self, path: Path, interval_s: float = 0.5) -> None:
        from client.round_log import RoundLogReader

        self.path = path
        self.reader = RoundLogReader(path)
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def close(self) -> list[dict]:
        """Print what is left, stop following; every entry read."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._print()
        return self.reader.entries

    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._print()

    def _print(self) -> None:
        from client.round_log import format_entry
        from simulations.console import say

        with self._lock:
            for entry in self.reader.read():
                say(format_entry(entry))
