"""The proxy in front of a public ``fleetfit server``: nginx, forwarding only the
Fleet API to a SuperLink that listens on loopback.

fleetfit server --public 0.0.0.0:9092 --ssl-certfile server.crt \\
    --ssl-keyfile server.key --ssl-ca-certfile ca.crt --enable-supernode-auth \\
    --register node0.pub --out runs/public

Flower 1.42's SuperLink serves its Fleet API (SuperNodes), Control API (``flwr run``,
``flwr ls``, ``flwr supernode register``) and Runtime API (the ServerApp) as HTTP
routes of one server on one port (``/v1/fleet/...``, ``/v1/control/...``,
``/v1/runtime/...``), and the open-source SuperLink authenticates no ``flwr`` user:
whoever reaches that port with the CA certificate controls the federation. So the
SuperLink stays on loopback, and devices reach it through nginx, which terminates
their TLS and passes on ``POST`` to the twelve Fleet routes below and nothing else
(403). nginx runs as a child of the command's process supervisor
(``fleetfit.supervise``), with a config and logs of its own, no system service; as
root its workers drop to nginx's default unprivileged user.

Flower refuses SuperNode authentication without TLS, so the loopback SuperLink gets
TLS too, from a certificate authority generated for this one start
(``loopback_certificates``); nginx verifies the SuperLink against it, and so do the
operator's own ``flwr`` commands, which go to loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fleetfit import ports

if TYPE_CHECKING:
    from fleetfit.supervise import Child, Supervisor

# The Fleet API's routes in flwr 1.42 (flwr/superlink/routers/fleet/router.py, what
# flwr/supernode/fleet_http_client.py calls), all POST under FLEET_PREFIX.
# tests/deployment/test_proxy.py checks this list against the installed flwr.
FLEET_PREFIX = "/v1/fleet/"
FLEET_ROUTES = (
    "register-node",
    "activate-node",
    "deactivate-node",
    "unregister-node",
    "send-node-heartbeat",
    "pull-messages",
    "push-messages",
    "get-run",
    "get-fab",
    "push-object",
    "pull-object",
    "confirm-message-received",
)
NGINX_PACKAGE = "nginx-light"  # Debian/Ubuntu; any nginx with ssl and proxy works
MAX_BODY = "64m"  # one request: Flower sends arrays in 5 MiB chunks (push-object)
LOOPBACK_NAME = "localhost"  # the name nginx checks on the loopback certificate


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_public(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::]:9092`` for IPv6) of ``--public``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--public {value!r} is not HOST:PORT; give the address devices reach, "
            "e.g. --public 0.0.0.0:9092 (all interfaces) or --public [::]:9092"
        )
    return host, int(port)


def find_nginx() -> str:
    """The nginx binary (``FLEETFIT_NGINX``, else ``nginx`` on PATH or in /usr/sbin).

    Raises:
        ValueError: no nginx; the message names the package to install.
    """
    given = os.environ.get("FLEETFIT_NGINX")
    if given:
        if not (Path(given).is_file() and os.access(given, os.X_OK)):
            raise ValueError(f"FLEETFIT_NGINX={given!r} is not an executable file")
        return given
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = shutil.which("nginx", path=path)
    if found is None:
        raise ValueError(
            "--public puts nginx in front of the SuperLink, and nginx is not "
            f"installed: apt-get install {NGINX_PACKAGE} (or set FLEETFIT_NGINX to "
            "an nginx binary)"
        )
    return found


def loopback_certificates(folder: Path, host: str) -> tuple[Path, Path, Path]:
    """A certificate authority and a certificate for ``host`` and ``localhost``,
    made for one start of the loopback SuperLink; returns (ca, cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    begins, ends = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=365)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, "fleetfit loopback CA")]
    )
    ca = (
        x509.CertificateBuilder(
            issuer_name=ca_name,
            subject_name=ca_name,
            public_key=ca_key.public_key(),
            serial_number=x509.random_serial_number(),
            not_valid_before=begins,
            not_valid_after=ends,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = [x509.DNSName(LOOPBACK_NAME)]
    if host.strip("[]").lower() != LOOPBACK_NAME:
        names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder(
            issuer_name=ca_name,
            subject_name=x509.Name(
                [x509.NameAttribute(NameOID.COMMON_NAME, LOOPBACK_NAME)]
            ),
            public_key=key.public_key(),
            serial_number=x509.random_serial_number(),
            not_valid_before=begins,
            not_valid_after=ends,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = folder / "ca.crt", folder / "superlink.crt", folder / "superlink.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    fd = os.open(paths[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return paths


def nginx_config(
    *,
    public: tuple[str, int],
    certfile: str,
    keyfile: str,
    upstream: tuple[str, int],
    upstream_ca: Path,
    work: Path,
    logs: Path,
) -> str:
    """nginx's whole config: TLS on ``public``, ``POST`` to the Fleet routes passed
    to ``https://upstream`` (verified against ``upstream_ca``), everything else 403.
    Temporary files and the pid live in ``work``; the logs in ``logs``."""
    host, port = public
    up_host, up_port = upstream
    up_host = f"[{up_host.strip('[]')}]" if ":" in up_host else up_host
    listen = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
    temp = "\n".join(
        f"    {kind}_temp_path {work / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    routes = "\n".join(
        f"        location = {FLEET_PREFIX}{route} {{\n"
        "            limit_except POST { deny all; }\n"
        "            proxy_pass https://superlink;\n"
        "        }"
        for route in FLEET_ROUTES
    )
    return f"""# written by fleetfit server: only the Fleet API reaches the SuperLink
daemon off;
worker_processes 1;
pid {work / "nginx.pid"};
error_log {logs / "proxy.log"} notice;
events {{ worker_connections 1024; }}
http {{
    access_log {logs / "proxy-access.log"};
{temp}
    server_tokens off;
    upstream superlink {{
        server {up_host}:{up_port};
        keepalive 16;
    }}
    server {{
        listen {listen} ssl;
        ssl_certificate {certfile};
        ssl_certificate_key {keyfile};
        ssl_protocols TLSv1.2 TLSv1.3;
        client_max_body_size {MAX_BODY};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_request_buffering off;
        proxy_buffering off;
        proxy_read_timeout 300s;
        proxy_send_timeout 300s;
        proxy_ssl_verify on;
        proxy_ssl_trusted_certificate {upstream_ca};
        proxy_ssl_name {LOOPBACK_NAME};
        proxy_ssl_session_reuse on;
{routes}
        location / {{ return 403; }}
    }}
}}
"""


def prepare_nginx(nginx: str, config: str, work: Path, logs: Path) -> list[str]:
    """Write ``config`` in ``work`` and test it (``nginx -t``), before anything
    starts; returns the command that runs nginx in the foreground.

    Raises:
        ValueError: nginx refused the config; the message is nginx's own.
    """
    temps = [
        work / kind for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    ]
    for d in temps:
        d.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        # nginx's workers drop to its default user (nobody): let them reach their
        # temporary folders and nothing else (the master reads keys and opens logs).
        import pwd

        nobody = pwd.getpwnam("nobody").pw_uid
        for d in (work.parent, work):
            d.chmod(0o711)
        for d in temps:
            os.chown(d, nobody, -1)
    conf = work / "nginx.conf"
    conf.write_text(config)
    cmd = [nginx, "-p", str(work), "-c", str(conf), "-e", str(logs / "proxy.log")]
    tested = subprocess.run(
        [*cmd, "-t", "-q"], capture_output=True, text=True, timeout=30
    )
    if tested.returncode != 0:
        reason = " ".join((tested.stderr or tested.stdout).split())
        raise ValueError(f"nginx refused its config ({conf}): {reason}")
    return cmd


def start_nginx(sup: Supervisor, cmd: list[str], logs: Path) -> Child:
    """Start nginx (``prepare_nginx``'s command) through the server's supervisor,
    like the SuperLink (``fleetfit.supervise``); its output joins its error log."""
    return sup.spawn(
        "nginx", cmd, dict(os.environ), log=logs / "proxy.log", append=True
    )


def wait_listening(
    public: tuple[str, int], proc: Child, timeout_s: float, log: Path
) -> None:
    """Wait until nginx accepts connections on ``public``, and check that what
    listens there is this nginx (``ports.not_owned``).

    Raises:
        RuntimeError: nginx exited (the last line of its log says why).
        ConnectionError: another process listens on ``public``.
        TimeoutError: nothing listened within ``timeout_s``.
    """
    host, port = public
    host = host.strip("[]")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"nginx exited with code {proc.returncode}: "
                f"{lines[-1] if lines else 'no log'} (see {log})"
            )
        try:
            with socket.create_connection((host, port), timeout=1):
                pass
        except OSError:
            time.sleep(0.2)
            continue
        problem = ports.not_owned(public[0], port, [proc.pid])
        if problem is not None:
            raise ConnectionError(
                f"--public {public[0]}:{port}: {problem}, not by the nginx this "
                "command started; stop that process, or give another --public port"
            )
        return
    raise TimeoutError(f"nginx was not listening on {host}:{port} in {timeout_s} s")
