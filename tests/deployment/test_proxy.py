"""``fleetfit server --public``: nginx in front of a loopback SuperLink, forwarding
only the Fleet API. The devices' address is 127.0.0.2 (the "public" side), the
SuperLink's 127.0.0.1, all on loopback. An outsider there who holds the CA
certificate can neither register a key, list runs nor start a run; a registered
SuperNode trains through it; an unregistered one is refused."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fleetfit import proxy
from tests.deployment.test_commands import FLEETFIT, env, make_tls, wait_for
from tests.deployment.test_loopback import BIN, ROOT, Processes, free_port

PUBLIC = "127.0.0.2"  # what the devices (and the outsider) reach


def nginx_or_skip() -> str:
    """nginx's path; without it, skip here and fail in CI (which installs it)."""
    try:
        return proxy.find_nginx()
    except ValueError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs nginx (.ci/run), and it is missing: {e}")
        pytest.skip(f"needs nginx: apt-get install {proxy.NGINX_PACKAGE} ({e})")


# ----------------------------------------------------------- no processes
def test_fleet_routes_are_flowers_whole_fleet_api():
    """The forwarded routes are exactly the installed flwr's Fleet routes, and a
    SuperNode calls nothing else (an upgrade that adds one fails here)."""
    from flwr.superlink.routers.fleet.router import router
    from flwr.supernode import fleet_http_client

    served = {route.path for route in router.routes}  # type: ignore[attr-defined]
    called = set(
        re.findall(r'path="(/[^"]+)"', Path(fleet_http_client.__file__).read_text())
    )
    ours = {proxy.FLEET_PREFIX + r for r in proxy.FLEET_ROUTES}
    assert served == ours
    assert called == ours


@pytest.mark.child  # nginx -t checks the config: one process
def test_nginx_config_passes_only_the_fleet_routes(tmp_path):
    nginx = nginx_or_skip()
    tls = make_tls(tmp_path)
    ca, _, _ = proxy.loopback_certificates(tmp_path / "loopback", "127.0.0.1")
    config = proxy.nginx_config(
        public=(PUBLIC, 9092),
        certfile=str(tls["cert"]),
        keyfile=str(tls["key"]),
        upstream=("127.0.0.1", 9091),
        upstream_ca=ca,
        work=tmp_path / "nginx",
        logs=tmp_path,
    )
    passed = re.findall(r"location = (\S+) \{[^}]*\}\s*proxy_pass https://", config)
    assert passed == [proxy.FLEET_PREFIX + r for r in proxy.FLEET_ROUTES]
    assert config.count("proxy_pass") == len(proxy.FLEET_ROUTES)
    assert "location / { return 403; }" in config
    assert f"listen {PUBLIC}:9092 ssl;" in config and "daemon off;" in config
    cmd = proxy.prepare_nginx(nginx, config, tmp_path / "nginx", tmp_path)  # nginx -t
    assert cmd[0] == nginx


