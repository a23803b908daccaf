"""Run a federation on Flower's simulation engine (Ray), in this process.

Example:
    >>> from simulations.run import SimulationSettings, simulate
    >>> from wire.shape import RunShape
    >>> summary = simulate(
    ...     SimulationSettings(
    ...         shape=RunShape(local_steps=10), num_clients=10, out="runs/demo"
    ...     )
    ... )

A fleet with its own budgets (bytes, entry ``partition-id mod count``; see
docs/federation.md): each client's peak is then measured in a child process.

    >>> from memory.sizes import parse_bytes
    >>> from server.config import FleetConfig
    >>> budgets = tuple(parse_bytes(s) for s in ("1GB", "200MB"))
    >>> simulate(
    ...     SimulationSettings(
    ...         num_clients=3, fleet=FleetConfig(memory_budgets=budgets)
    ...     )
    ... )
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.config import AdapterConfig, ExportConfig, FleetConfig, ServerConfig
from server.fedopt import ServerOptConfig
from server.precheck import check_start
from simulations.progress import RoundProgress
from wire.shape import RunShape

log = logging.getLogger(__name__)

_SERVER = ServerConfig()  # the run config's defaults, which a simulation keeps
RAY_PROBE_TIMEOUT_S = 5.0  # s: how long a Ray head's port may take to accept
_LOCAL_RAY_FIX = "or leave out --ray-address to run a local Ray"


@dataclass(frozen=True)
class SimulationSettings:
    """A simulated federation: the server's settings plus the fleet's size.

    The run's shape, the fleet, the export and the adapters are the server's own
    sub-configs (``ServerConfig.shape``, ``.fleet``, ``.export``, ``.adapters``): one
    name and one default each.
    """

    shape: RunShape = field(default_factory=RunShape)  # what every client trains on
    num_clients: int = 10  # virtual SuperNodes
    num_server_rounds: int = _SERVER.num_server_rounds  # [num-server-rounds]
    fraction_train: float = _SERVER.fraction_train  # [fraction-train] share of
    #   clients sampled per round
    out: str = "runs/simulation"  # run folder
    cpus_per_client: float = 1.0  # Ray resources per client actor
    fleet: FleetConfig = field(default_factory=FleetConfig)  # [fleet-*] by
    #   partition id; no memory budgets: each node uses 50% of the memory it measures
    client_measure: str = _SERVER.client_measure  # [client-measure] auto | child |
    #   inline: auto measures peaks in a child process for nodes given a budget
    strategy: str = _SERVER.strategy  # [strategy] fleetfit | exclude | heterofl |
    #   fedrolex (server.config)
    eval_windows: int = _SERVER.eval_windows  # [eval-windows] language models:
    #   held-out windows of the central evaluation
    export: ExportConfig = field(default_factory=ExportConfig)  # [export-onnx]
    #   [export-quantize] [eval-runtime] [eval-only]
    server_opt: ServerOptConfig = field(default_factory=ServerOptConfig)
    #   [server-opt] [server-lr] ... [aggregation] [trim-fraction]: the server
    #   optimiser and aggregation (server/fedopt.py)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    #   [adapters] [lora-rank] [lora-alpha] [lora-targets] [lora-base-dtype]: LoRA
    #   adapters for nodes that no whole-model plan fits, or for every node
    round_deadline_s: float = _SERVER.round_deadline_s  # [round-deadline] simulated
    #   seconds a device's round may take (server/simtime.py); 0: none
    init_model: str = ""  # [init-model] safetensors file the model starts from
    #   (a pretrained model, simulations/pretrain.py); "": from scratch
    progress: bool = False  # a progress bar on stderr, one step per round
    ray_address: str = ""  # an existing Ray cluster ("auto", or "HEAD:6379"); "":
    #   start a local Ray on this machine

    def server_config(self) -> ServerConfig:
        cfg = ServerConfig(
            shape=self.shape,
            num_server_rounds=self.num_server_rounds,
            fraction_train=self.fraction_train,
            min_nodes=self.num_clients,
            out=self.out,
            client_measure=self.client_measure,
            fleet=self.fleet,
            strategy=self.strategy,
            eval_windows=self.eval_windows,
            export=self.export,
            server_opt=self.server_opt,
            adapters=self.adapters,
            round_deadline_s=self.round_deadline_s,
            init_model=self.init_model,
        )
        cfg.validate()
        return cfg

    def validate(self) -> ServerConfig:
        """Check everything that can be checked before Ray starts."""
        if self.num_clients < 1:
            raise ValueError(f"num_clients={self.num_clients} must be at least 1")
        if not self.cpus_per_client > 0:
            raise ValueError(f"cpus_per_client={self.cpus_per_client} must be > 0")
        cfg = self.server_config()
        fleet = self.fleet
        for name, spec in (
            ("memory_budgets", fleet.memory_budgets),
            ("disk_budgets", fleet.disk_budgets),
        ):
            if len(spec) > self.num_clients:
                log.warning(
                    "%s has %d entries for %d clients: entries from %d on are unused",
                    name,
                    len(spec),
                    self.num_clients,
                    self.num_clients,
                )
        check_start(cfg)  # init-model (and resume) as the ServerApp reads them
        wl = cfg.load_workload()
        # The data must divide across the clients (raises a WorkloadError naming both).
        if fleet.classes and len(fleet.classes) != self.num_clients:
            raise ValueError(
                f"classes has {len(fleet.classes)} entries for {self.num_clients} "
                "clients: give one class index per client"
            )
        if wl.own_data:  # its load_data answers for the first client, up front
            if wl.data_fn is not None:
                wl.node_data(0, self.num_clients)
        else:
            wl.client_items(
                0,
                self.num_clients,
                self.shape.split,
                seed=self.shape.seed,
                alpha=self.shape.dirichlet_alpha,
                classes=fleet.classes or None,
                public_share=self.shape.public_share,
            )
        return cfg


def simulate(settings: SimulationSettings) -> dict[str, Any]:
    """Run the federation and return the run's summary (also in ``settings.out``)."""
    cfg = settings.validate()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from flwr.simulation import run_simulation

    from client.app import app as client_app
    from client.config import ALLOW_WORKLOADS_ENV
    from server.app import make_app
    from server.persist import SUMMARY_FILE

    if ":" in settings.shape.workload:
        # Simulated nodes run what the user who starts the simulation named (a real
        # SuperNode allows custom workloads only through its own node config).
        allowed = os.environ.get(ALLOW_WORKLOADS_ENV, "")
        if settings.shape.workload not in allowed.split(","):
            os.environ[ALLOW_WORKLOADS_ENV] = ",".join(
                x for x in (allowed, settings.shape.workload) if x
            )
    Path(settings.out).mkdir(parents=True, exist_ok=True)
    start_ray(settings.ray_address, settings.cpus_per_client)
    backend_config = {
        "client_resources": {"num_cpus": settings.cpus_per_client, "num_gpus": 0.0},
        "init_args": {},  # Ray is started above; Flower's engine joins it
    }
    bar = (
        RoundProgress(
            Path(settings.out) / SUMMARY_FILE,
            settings.num_server_rounds,
            rows=False,  # server.loop's log says each round, in this process
        )
        if settings.progress
        else None
    )
    try:
        with _quiet_deprecated_entry_point():
            run_simulation(
                server_app=make_app(cfg.to_run_config()),
                client_app=client_app,
                num_supernodes=settings.num_clients,
                backend_config=backend_config,  # type: ignore[arg-type]
            )
    finally:
        if bar is not None:
            bar.close()

    summary_path = Path(settings.out) / SUMMARY_FILE
    if not summary_path.exists():
        raise RuntimeError(
            f"the simulation ended without writing {summary_path}: see the log above"
        )
    import json

    summary: dict[str, Any] = json.loads(summary_path.read_text())
    if len(summary.get("rounds", [])) != settings.num_server_rounds:
        raise RuntimeError(
            f"the simulation completed {len(summary.get('rounds', []))} of "
            f"{settings.num_server_rounds} rounds: see the log above"
        )
    return summary


