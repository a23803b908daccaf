"""Run a federation on Flower's simulation engine (Ray), in this process.

Example:
    >>> from simulations.run import SimulationSettings, simulate
    >>> summary = simulate(SimulationSettings(num_clients=10, rounds=5, out="runs/demo"))

A fleet with its own budgets (entry ``partition-id mod count``; see
docs/federation.md): each client's peak is then measured in a child process.

    >>> simulate(SimulationSettings(num_clients=3, memory_budgets=("1GB", "200MB")))
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ServerConfig
from simulations.progress import RoundProgress
from workloads.registry import EVAL_MAX_ITEMS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulationSettings:
    """A simulated federation: the server's settings plus the fleet's size."""

    workload: str = "digits-cnn"  # built-in name or module:function
    num_clients: int = 10  # virtual SuperNodes
    rounds: int = 5  # federated rounds
    local_steps: int = 20  # optimizer steps per client per round
    lr: float = 0.003  # client AdamW learning rate
    split: str = "iid"  # iid | dirichlet | natural
    dirichlet_alpha: float = 0.5
    fraction_train: float = 1.0  # share of clients sampled per round
    seed: int = 0
    out: str = "runs/simulation"  # run folder
    cpus_per_client: float = 1.0  # Ray resources per client actor
    batch_size: int = 0  # 0: the workload's default
    seq_len: int = 0  # 0: the workload's default
    memory_budgets: tuple[str, ...] = ()  # sizes ("512MB") by partition id, entry
    #   partition-id mod count [fleet-memory-budgets]; (): each node uses 50% of the
    #   memory it measures
    disk_budgets: tuple[str, ...] = ()  # same, for offload and streaming ("0": none)
    #   [fleet-disk-budgets]
    client_measure: str = "auto"  # [client-measure] auto | child | inline: auto
    #   measures peaks in a child process for nodes given a budget
    speeds: tuple[float, ...] = ()  # relative compute speed by partition id (same
    #   rule) [fleet-speeds]
    availability: tuple[float, ...] = ()  # probability that a partition's device is
    #   online in a round [fleet-availability]
    classes: tuple[int, ...] = ()  # device class of every partition: a natural split
    #   follows them [fleet-classes]
    strategy: str = "fleetfit"  # fleetfit | exclude [strategy]
    eval_only: str = "onnxruntime"  # [eval-only]
    eval_windows: int = EVAL_MAX_ITEMS  # [eval-windows] language models: held-out
    #   windows of the central evaluation
    export_onnx: str = "end"  # [export-onnx]
    progress: bool = False  # a progress bar on stderr, one step per round
    ray_address: str = ""  # an existing Ray cluster ("auto", or "HEAD:6379"); "":
    #   start a local Ray on this machine

    def server_config(self) -> ServerConfig:
        cfg = ServerConfig(
            workload=self.workload,
            num_server_rounds=self.rounds,
            local_steps=self.local_steps,
            lr=self.lr,
            split=self.split,
            dirichlet_alpha=self.dirichlet_alpha,
            seed=self.seed,
            fraction_train=self.fraction_train,
            min_nodes=self.num_clients,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            out=self.out,
            client_measure=self.client_measure,
            fleet_memory_budgets=_fleet_list("memory_budgets", self.memory_budgets),
            fleet_disk_budgets=_fleet_list("disk_budgets", self.disk_budgets),
            fleet_speeds=",".join(f"{x:g}" for x in self.speeds),
            fleet_availability=",".join(f"{x:g}" for x in self.availability),
            fleet_classes=",".join(str(int(c)) for c in self.classes),
            strategy=self.strategy,
            eval_only=self.eval_only,
            eval_windows=self.eval_windows,
            export_onnx=self.export_onnx,
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
        for name, spec in (
            ("memory_budgets", self.memory_budgets),
            ("disk_budgets", self.disk_budgets),
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
        if self.classes and len(self.classes) != self.num_clients:
            raise ValueError(
                f"classes has {len(self.classes)} entries for {self.num_clients} "
                "clients: give one class index per client"
            )
        if wl.own_data:  # its load_data answers for the first client, up front
            if wl.data_fn is not None:
                wl.node_data(0, self.num_clients)
        else:
            wl.client_items(
                0,
                self.num_clients,
                self.split,
                seed=self.seed,
                alpha=self.dirichlet_alpha,
                classes=self.classes or None,
            )
        return cfg


def _fleet_list(name: str, sizes: tuple[str, ...]) -> str:
    """The comma-separated run-config value of a per-partition list of sizes."""
    if isinstance(sizes, str):
        raise ValueError(
            f"{name}={sizes!r} must be a tuple of sizes, one per partition, "
            f"e.g. ({sizes!r},)"
        )
    for size in sizes:
        if not isinstance(size, str) or "," in size or not size.strip():
            raise ValueError(
                f"{name} entry {size!r} must be one size such as '512MB' "
                "(give a tuple of strings, one per partition)"
            )
    return ",".join(s.strip() for s in sizes)


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

    if ":" in settings.workload:
        # Simulated nodes run what the user who starts the simulation named (a real
        # SuperNode allows custom workloads only through its own node config).
        allowed = os.environ.get(ALLOW_WORKLOADS_ENV, "")
        if settings.workload not in allowed.split(","):
            os.environ[ALLOW_WORKLOADS_ENV] = ",".join(
                x for x in (allowed, settings.workload) if x
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
        RoundProgress(Path(settings.out) / SUMMARY_FILE, settings.rounds)
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
    if len(summary.get("rounds", [])) != settings.rounds:
        raise RuntimeError(
            f"the simulation completed {len(summary.get('rounds', []))} of "
            f"{settings.rounds} rounds: see the log above"
        )
    return summary
