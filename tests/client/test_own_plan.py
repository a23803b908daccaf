"""fleetfit's ClientApp under an ordinary Flower strategy (issue 13, item 5).

The train message is built as Flower's ``FedAvg.configure_train`` builds it: the
model in ``arrays``, the strategy's ``train_config`` (the user's keys, here ``lr``)
plus ``server-round`` in ``config``, no fleetfit instruction keys. The node then
plans for its own ``memory-budget``; its peak is measured in a child process.
"""

import json

import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.serverapp.strategy.strategy_utils import validate_message_reply_consistency

from client.app import app
from memory.cost import predict
from memory.sizes import parse_bytes
from memory.spec import MemoryPlan
from tests import fakes  # noqa: F401  (sets Flower's task identity)
from wire.shape import RUNTIME_RESERVE
from wire.windows import workload_profiles
from workloads import get_workload

# gpt-byte@0.25 at 32 sequences a step: plain training is predicted at 96 MiB, the
# smallest whole-model plan at 15 MiB (no disk)
WORKLOAD, BATCH = "gpt-byte@0.25", 32


pytestmark = pytest.mark.child


def fedavg_message(model):
    """A train message as Flower's FedAvg sends it (``arrayrecord_key="arrays"``,
    ``configrecord_key="config"``, ``server-round`` injected)."""
    config = ConfigRecord({"lr": 0.003})
    config["server-round"] = 1
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": config})
    return Message(content, 5, MessageType.TRAIN)


def run(workload, budget, **run_config):
    model = get_workload(workload, batch_size=run_config.get("batch-size")).make_model(
        0
    )
    node = {"partition-id": 0, "num-partitions": 2, "memory-budget": budget}
    node["disk-budget"] = "0"
    ctx = Context(
        run_id=1,
        node_id=5,
        node_config=node,
        state=RecordDict(),
        run_config={"workload": workload, "local-steps": 2, **run_config},
    )
    return app(fedavg_message(model), ctx), model


def test_a_budget_below_plain_training_trains_the_whole_model_under_a_plan():
    budget = parse_bytes("150MiB")
    wl = get_workload(WORKLOAD, batch_size=BATCH)
    (profile,) = workload_profiles(wl).values()
    plain = predict(profile, MemoryPlan.plain([b.name for b in profile.blocks]))
    assert plain.peak_bytes + parse_bytes(RUNTIME_RESERVE) > budget  # plain won't do
    reply, model = run(WORKLOAD, "150MiB", **{"batch-size": BATCH})
    assert not reply.has_error(), reply.error.reason
    validate_message_reply_consistency([reply.content], "num-examples", True)
    assert set(reply.content["arrays"].keys()) == set(model.state_dict())
    report = reply.content["report"]
    plan = MemoryPlan.from_dict(json.loads(report["own-plan"]))
    assert not plan.is_plain
    assert plan.num_microbatches > 1 or any(
        b.activations != "keep" for b in plan.blocks
    )
    assert report["budget-bytes"] == budget and report["peak-method"] == "child"
    m = reply.content["metrics"]
    assert m["local-steps-done"] == 2
    assert 0 < m["measured-peak-bytes"] <= budget


def test_a_budget_that_holds_no_whole_model_plan_is_an_error_reply():
    reply, _ = run("gpt-tiny", "1MB")
    assert reply.has_error()
    reason = reply.error.reason
    assert "memory-budget 976.56 KiB (1000000 bytes)" in reason
    assert "no whole-model plan for gpt-tiny" in reason
    need = int(reason.split("the smallest that fits is ")[1].split("(")[1].split()[0])
    assert need > parse_bytes(RUNTIME_RESERVE)
    # that budget does hold one (planned only, not trained: the refusal's figure)
    reply, _ = run("gpt-tiny", str(need))
    assert not reply.has_error(), reply.error.reason


@pytest.mark.parametrize("budget", ["4GB"])
def test_a_large_budget_trains_plainly_as_before(budget):
    reply, model = run("digits-cnn", budget)
    assert not reply.has_error(), reply.error.reason
    validate_message_reply_consistency([reply.content], "num-examples", True)
    assert set(reply.content["arrays"].keys()) == set(model.state_dict())
    assert reply.content["report"]["own-plan"] == ""  # planned: plain fits
    m = reply.content["metrics"]
    assert 0 < m["measured-peak-bytes"] <= parse_bytes(budget)
