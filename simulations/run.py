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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.config import ExportConfig, FleetConfig, ServerConfig
from simulations.progress import RoundProgress
from wire.shape import RunShape

log = logging.getLogger(__name__)

_SERVER = ServerConfig()  # the run config's defaults, which a simulation keeps


@dataclass(frozen=True)
class SimulationSettings:
    """A simulated federation: the server's settings plus the fleet's size.

    The run's shape, the fleet and the export are the server's own sub-configs
    (``ServerConfig.shape``, ``.fleet``, ``.export``): one name and one default each.
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
    strategy: str = _SERVER.strategy  # [strategy] fleetfit | exclude
    eval_windows: int = _SERVER.eval_windows  # [eval-windows] language models:
    #   held-out windows of the central evaluation
    export: ExportConfig = field(default_factory=ExportConfig)  # [export-onnx]
    #   [export-quantize] [eval-runtime] [eval-only]
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
    init_args: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if settings.ray_address:
        init_args["address"] = settings.ray_address
    backend_config = {
        "client_resources": {"num_cpus": settings.cpus_per_client, "num_gpus": 0.0},
        "init_args": init_args,
    }
    bar = (
        RoundProgress(Path(settings.out) / SUMMARY_FILE, settings.num_server_rounds)
        if settings.progress
        else None
    )
    try:
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
