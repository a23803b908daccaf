"""Resume as a deployment sees it: the server is killed in the middle of round k + 1
(its state on disk is round k's), and the resumed server finds the same devices under
new node ids (restarted SuperNodes). The run ends with the same model, bit for bit,
as an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message

from server.config import ExportConfig, FleetConfig
from server.persist import load_model, load_state
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, digits_mins, federate, nodes

ROUNDS = 4
KILLED_IN = 3  # the server dies while round 3's replies come in


class Killed(BaseException):
    """The server process dies (not an error the loop could catch)."""


class DyingGrid(FakeGrid):
    """Delivers until the second train message of round ``KILLED_IN``, then dies:
    one device has trained that round and the others never hear of it."""

    trained_in_fatal_round = 0

    def _deliver(self, msg: Message) -> Message | None:
        if msg.metadata.message_type == "train" and msg.metadata.group_id == str(
            KILLED_IN
        ):
            if self.trained_in_fatal_round == 1:
                raise Killed
            self.trained_in_fatal_round += 1
        return super()._deliver(msg)


def renumbered(n: int, first_id: int) -> dict:
    """The same devices (partition ids) under new node ids, in another order."""
    old = nodes(n)
    return {first_id + n - 1 - i: old[2000 + i] for i in range(n)}


def test_killed_mid_round_and_resumed_with_new_node_ids_ends_bit_identical(tmp_path):
    head_min, whole_min = digits_mins()
    budgets = [10 * whole_min, (head_min + whole_min) // 2, head_min + 1, whole_min]
    common = dict(
        num_server_rounds=ROUNDS,
        fleet=FleetConfig(memory_budgets=tuple(budgets), disk_budgets=(0,)),
        fraction_train=0.75,  # 3 of 4 devices a round: seeded sampling must agree
        seed=5,
        export=ExportConfig(onnx="off"),
    )
    whole = federate(config(tmp_path / "a", **common), FakeGrid(nodes(4)))

    dying = DyingGrid(nodes(4))
    with pytest.raises(Killed):
        federate(config(tmp_path / "b", **common), dying)
    run_b = tmp_path / "b" / "run"
    assert load_state(run_b)[0] == KILLED_IN - 1
    assert dying.trained_in_fatal_round == 1  # one device trained round 3, lost

    grid = FakeGrid(renumbered(4, first_id=7000))
    resumed = federate(config(tmp_path / "b", **common, resume=True), grid)

    # the new node ids were asked for their facts, and only they got work
    assert sorted(n for t, n in grid.log if t == "query") == [7000, 7001, 7002, 7003]
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3, 4]
    for a, b in zip(whole["rounds"], resumed["rounds"], strict=True):
        mine = [
            (x["partition_id"], x["kind"], x["window"], x["local_steps"])
            for x in a["assignments"]
        ]
        theirs = [
            (x["partition_id"], x["kind"], x["window"], x["local_steps"])
            for x in b["assignments"]
        ]
        assert mine == theirs and len(mine) == 3
        assert a["accuracy"] == b["accuracy"] and a["loss"] == b["loss"]
        if b["round"] >= KILLED_IN:
            assert {x["node_id"] for x in b["assignments"]} <= set(grid.nodes)
            assert all(x["status"] == "ok" for x in b["assignments"])
    kinds = {x["kind"] for r in whole["rounds"] for x in r["assignments"]}
    assert kinds == {"full", "part"}

    sa, _ = load_model(tmp_path / "a" / "run" / "model.safetensors")
    sb, _ = load_model(run_b / "model.safetensors")
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert load_state(run_b)[0] == ROUNDS
    assert len(list((run_b / "state").glob("model-*"))) == 1
