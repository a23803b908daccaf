"""Soak: many short rounds through the real FlowerTransport and ClientApp while, at
random (seeded), nodes die mid-round, dead nodes come back under new node ids
(restarted SuperNodes), nodes return garbage (NaN or a wrong shape), and the server
itself is killed once mid-round and resumed. Afterwards every round is there once, in
order, every garbage update was rejected, every good one counted once, nothing lost.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, RecordDict

from server.config import ExportConfig
from server.persist import load_model, load_state
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, federate, nodes

SEED = 11
DEVICES = 6
ROUNDS = 20
KILLED_IN = 11  # the server dies in round 11, after the first train message
P_DIE = 0.12  # per train message: the node stops answering, for good
P_GARBAGE = 0.15  # per train message: the reply's arrays are NaN or misshapen
P_RETURN = 0.5  # per round and dead device: it comes back under a new node id
MIN_ALIVE = 2


class Killed(BaseException):
    """The server process dies (not an error the loop could catch)."""


class SoakGrid(FakeGrid):
    """Devices (partition ids) behind node ids that change when a device restarts.

    Every fault is drawn from one seeded generator at a fixed point (a train
    message's delivery, a round's first train message), so a run is repeatable.
    What each device did in each round is recorded under ``(attempt, round)``;
    ``attempt`` grows when the server is killed, so the redone round has its own.
    """

    def __init__(self) -> None:
        super().__init__(nodes(DEVICES))
        self.rng = np.random.default_rng(SEED)
        self.dead: set[int] = set()
        self.next_id = 9000
        self.attempt = 0
        self.killed = False
        self.trained_in_round: Counter = Counter()  # (attempt, round) -> messages
        self.events: dict[tuple[int, int], dict[str, set[int]]] = defaultdict(
            lambda: defaultdict(set)
        )
        self.faults: Counter = Counter()
        self.restarted_in: dict[int, int] = {}  # new node id -> round

    def get_node_ids(self):
        return [n for n in self.nodes if n not in self.dead]

    def _restart_some(self, server_round: int) -> None:
        for old in sorted(self.dead):
            if self.rng.random() < P_RETURN:
                app, node_config = self.nodes[old]
                new = self.next_id
                self.next_id += 1
                self.nodes[new] = (app, node_config)  # same device, fresh node id
                self.state[new] = RecordDict()  # a restarted process: empty state
                del self.nodes[old]
                self.dead.discard(old)
                self.restarted_in[new] = server_round
                self.faults["restarted under a new node id"] += 1

    def _deliver(self, msg: Message) -> Message | None:
        node_id = msg.metadata.dst_node_id
        if node_id in self.dead:
            return None
        if msg.metadata.message_type != "train":
            return super()._deliver(msg)
        server_round = int(msg.metadata.group_id)
        key = (self.attempt, server_round)
        if self.trained_in_round[key] == 0:
            self._restart_some(server_round)  # the returned nodes join next round
        self.trained_in_round[key] += 1
        if (
            server_round == KILLED_IN
            and not self.killed
            and self.trained_in_round[key] == 2
        ):
            self.killed = True
            self.attempt += 1
            self.faults["server killed mid-round"] += 1
            raise Killed
        ev = self.events[key]
        alive = len(self.get_node_ids())
        u = self.rng.random()
        if u < P_DIE and alive > MIN_ALIVE:
            self.log.append(("train", node_id))
            self.dead.add(node_id)  # dies with the message: no reply, ever
            ev["died"].add(node_id)
            self.faults["died mid-round"] += 1
            return None
        reply = super()._deliver(msg)
        assert reply is not None and not reply.has_error(), reply
        if u < P_DIE + P_GARBAGE:
            kind = "NaN" if self.rng.random() < 0.5 else "shape"
            ev[kind].add(node_id)
            self.faults[f"garbage ({kind})"] += 1
            return garbled(reply, kind)
        ev["ok"].add(node_id)
        return reply


def garbled(reply: Message, kind: str) -> Message:
    sd = reply.content.array_records["arrays"].to_torch_state_dict()
    if kind == "NaN":
        sd = {k: v * math.nan if v.is_floating_point() else v for k, v in sd.items()}
    else:
        k = next(iter(sd))
        sd[k] = torch.zeros(3, 3)
    content = RecordDict(
        {
            "arrays": ArrayRecord(sd),
            "metrics": reply.content.metric_records["metrics"],
            "report": reply.content.config_records["report"],
        }
    )
    return Message(content=content, metadata=reply.metadata)


def test_soak_random_faults_lose_nothing(tmp_path):
    t0 = time.perf_counter()
    common = dict(
        num_server_rounds=ROUNDS,
        local_steps=2,
        min_nodes=MIN_ALIVE,
        round_timeout_s=30.0,
        export=ExportConfig(onnx="off"),
        seed=SEED,
    )
    grid = SoakGrid()
    with pytest.raises(Killed):
        federate(config(tmp_path, **common), grid)
    run = tmp_path / "run"
    assert load_state(run)[0] == KILLED_IN - 1  # the interrupted round is not saved
    summary = federate(config(tmp_path, **common, resume=True), grid)

    rounds = summary["rounds"]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    accepted = rejected = ok_statuses = 0
    for r in rounds:
        attempt = 1 if r["round"] >= KILLED_IN else 0
        ev = grid.events[(attempt, r["round"])]
        status = {a["node_id"]: a["status"] for a in r["assignments"]}
        assert all(a["kind"] == "full" for a in r["assignments"])
        ok = {n for n, s in status.items() if s == "ok"}
        assert ok == ev["ok"], (r["round"], status, dict(ev))
        for n in ev["NaN"]:
            assert status[n].startswith("rejected") and "NaN" in status[n], status[n]
        for n in ev["shape"]:
            assert status[n].startswith("rejected") and "shape" in status[n], status[n]
        for n in ev["died"]:
            assert status[n] == "no reply", status[n]
        assert set(status) == ev["ok"] | ev["NaN"] | ev["shape"] | ev["died"]
        assert r["num_clients"] == len(ok) >= 1
        assert r["num_rejected"] == len(ev["NaN"]) + len(ev["shape"])
        assert np.isfinite(r["loss"]) and np.isfinite(r["accuracy"])
        accepted += r["num_clients"]
        rejected += r["num_rejected"]
        ok_statuses += len(ok)
    final = {k: e for k, e in grid.events.items() if k != (0, KILLED_IN)}
    redone = grid.events[(0, KILLED_IN)]  # the round the server died in, done again
    garbage = sum(len(e["NaN"]) + len(e["shape"]) for e in final.values())
    good = sum(len(e["ok"]) for e in final.values())
    assert accepted == ok_statuses == good  # every good update counted, once
    assert rejected == garbage  # every garbage update rejected
    restarted_ok = sum(
        a["node_id"] >= 9000 and a["status"] == "ok"
        for r in rounds
        for a in r["assignments"]
    )
    assert restarted_ok > 0  # restarted devices worked under their new ids
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.3  # it still learns
    # a device restarted before the last round was asked for its facts again
    queried = {n for t, n in grid.log if t == "query"}
    assert {n for n, r in grid.restarted_in.items() if r < ROUNDS} <= queried

    state, _ = load_model(run / "model.safetensors")
    assert state and all(torch.isfinite(v).all() for v in state.values())
    assert load_state(run)[0] == ROUNDS
    assert len(list((run / "state").glob("model-*"))) == 1
    for kind in (
        "died mid-round",
        "restarted under a new node id",
        "garbage (NaN)",
        "garbage (shape)",
        "server killed mid-round",
    ):
        assert grid.faults[kind] > 0, (kind, grid.faults)
    print(
        f"\nsoak: {len(rounds)}/{ROUNDS} rounds, {DEVICES} devices, "
        f"{grid.next_id - 9000} restarts, faults {dict(grid.faults)}; "
        f"updates accepted {accepted}, rejected {rejected} (garbage sent {garbage}; "
        f"the killed round's {len(redone['ok'])} good update(s) redone; "
        f"{restarted_ok} from restarted devices), lost 0; "
        f"accuracy {rounds[0]['accuracy']:.3f} -> {rounds[-1]['accuracy']:.3f}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
