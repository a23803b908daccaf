"""The federated loop, independent of how messages travel (testable without Flower's
engine): discover nodes and their budgets, sample, assign each node a plan or a part
(``server.assign``), send each its instruction, validate and average the replies per
parameter, evaluate centrally, write the run folder and the resume state every round.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from memory.lora import factor_shapes, fan_in_fan_out, target_paths
from memory.sizes import format_bytes
from server import persist, precheck, privacy
from server.aggregate import (
    Update,
    accept_updates,
    clip_changes,
    clip_weights,
    robust_average,
    weighted_average,
)
from server.assign import Assigner, Assignment
from server.class_metrics import class_metrics, class_test_items
from server.config import ServerConfig
from server.fedopt import ServerOptimizer
from server.lora_agg import check_factors, merged_update
from server.onnx_rounds import OnnxRounds
from server.simtime import device_time, round_time
from server.submodel import STRATEGIES as SUBMODEL_STRATEGIES
from server.submodel import SubmodelAssigner, expand
from wire import keys
from wire.facts import MISSING_EXTRA, NodeFacts
from wire.instruction import TrainInstruction, resolve_measure
from wire.reply import (
    MAX_TEXT,
    MalformedReply,
    TrainReply,
    cap_text,
    read_train_reply,
)
from wire.windows import trained_keys

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
        self.workload = cfg.load_workload()
        self.model = self.workload.make_model(cfg.shape.seed)
        if cfg.init_model:
            precheck.load_init_model(self.model, cfg.init_model, cfg.shape.workload)
        self.out = Path(cfg.out)
        self.max_reply_bytes = cfg.reply_limit(  # checked before decoding a reply
            sum(v.numel() * v.element_size() for v in self.model.state_dict().values())
        )
        self.onnx = OnnxRounds(cfg, self.workload, self.out)
        self._class_items: dict[int, Any] | None = None  # class_metrics' data
        self.nodes: dict[int, NodeFacts] = {}  # node id -> facts (query reply)
        self.offline: list[int] = []  # this round's nodes drawn offline
        self.discovery_errors: list[str] = []  # this round's refused facts
        self.assigner: Assigner | SubmodelAssigner
        if cfg.strategy in SUBMODEL_STRATEGIES:  # HeteroFL, FedRolex
            self.assigner = SubmodelAssigner(
                self.workload,
                strategy=cfg.strategy,
                local_steps=cfg.shape.local_steps,
                runtime_reserve_bytes=cfg.reserve_bytes,
                train_time_s=cfg.train_time,
                proximal_mu=cfg.shape.proximal_mu,
            )
        else:
            self.assigner = Assigner(
                self.workload,
                self.model,
                local_steps=cfg.shape.local_steps,
                runtime_reserve_bytes=cfg.reserve_bytes,
                train_time_s=cfg.train_time,
                strategy=cfg.strategy,
                proximal_mu=cfg.shape.proximal_mu,
                adapters=cfg.adapters.mode,
                lora=cfg.adapters.spec(),
            )
        self.server_opt = ServerOptimizer(
            cfg.server_opt,
            (
                name
                for name, p in self.model.named_parameters(remove_duplicate=False)
                if p.is_floating_point()
            ),
        )
        for key in cfg.server_opt.ignored():
            log.warning(
                "run-config %s is set but server-opt=%s (aggregation=%s) does not "
                "use it",
                key,
                cfg.server_opt.name,
                cfg.server_opt.aggregation,
            )
        if cfg.privacy.clipping_norm > 0 and cfg.update_clip != "off":
            log.info(
                "update-clip=%s is not applied under central DP: dp-clipping-norm "
                "bounds every update's change instead (docs/security.md)",
                cfg.update_clip,
            )
        self.start_round = 1
        self.summary: dict[str, Any] = {
            "schema": persist.SCHEMA_VERSION,
            "workload": cfg.shape.workload,
            "metric_name": self.workload.metric_name,
            "config": cfg.to_run_config(),
            "rounds": [],
        }

    # ------------------------------------------------------------ discovery
    def discover(self) -> None:
        """Ask nodes not seen before for their facts (a restarted node has a new id).

        A node that cannot answer (a plain Flower ClientApp has no query handler) is
        still used: it gets the whole model and trains it as it sees fit.
        """
        live = self.transport.node_ids()
        new = [n for n in live if n not in self.nodes]
        if not new:
            return
        # Without any known node there is no round to hold up: wait as long as for
        # the nodes themselves (a node's first reply may start a process and import
        # torch, slower than a short round timeout), else one round's timeout.
        known = any(n in self.nodes for n in live)
        timeout = self.cfg.round_timeout_s
        if not known:
            timeout = max(timeout, self.cfg.node_wait_s)
        replies = self.transport.query(new, timeout)
        for node_id in new:
            reply = replies.get(node_id)
            if reply is None:
                log.warning("node %s did not answer its query; asking again", node_id)
                continue
            if reply.has_error():
                log.warning(
                    "node %s failed its query (%s): treated as a plain client",
                    node_id,
                    _reason(reply),
                )
                self.nodes[node_id] = NodeFacts()
                continue
            # never raises: a fact that is not valid is None (wire.facts)
            facts, refused = NodeFacts.read(
                reply.content.config_records.get(keys.NODE, {})
            )
            self.nodes[node_id] = facts
            if facts.adapters is False and self.cfg.adapters.mode != "off":
                log.warning(
                    "node %s cannot train adapters (no peft: the hf extra): it gets "
                    "other work",
                    node_id,
                )
            if refused:
                msg = (
                    f"node {node_id}: facts refused ({', '.join(refused)[:300]}); "
                    "the node is planned without them"
                )
                log.warning(msg)
                self.discovery_errors.append(msg)
        log.info("known nodes: %d", len(self.nodes))

    def sample(self, server_round: int) -> list[int]:
        """Nodes for this round: a seeded share of the known nodes that are online, by
        partition id (``fleet-availability`` takes simulated nodes offline)."""
        live = set(self.transport.node_ids())
        known = sorted(
            (n for n in self.nodes if n in live),
            key=lambda n: (self._partition(n), n),
        )
        self.offline = [n for n in known if not self._online(n, server_round)]
        off = set(self.offline)
        known = [n for n in known if n not in off]
        if not known:
            return []
        k = max(1, round(self.cfg.fraction_train * len(known)))
        if k >= len(known):
            return known
        rng = np.random.default_rng([self.cfg.shape.seed, server_round])
        pick = sorted(rng.choice(len(known), size=k, replace=False))
        return [known[i] for i in pick]

    def _partition(self, node_id: int) -> int:
        return self.nodes[node_id].partition_id or 0

    def _online(self, node_id: int, server_round: int) -> bool:
        """A seeded draw per (round, partition) against its ``fleet-availability``."""
        pid = self._partition(node_id)
        p = self.cfg.fleet.online_probability(pid)
        if p >= 1.0:
            return True
        u = np.random.default_rng([self.cfg.shape.seed, server_round, pid, 1]).random()
        return bool(u < p)

    # ------------------------------------------------------------ rounds
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.resume:
            self._resume()
        log.info(
            "fleetfit server: %s for rounds %d..%d, waiting for %d nodes",
            cfg.shape.workload,
            self.start_round,
            cfg.num_server_rounds,
            cfg.min_nodes,
        )
        if self.start_round <= cfg.num_server_rounds:
            self.transport.wait_for_nodes(cfg.min_nodes, cfg.node_wait_s)
        for server_round in range(self.start_round, cfg.num_server_rounds + 1):
            self.run_round(server_round)
        persist.plot_rounds(self.out, self.summary)
        log.info("run folder: %s", self.out)
        return self.summary

    def _resume(self) -> None:
        saved = precheck.load_resume(self.cfg, self.model, self.server_opt)
        if saved is None:
            log.info("resume: no saved state in %s; starting at round 1", self.out)
            return
        server_round, summary = saved
        summary["config"] = self.cfg.to_run_config()
        self.summary = summary
        self.start_round = server_round + 1
        log.info("resumed %s after round %d", self.out, server_round)

    def run_round(self, server_round: int) -> dict[str, Any]:
        cfg = self.cfg
        t0 = time.monotonic()
        self.discover()
        sampled = self.sample(server_round)
        reference = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        full_arrays = ArrayRecord(reference)
        instructions: dict[int, tuple[ArrayRecord, ConfigRecord]] = {}
        assignments: dict[int, Assignment] = {}
        for node_id in sampled:
            facts = self.nodes.get(node_id, NodeFacts())
            a = self.assigner.assign(facts, server_round)
            assignments[node_id] = a
            if a.kind == "none":
                arrays = self.onnx.eval_only_arrays(self.model, server_round)
            elif a.width is not None:  # a sub-model's slices of every key
                assert isinstance(self.assigner, SubmodelAssigner)
                arrays = ArrayRecord(self.assigner.sliced(a, reference))
            else:
                arrays = full_arrays
            eval_runtime = "onnxruntime" if a.kind == "none" and len(arrays) else ""
            config = self._instruction(a, server_round, facts, eval_runtime)
            instructions[node_id] = (arrays, config)
            log.debug(
                "round %d: node %s (budget %s) gets %s, %d steps",
                server_round,
                node_id,
                "not given" if a.budget_bytes is None else format_bytes(a.budget_bytes),
                a.describe(),
                a.local_steps,
            )
        replies = self.transport.train(instructions, server_round, cfg.round_timeout_s)
        updates, train_losses, errors, reports = self._collect(replies, assignments)
        down_bytes = sum(len(x.data) for x in full_arrays.values())
        updates, sim_round_s = self._simulated_time(
            updates, assignments, reports, down_bytes, server_round
        )
        errors[:0], self.discovery_errors = self.discovery_errors, []
        if not sampled:
            msg = (
                f"round {server_round}: no node to sample: none of the "
                f"{len(self.transport.node_ids())} connected node(s) has answered its "
                "query (or every known node is offline)"
            )
            log.warning(msg)
            errors.append(msg)
        accepted, rejected = accept_updates(
            updates, reference, norm_factor=cfg.norm_bound
        )
        changed = len(accepted) >= max(1, cfg.min_replies)
        dp_record: dict[str, Any] | None = None
        if changed and cfg.privacy.clipping_norm > 0:
            counts = privacy.expected_counts(
                (
                    self._expected_keys(a)
                    for a in assignments.values()
                    if a.kind != "none"
                ),
                reference,
            )
            new_state, dp_record = privacy.private_average(
                accepted,
                reference,
                clipping_norm=cfg.privacy.clipping_norm,
                noise_multiplier=cfg.privacy.noise_multiplier,
                counts=counts,
            )
            self.model.load_state_dict(
                self.server_opt.step(reference, new_state, _trained(accepted))
            )
        elif changed:
            how = cfg.server_opt.aggregation
            averaged = accepted
            if cfg.update_clip == "median":  # influence: change <= the median's
                averaged, clips = clip_changes(accepted, reference)
                for u, c in zip(accepted, clips, strict=True):
                    reports[u.node_id]["clip_scale"] = c.scale
            if how == "mean":
                weighted = clip_weights(averaged, cfg.weight_clip)
                for w in weighted:  # what each update weighed (weight-clip)
                    reports[w.node_id]["counted_examples"] = w.num_examples
                aggregate = weighted_average(weighted, reference)
            else:  # unweighted: no update has a weight to report
                aggregate = robust_average(
                    averaged,
                    reference,
                    how=how,
                    trim_fraction=cfg.server_opt.trim_fraction,
                )
            self.model.load_state_dict(
                self.server_opt.step(reference, aggregate, _trained(accepted))
            )
        elif sampled:
            msg = (
                f"round {server_round}: {len(accepted)} accepted update(s), fewer than "
                f"min-replies={cfg.min_replies}: the model is unchanged"
            )
            log.warning(msg)
            errors.append(msg)
        metrics = self.onnx.central_metrics(self.model)
        ok = {u.node_id for u in accepted}
        for u, reason in rejected:
            reports[u.node_id]["status"] = f"rejected: {reason}"
        none = sum(a.kind == "none" for a in assignments.values())
        record: dict[str, Any] = {
            "round": server_round,
            "accuracy": metrics["accuracy"],
            "loss": metrics["loss"],
            "num_clients": len(accepted) if changed else 0,
            "num_sampled": len(sampled),
            "num_offline": len(self.offline),
            "num_failed": len(sampled) - len(ok) - none,
            "num_rejected": len(rejected),
            "num_late": sum(
                str(r.get("status", "")).startswith("late") for r in reports.values()
            ),
            "train_loss": float(np.mean(train_losses)) if train_losses else None,
            "round_s": time.monotonic() - t0,
            # simulated time (server/simtime.py): this round, and all rounds so far
            "sim_round_s": sim_round_s,
            "sim_elapsed_s": self._sim_elapsed() + sim_round_s,
            "assignments": [
                self._assignment_record(n, assignments[n], reports.get(n))
                for n in sampled
            ],
        }
        if "perplexity" in metrics:
            record["perplexity"] = metrics["perplexity"]
        by_class = self._class_metrics()
        if by_class:  # the metric on each device class's own held-out data
            record["class_metrics"] = by_class
        if dp_record is not None:
            record["dp"] = dp_record
        self.onnx.add_federated_eval(record, reports)
        if errors:  # a peer's texts and key names, cut
            record["errors"] = [cap_text(e) for e in errors]
        self.summary["rounds"].append(record)
        self._save(server_round)
        self.onnx.after_round(self.model, server_round)
        log.info(
            "round %d: accuracy %.4f loss %.4f from %d/%d clients (%.1f s)",
            server_round,
            record["accuracy"],
            record["loss"],
            record["num_clients"],
            len(sampled),
            record["round_s"],
        )
        return record

    def _instruction(
        self,
        a: Assignment,
        server_round: int,
        facts: NodeFacts,
        eval_runtime: str = "",
    ) -> ConfigRecord:
        cfg = self.cfg
        ins = TrainInstruction(
            server_round=server_round,
            shape=replace(
                cfg.shape,
                local_steps=a.local_steps,
                workload=a.workload or cfg.shape.workload,
            ),
            classes=cfg.fleet.classes,
            kind=a.kind,
            plan=a.plan.to_json() if a.plan is not None else "",
            window_start=a.window[0] if a.window else 0,
            window_stop=a.window[1] if a.window else 0,
            measure=resolve_measure(cfg.client_measure, facts.budget_source),
            min_budget_bytes=a.min_budget_bytes,
            reason=a.reason,
            eval_runtime=eval_runtime,
        )
        if a.adapters is not None:
            ins = replace(
                ins,
                window_start=a.adapters.start,
                lora_rank=a.adapters.rank,
                lora_alpha=a.adapters.alpha,
                lora_targets=a.adapters.targets,
                base_dtype=a.adapters.base_dtype,
            )
        config = ConfigRecord(dict(ins.to_config()))
        if cfg.privacy.clipping_norm > 0:  # nodes clip too (client.app's clipping_mod)
            config[privacy.KEY_CLIPPING_NORM] = cfg.privacy.clipping_norm
        return config

    def _assignment_record(
        self, node_id: int, a: Assignment, report: dict[str, Any] | None
    ) -> dict[str, Any]:
        report = report or {"status": "no reply"}
        return {
            "node_id": node_id,
            "partition_id": self.nodes.get(node_id, NodeFacts()).partition_id,
            "budget_bytes": a.budget_bytes,
            "disk_budget_bytes": a.disk_budget_bytes,
            "kind": a.kind,
            "window": list(a.window) if a.window else None,
            "width": a.width,
            "adapter_start": a.adapters.start if a.adapters else None,
            "lora_rank": a.adapters.rank if a.adapters else None,
            "local_steps": a.local_steps,
            "predicted_peak_bytes": a.predicted_peak_bytes or None,
            "predicted_step_s": a.predicted_step_s or None,
            "min_budget_bytes": a.min_budget_bytes or None,
            "measured_peak_bytes": report.get("measured_peak_bytes"),
            "peak_method": report.get("peak_method"),
            "message_bytes": report.get("message_bytes"),
            "up_bytes": report.get("up_bytes"),
            "sim_step_s": report.get("sim_step_s"),
            "sim_s": report.get("sim_s"),
            "train_s": report.get("train_s"),
            "num_examples": report.get("num_examples"),
            # the weight it got in the average: num_examples capped at max-examples,
            # then clipped to weight-clip x the round's median (None: not averaged)
            "counted_examples": report.get("counted_examples"),
            # the factor update-clip put on its change (1.0: within the median's)
            "clip_scale": report.get("clip_scale"),
            "status": cap_text(str(report.get("status", "ok"))),
        }

    def _collect(
        self, replies: list[Message], assignments: dict[int, Assignment]
    ) -> tuple[list[Update], list[float], list[str], dict[int, dict[str, Any]]]:
        cfg = self.cfg
        updates: list[Update] = []
        losses: list[float] = []
        errors: list[str] = []
        reports: dict[int, dict[str, Any]] = {}
        for reply in replies:
            node_id = reply.metadata.src_node_id
            a = assignments.get(node_id)
            if a is None:
                log.warning(
                    "ignoring a reply from node %s, which was not asked", node_id
                )
                continue
            if reply.has_error():
                reason = _reason(reply)
                errors.append(f"node {node_id}: {reason}")
                reports[node_id] = {"status": f"error: {reason}"}
                log.warning("node %s failed: %s", node_id, reason)
                if a.kind == "adapter" and reply.error.code == MISSING_EXTRA:
                    # it cannot train adapters: other work from the next round on
                    facts = self.nodes.get(node_id, NodeFacts())
                    self.nodes[node_id] = replace(facts, adapters=False)
                continue
            try:  # the one reader: any fault of the reply is a MalformedReply
                got, arrays = read_train_reply(
                    reply.content,
                    kind=a.kind,
                    expected=self._reply_keys(a),
                    max_bytes=self.max_reply_bytes,
                )
            except MalformedReply as e:
                errors.append(f"node {node_id}: malformed reply ({e})")
                reports[node_id] = {"status": f"malformed: {e}"}
                log.warning("node %s sent a malformed reply: %s", node_id, e)
                continue
            rec: dict[str, Any] = {
                "measured_peak_bytes": got.peak_bytes,
                "message_bytes": got.message_bytes,
                "train_s": got.train_s,
                "num_examples": got.num_examples,
                "peak_method": got.peak_method,
                "status": "ok",
            }
            reports[node_id] = rec
            if a.kind == "none" or arrays is None:
                rec["status"] = "none"
                rec.update(self.onnx.eval_report(got.eval))
                if rec.get("eval_num_examples", 0) > cfg.max_examples:  # as updates
                    rec["eval_num_examples"] = cfg.max_examples
                continue
            if rec["message_bytes"] is None:  # a plain client: what was sent
                sent = TrainReply.arrays(reply.content).values()
                rec["message_bytes"] = sum(len(x.data) for x in sent)
            # what the node sent: a sub-model, a window or adapter factors, before
            # the server expands or merges it into the model's shapes
            rec["up_bytes"] = sum(int(v.nbytes) for v in arrays.values())
            state = {k: torch.from_numpy(v) for k, v in arrays.items()}
            coverage = None
            if a.width is not None:  # back into the model's shapes, with masks
                assert isinstance(self.assigner, SubmodelAssigner)
                try:
                    state, coverage = expand(
                        state, self.model.state_dict(), self.assigner.maps(a)
                    )
                except ValueError as e:
                    errors.append(f"node {node_id}: malformed reply ({e})")
                    rec["status"] = f"malformed: {e}"
                    log.warning("node %s sent a malformed reply: %s", node_id, e)
                    continue
            if a.adapters is not None:  # the factors -> the weights they amount to
                try:
                    state = self._adapter_update(a, state)
                except ValueError as e:
                    errors.append(f"node {node_id}: malformed reply ({e})")
                    rec["status"] = f"malformed: {e}"
                    log.warning("node %s sent a malformed reply: %s", node_id, e)
                    continue
            pid = got.partition_id
            if pid is None:
                pid = self.nodes.get(node_id, NodeFacts()).partition_id
            num, loss = got.num_examples or 0, got.train_loss
            num = min(num, cfg.max_examples)  # the claim stays in num_examples
            expected = self._expected_keys(a)
            updates.append(
                Update(
                    -1 if pid is None else pid,
                    node_id,
                    num,
                    state,
                    expected,
                    coverage or None,
                )
            )
            if loss is not None:  # finite (wire.reply): a NaN loss is not averaged
                losses.append(loss)
        for node_id in assignments:
            if node_id not in reports:
                errors.append(f"node {node_id}: no reply within the round's deadline")
        return updates, losses, errors, reports

    def _simulated_time(
        self,
        updates: list[Update],
        assignments: dict[int, Assignment],
        reports: dict[int, dict[str, Any]],
        down_bytes: int,
        server_round: int,
    ) -> tuple[list[Update], float]:
        """Each update's simulated round time (``server.simtime``), the updates that
        made ``round-deadline`` (a late one is dropped: a real server would not wait
        for it), and the round's simulated length."""
        times: list[float] = []
        for u in updates:
            a = assignments[u.node_id]
            down, up = self.cfg.fleet.links(max(u.partition_id, 0))
            up_bytes = reports[u.node_id]["up_bytes"]  # as sent, not as expanded
            step_s = self._sim_step_s(a, u.partition_id)
            t = device_time(
                steps=a.local_steps,
                step_s=step_s,
                down_bytes=down_bytes,
                up_bytes=up_bytes,
                downlink_bytes_per_s=down,
                uplink_bytes_per_s=up,
            )
            reports[u.node_id]["sim_step_s"] = step_s
            reports[u.node_id]["sim_s"] = t.total_s
            times.append(t.total_s)
        deadline = self.cfg.round_deadline_s
        round_s, late = round_time(times, deadline)
        kept: list[Update] = []
        for u, total_s, is_late in zip(updates, times, late, strict=True):
            if is_late:
                reports[u.node_id]["status"] = (
                    f"late: {total_s:.1f} simulated s > round-deadline {deadline:g} s"
                )
                log.debug("round %d: node %s late", server_round, u.node_id)
            else:
                kept.append(u)
        return kept, round_s

    def _class_metrics(self) -> dict[str, float]:
        """The model's metric on each device class's own held-out data, by class
        index (``server.class_metrics``), where the split follows the classes."""
        cfg = self.cfg
        if cfg.shape.split != "natural" or not cfg.fleet.classes:
            return {}
        if self.workload.own_data or self.workload.dataset == "example":
            return {}
        if self._class_items is None:
            self._class_items = class_test_items(
                self.workload,
                cfg.fleet.classes,
                public_share=cfg.shape.public_share,
                eval_windows=cfg.eval_windows,
            )
        return class_metrics(self.workload, self.model, self._class_items)

    def _sim_step_s(self, a: Assignment, partition_id: int) -> float:
        """A device's simulated step time: its plan's predicted time on this machine
        (the memory model) over its ``fleet-speeds`` factor, so that it does not
        depend on a node's noisy rate measurement; without fleet speeds, the time
        the assigner scaled by the node's measured rate."""
        speeds = self.cfg.fleet.speeds
        if a.plan is None or not speeds or partition_id < 0:
            return a.predicted_step_s
        return a.plan.predicted_step_s / speeds[partition_id % len(speeds)]

    def _sim_elapsed(self) -> float:
        """Simulated seconds of the rounds recorded so far (a resumed run's too)."""
        rounds = self.summary.get("rounds", [])
        last = rounds[-1].get("sim_elapsed_s") if rounds else None
        return float(last) if isinstance(last, int | float) else 0.0

    def _adapter_paths(self, a: Assignment) -> list[str]:
        assert a.adapters is not None
        return [
            p
            for ps in target_paths(self.model, self.assigner.blocks, a.adapters)
            for p in ps
        ]

    def _adapter_update(
        self, a: Assignment, factors: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """An adapter reply as the target weights it trained, ``W + s B @ A``
        (``server.lora_agg``: their per-key mean is FLoRA's stacked update)."""
        assert a.adapters is not None
        paths = self._adapter_paths(a)
        check_factors(factors, factor_shapes(self.model, paths, a.adapters.rank))
        modules = dict(self.model.named_modules())
        return merged_update(
            self.model.state_dict(),
            factors,
            paths,
            a.adapters.scaling,
            {p: fan_in_fan_out(modules[p]) for p in paths},
        )

    def _reply_keys(self, a: Assignment) -> frozenset[str] | None:
        """The array keys a reply to ``a`` carries, as sent (None: none expected)."""
        if a.kind == "none":
            return None
        if a.adapters is not None:  # the factors, before _adapter_update
            rank = a.adapters.rank
            return frozenset(factor_shapes(self.model, self._adapter_paths(a), rank))
        trained = self._expected_keys(a)
        return frozenset(self.model.state_dict()) if trained is None else trained

    def _expected_keys(self, a: Assignment) -> frozenset[str] | None:
        """The keys a reply to ``a`` must carry (None: every key of the model)."""
        if a.adapters is not None:  # after _adapter_update: the target weights
            return frozenset(f"{p}.weight" for p in self._adapter_paths(a))
        if a.window is None:
            return None
        return frozenset(trained_keys(self.model, a.window, self.assigner.blocks))

    def _save(self, server_round: int) -> None:
        """Model, summary and resume state of ``server_round``, written together
        (``persist.save_round``: all name the same round, whatever fails)."""
        strategy = {
            "next_round": server_round + 1,
            "nodes_by_partition": {
                str(f.partition_id): f.to_record()
                for f in self.nodes.values()
                if f.partition_id is not None
            },
        }
        persist.save_round(
            self.out,
            server_round,
            self.model.state_dict(),
            {
                "fleetfit-schema": str(persist.SCHEMA_VERSION),
                "workload": self.cfg.shape.workload,
                "round": str(server_round),
                "settings": json.dumps(self.cfg.to_run_config(), sort_keys=True),
            },
            self.summary,
            strategy,
            self.server_opt.state_dict() if self.server_opt.active else None,
        )


def _trained(updates: list[Update]) -> frozenset[str]:
    """The keys some accepted update carries: the ones trained this round."""
    return frozenset(k for u in updates for k in u.state)


def _reason(reply: Message) -> str:
    """A Flower error reply's reason, as text of bounded length."""
    return str(reply.error.reason)[:MAX_TEXT]


def no_update_reason(summary: dict[str, Any]) -> str | None:
    """Why a run's model never changed, in one line, or None when some round
    accepted an update (a run that trained nothing must not look like a success)."""
    rounds = summary.get("rounds", [])
    if any((r.get("num_clients") or 0) > 0 for r in rounds):
        return None
    errors = [e for r in rounds for e in r.get("errors", [])]
    statuses = sorted(
        {
            str(a.get("status"))
            for r in rounds
            for a in r.get("assignments", [])
            if a.get("status") not in (None, "ok", "none")
        }
    )
    why = "; ".join((statuses or errors or ["no node was sampled"])[:3])
    return (
        f"no update was accepted in any of {len(rounds)} round(s): the model is the "
        f"initial one ({why[:300]})"
    )