def ray_address_to_probe(address: str) -> tuple[str, str, int] | None:
    """Where a Ray address points: ``(as given, host, port)``, or ``None`` for a
    local Ray.

    ``""`` means a local Ray unless ``RAY_ADDRESS`` is set (``ray.init`` reads it
    then); ``"auto"`` means the cluster ``ray start`` left on this machine.

    Raises:
        ValueError: not ``HOST:PORT``.
        ConnectionError: ``auto`` and no Ray cluster runs on this machine.
    """
    shown = address
    if not address and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        shown = f"{address} (from RAY_ADDRESS)"
    if address in ("", "local"):
        return None
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:
            address = get_ray_address_from_environment("auto", None)
        except ConnectionError:
            raise ConnectionError(
                "Ray address auto: no running Ray cluster found on this machine (no "
                "`ray start --head`, RAY_ADDRESS unset): start one with "
                f"`ray start --head`, {_LOCAL_RAY_FIX}"
            ) from None
        shown = f"auto ({address})"
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"Ray address {shown!r} is not HOST:PORT: give a Ray head's address such "
            f"as 10.0.0.5:6379, or auto, {_LOCAL_RAY_FIX}"
        )
    return shown, host.strip("[]"), int(port)


def check_ray_address(address: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Fail within ``timeout_s`` when nothing listens at a Ray cluster's address.

    Given an address where nothing listens, ``ray.init`` retries for minutes (and
    reports the host's own IP for a loopback address); this fails at once instead,
    naming the address and the fix.

    Raises:
        ValueError: the address is not ``HOST:PORT``, ``auto`` or empty.
        ConnectionError: nothing accepts a connection there.
    """
    where = ray_address_to_probe(address)
    if where is None:
        return
    shown, host, port = where
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        if isinstance(e, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(e, TimeoutError):
            why = f"no answer in {timeout_s:g} s"
        elif isinstance(e, socket.gaierror):
            why = f"unknown host {host!r}"
        else:
            why = e.strerror or type(e).__name__
        raise ConnectionError(
            f"Ray address {shown}: no Ray head listens there ({why}): start one "
            f"there with `ray start --head --port={port}`, {_LOCAL_RAY_FIX}"
        ) from None


def start_ray(address: str, cpus_per_client: float) -> None:
    """Start a local Ray, or join the cluster at ``address``, as Flower's engine would;
    fail at once, naming the address and the fix, when there is no cluster there or
    it has too few CPUs for one client actor.

    Joining a running Ray (an earlier simulation of this process) is a no-op.

    Raises:
        ValueError: a malformed address.
        ConnectionError: no cluster at the address, or one without enough CPUs.
    """
    check_ray_address(address)
    import ray

    if ray.is_initialized():
        return
    # As Flower's RayBackend: the workers import this process's modules.
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    # ray.init replaces the SIGTERM handler with one raising SystemExit, which cannot
    # end a simulation (Flower's ServerApp thread is not a daemon and keeps the
    # process alive): the caller's handler is put back.
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    try:
        with warnings.catch_warnings():
            # Ray's tip about a future default for num_gpus=0; fleetfit's client
            # actors ask for no GPU either way.
            warnings.filterwarnings(
                "ignore",
                message="Tip: In future versions of Ray",
                category=FutureWarning,
            )
            ray.init(
                address=address or None,
                include_dashboard=False,
                log_to_driver=True,
                logging_level=logging.WARNING,
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            )
    except ConnectionError as e:  # something listens there, but no Ray head answers
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConnectionError(
            f"Ray address {address}: {first}: check the head's address and port "
            f"(`ray status` on the head prints them), {_LOCAL_RAY_FIX}"
        ) from None
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if cpus < cpus_per_client:
        ray.shutdown()
        where = f"at {address}" if address else "started here"
        raise ConnectionError(
            f"the Ray cluster {where} has {cpus:g} CPU(s), fewer than the "
            f"{cpus_per_client:g} one client actor needs: add a worker "
            "(`ray start --address=HEAD:PORT`), or lower cpus_per_client"
        )
    log.debug("Ray: %g CPU(s) at %s", cpus, address or "a local Ray")


@contextmanager
def _quiet_deprecated_entry_point() -> Iterator[None]:
    """Drop Flower's log record that ``run_simulation`` is deprecated, and only that.

    fleetfit calls the deprecated entry point on purpose (docs/simulations.md says
    what moving off it changes); the warning is for fleetfit's maintainers, not for
    the user who runs a simulation.
    """

    def keep(record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()

    flwr_log = logging.getLogger("flwr")
    flwr_log.addFilter(keep)
    try:
        yield
    finally:
        flwr_log.removeFilter(keep)