# ------------------------------------------------------------ real processes
def outsider(
    home: Path, port: int, ca: Path, *args: str
) -> subprocess.CompletedProcess:
    """A ``flwr`` command from someone who reaches the public address with the CA
    certificate."""
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "outside"\n\n[superlink.outside]\n'
        f'address = "{PUBLIC}:{port}"\nroot-certificates = "{ca}"\n'
    )
    return subprocess.run(
        [str(BIN / "flwr"), *args],
        env=dict(env(), FLWR_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def status(url: str, ca: Path, method: str = "POST") -> int:
    request = urllib.request.Request(url, data=b"" if method == "POST" else None)
    request.method = method
    try:
        with urllib.request.urlopen(
            request, timeout=10, context=ssl.create_default_context(cafile=str(ca))
        ) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.heavy
@pytest.mark.deployment
def test_public_proxy_lets_devices_in_and_keeps_outsiders_out(tmp_path):
    nginx_or_skip()
    tls = make_tls(tmp_path, ips=("127.0.0.1", PUBLIC))
    port, public_port = free_port(), free_port()
    out = tmp_path / "run"
    procs = Processes(tmp_path)
    try:
        server = procs.start(
            "server",
            [
                *FLEETFIT,
                "server",
                "--port",
                str(port),
                "--public",
                f"{PUBLIC}:{public_port}",
                "--workload",
                "digits-mlp",
                "--rounds",
                "1",
                "--min-nodes",
                "1",
                "--local-steps",
                "2",
                "--run-config",  # what the proxy is tested on, not the measurement
                "client-measure='inline' export-onnx='off'",
                "--out",
                str(out),
                "--ssl-certfile",
                str(tls["cert"]),
                "--ssl-keyfile",
                str(tls["key"]),
                "--ssl-ca-certfile",
                str(tls["ca"]),
                "--enable-supernode-auth",
                "--register",
                str(tls["good.pub"]),
            ],
            env(),
        )
        log = tmp_path / "server.log"
        wait_for(
            lambda: (
                "registered SuperNode key" in log.read_text()
                or server.poll() is not None
            ),
            120,
            "the server never registered the key",
        )
        said = log.read_text()
        assert server.poll() is None, said[-3000:]
        assert (
            f"SuperLink (Fleet, Control and Runtime APIs) on 127.0.0.1:{port}" in said
        )
        assert f"nginx on {PUBLIC}:{public_port}" in said
        assert "forwards only the Fleet API" in said

        # The SuperLink itself is not on the public address.
        with pytest.raises(OSError):
            socket.create_connection((PUBLIC, port), timeout=2).close()

        home, ca = tmp_path / "outsider", tls["ca"]
        refused = {
            "register-node": outsider(
                home, public_port, ca, "supernode", "register", str(tls["bad.pub"])
            ),
            "list-runs": outsider(home, public_port, ca, "ls"),
            "start-run": outsider(
                home, public_port, ca, "run", str(ROOT), "--run-config", "out='/x'"
            ),
        }
        for route, done in refused.items():
            said = done.stdout + done.stderr
            assert done.returncode != 0, said
            assert "403" in said and f"/v1/control/{route}" in said, said
        base = f"https://{PUBLIC}:{public_port}"
        for path in ("/health", "/docs", "/v1/runtime/pull-task-input", "/nosuch"):
            assert status(base + path, ca) == 403, path
        assert status(base + "/v1/fleet/get-run", ca, method="GET") == 403

        common = [
            "--superlink",
            f"{PUBLIC}:{public_port}",
            "--root-certificates",
            str(ca),
            "--num-partitions",
            "2",
            "--memory-budget",
            "1GB",
        ]
        bad = procs.start(
            "bad",
            [*FLEETFIT, "client", *common, "--partition-id", "1"]
            + ["--auth-private-key", str(tls["bad"])],
            env(),
        )
        procs.start(
            "good",
            [*FLEETFIT, "client", *common, "--partition-id", "0"]
            + ["--auth-private-key", str(tls["good"])],
            env(),
        )
        assert server.wait(timeout=300) == 0, log.read_text()[-3000:]
        bad_log = tmp_path / "bad.log"
        assert bad.wait(timeout=60) != 0, bad_log.read_text()[-2000:]
        assert "Failed to activate SuperNode" in bad_log.read_text()
    finally:
        procs.stop()
    assert all(p.poll() is not None for p in procs.procs)

    (r,) = json.loads((out / "summary.json").read_text())["rounds"]
    assert r["num_clients"] == 1
    assert [a["partition_id"] for a in r["assignments"]] == [0]
    access = (out / "proxy-access.log").read_text()
    for route in refused:
        assert re.search(rf'"POST /v1/control/{route} HTTP/1.1" 403', access), route
    assert re.search(r'"POST /v1/fleet/push-messages HTTP/1.1" 200', access)
    # nginx and the SuperLink went with the server: nothing listens any more.
    for address in ((PUBLIC, public_port), ("127.0.0.1", port)):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(address, timeout=1).close()
            except OSError:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"something still listens on {address}")
