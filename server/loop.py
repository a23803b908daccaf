"""The federated loop, independent of how messages travel (testable without Flower's
engine): discover nodes, sample, send train instructions, validate and average the
replies, evaluate centrally, and write the run folder every round.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message

from server import persist, protocol
from server.aggregate import Update, accept_updates, weighted_average
from server.config import ServerConfig
from workloads import get_workload

log = logging.getLogger(__name__)


class Transport(Protocol):
    def wait_for_nodes(self, minimum: int, timeout_s: float) -> list[int]: ...
    def node_ids(self) -> list[int]: ...
    def query(self, node_ids: list[int], timeout_s: float) -> dict[int, Message]: ...
    def train(
        self,
        instructions: dict[int, tuple[ArrayRecord, ConfigRecord]],
        server_round: int,
        timeout_s: float,
    ) -> list[Message]: ...


class Federation:
    """One federated run under ``cfg`` over ``transport``."""

    def __init__(self, cfg: ServerConfig, transport: Transport) -> None:
        self.cfg = cfg
        self.transport = transport
        self.workload = get_workload(
            cfg.workload,
            batch_size=cfg.batch_size or None,
            seq_len=cfg.seq_len or None,
        )
        self.model = self.workload.make_model(cfg.seed)
        self.out = Path(cfg.out)
        self.nodes: dict[
            int, dict[str, Any]
        ] = {}  # node id -> facts from its query reply
        self.summary: dict[str, Any] = {
            "schema": persist.SCHEMA_VERSION,
            "workload": cfg.workload,
            "metric_name": self.workload.metric_name,
            "config": cfg.to_run_config(),
            "rounds": [],
        }

    # ------------------------------------------------------------ discovery
    def discover(self) -> None:
        """Ask nodes not seen before for their facts (a restarted node has a new id)."""
        new = [n for n in self.transport.node_ids() if n not in self.nodes]
        if not new:
            return
        for node_id, reply in self.transport.query(
            new, self.cfg.round_timeout_s
        ).items():
            if reply.has_error():
                log.warning("node %s failed its query: %s", node_id, reply.error.reason)
                continue
            facts = dict(reply.content.config_records.get(protocol.NODE, {}))
            self.nodes[node_id] = facts
        log.info("known nodes: %d", len(self.nodes))

    def sample(self, server_round: int) -> list[int]:
        """Nodes for this round: a seeded share of the known nodes, by partition id."""
        live = set(self.transport.node_ids())
        known = sorted(
            (n for n in self.nodes if n in live),
            key=lambda n: (int(self.nodes[n].get(protocol.PARTITION_ID) or 0), n),
        )
        k = max(1, round(self.cfg.fraction_train * len(known)))
        if k >= len(known):
            return known
        rng = np.random.default_rng([self.cfg.seed, server_round])
        pick = sorted(rng.choice(len(known), size=k, replace=False))
        return [known[i] for i in pick]

    # ------------------------------------------------------------ rounds
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        log.info(
            "fleetfit server: %s for %d rounds, waiting for %d nodes",
            cfg.workload,
            cfg.num_server_rounds,
            cfg.min_nodes,
        )
        self.transport.wait_for_nodes(cfg.min_nodes, cfg.node_wait_s)
        for server_round in range(1, cfg.num_server_rounds + 1):
            self.run_round(server_round)
        persist.plot_rounds(self.out, self.summary)
        log.info("run folder: %s", self.out)
        return self.summary

    def run_round(self, server_round: int) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.monotonic()
        self.discover()
        sampled = self.sample(server_round)
        reference = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        arrays = ArrayRecord(reference)
        instruction = protocol.TrainInstruction(
            server_round=server_round,
            workload=cfg.workload,
            local_steps=cfg.local_steps,
            lr=cfg.lr,
            seed=cfg.seed,
            split=cfg.split,
            dirichlet_alpha=cfg.dirichlet_alpha,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        config = ConfigRecord(dict(instruction.to_config()))
        replies = self.transport.train(
            {n: (arrays, config) for n in sampled}, server_round, cfg.round_timeout_s
        )
        updates, train_losses, errors = self._collect(replies)
        accepted, rejected = accept_updates(updates, reference)
        if accepted:
            self.model.load_state_dict(weighted_average(accepted, reference))
        metrics = self.workload.evaluate(self.model)
        record: dict[str, Any] = {
            "round": server_round,
            "accuracy": metrics["accuracy"],
            "loss": metrics["loss"],
            "num_clients": len(accepted),
            "num_sampled": len(sampled),
            "num_failed": len(sampled) - len(accepted),
            "num_rejected": len(rejected),
            "train_loss": float(np.mean(train_losses)) if train_losses else None,
            "round_s": time.monotonic() - t0,
        }
        if "perplexity" in metrics:
            record["perplexity"] = metrics["perplexity"]
        if errors:
            record["errors"] = errors
        self.summary["rounds"].append(record)
        self._save(server_round)
        log.info(
            "round %d: accuracy %.4f loss %.4f from %d/%d clients (%.1f s)",
            server_round,
            record["accuracy"],
            record["loss"],
            len(accepted),
            len(sampled),
            record["round_s"],
        )
        return record

    def _collect(
        self, replies: list[Message]
    ) -> tuple[list[Update], list[float], list[str]]:
        updates: list[Update] = []
        losses: list[float] = []
        errors: list[str] = []
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if reply.has_error():
                errors.append(f"node {node_id}: {reply.error.reason}")
                log.warning("node %s failed: %s", node_id, reply.error.reason)
                continue
            try:
                arrays = reply.content.array_records[protocol.ARRAYS]
                metrics = reply.content.metric_records[protocol.METRICS]
                state = arrays.to_torch_state_dict()
                num = _as_int(metrics[protocol.NUM_EXAMPLES])
                pid = _as_int(
                    metrics.get(
                        protocol.PARTITION_ID,
                        self.nodes.get(node_id, {}).get(protocol.PARTITION_ID, -1),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                errors.append(f"node {node_id}: malformed reply ({e})")
                log.warning("node %s sent a malformed reply: %s", node_id, e)
                continue
            updates.append(Update(pid, node_id, num, state))
            if protocol.TRAIN_LOSS in metrics:
                losses.append(float(metrics[protocol.TRAIN_LOSS]))  # type: ignore[arg-type]
        return updates, losses, errors

    def _save(self, server_round: int) -> None:
        persist.save_model(
            self.out / persist.MODEL_FILE,
            self.model.state_dict(),
            {
                "fleetfit-schema": str(persist.SCHEMA_VERSION),
                "workload": self.cfg.workload,
                "round": str(server_round),
                "settings": json.dumps(self.cfg.to_run_config(), sort_keys=True),
            },
        )
        persist.write_summary(self.out, self.summary)


def _as_int(value: Any) -> int:
    """An integer metric from the wire; lists and non-integral values are malformed."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)
