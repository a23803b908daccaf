"""The fleet keys of a run: the ``exclude`` strategy (the status quo), availability
(nodes offline for a round), natural splits by device class, and how measurement is
chosen for nodes given a budget."""

from __future__ import annotations

import pytest

from server.assign import Assigner
from server.config import ExportConfig, FleetConfig, ServerConfig
from tests.server.grid import FakeGrid
from tests.server.test_federation import config, digits_mins, federate, nodes
from workloads import get_workload


def plain_need():
    wl = get_workload("digits-cnn")
    a = Assigner(
        wl,
        wl.make_model(0),
        local_steps=5,
        runtime_reserve_bytes=0,
        train_time_s=1e3,
        strategy="exclude",
    )
    return a.plain_need_bytes()


@pytest.mark.child
def test_exclude_trains_plainly_or_not_at_all(tmp_path):
    head_min, whole_min = digits_mins()
    need = plain_need()
    assert head_min <= whole_min <= need
    budgets = [2 * need, need, (head_min + whole_min) // 2, head_min // 2]
    common = dict(
        num_server_rounds=2,
        fleet=FleetConfig(memory_budgets=tuple(budgets), disk_budgets=(0,)),
    )
    excl = federate(
        config(tmp_path / "x", strategy="exclude", **common), FakeGrid(nodes(4))
    )
    ff = federate(config(tmp_path / "f", **common), FakeGrid(nodes(4)))
    for r in excl["rounds"]:
        kinds = {a["partition_id"]: a["kind"] for a in r["assignments"]}
        assert kinds == {0: "full", 1: "full", 2: "none", 3: "none"}
        assert r["num_clients"] == 2
        for a in r["assignments"]:
            if a["kind"] == "none":
                assert a["min_budget_bytes"] == need and a["status"] == "none"
                assert "eval_accuracy" not in a  # the status quo: excluded nodes idle
    kinds = {a["partition_id"]: a["kind"] for a in ff["rounds"][0]["assignments"]}
    assert kinds == {0: "full", 1: "full", 2: "part", 3: "none"}


def test_availability_takes_nodes_offline_by_a_seeded_draw(tmp_path):
    common = dict(num_server_rounds=4, fleet=FleetConfig(availability=(0.5,)), seed=3)
    a = federate(config(tmp_path / "a", **common), FakeGrid(nodes(6)))
    b = federate(config(tmp_path / "b", **common), FakeGrid(nodes(6)))
    offline = [r["num_offline"] for r in a["rounds"]]
    assert offline == [r["num_offline"] for r in b["rounds"]]
    assert 0 < sum(offline) < 24
    for r in a["rounds"]:
        assert r["num_sampled"] == 6 - r["num_offline"]
        assert len(r["assignments"]) == r["num_sampled"]
    always = federate(config(tmp_path / "c", num_server_rounds=2), FakeGrid(nodes(3)))
    assert all(r["num_offline"] == 0 for r in always["rounds"])


def test_natural_split_by_class_reaches_the_clients(tmp_path):
    cfg = config(
        tmp_path,
        num_server_rounds=1,
        split="natural",
        fleet=FleetConfig(classes=(0, 0, 1, 1)),
    )
    r = federate(cfg, FakeGrid(nodes(4)))["rounds"][0]
    examples = {a["partition_id"]: a["num_examples"] for a in r["assignments"]}
    wl = get_workload("digits-cnn")
    want = {
        p: len(wl.client_items(p, 4, "natural", classes=(0, 0, 1, 1))) for p in range(4)
    }
    assert examples == want
    plain = {p: len(wl.client_items(p, 4, "natural")) for p in range(4)}
    assert want != plain


@pytest.mark.child
def test_nodes_given_a_budget_are_measured_in_a_child(tmp_path):
    cfg = config(
        tmp_path,
        num_server_rounds=1,
        client_measure="auto",
        fleet=FleetConfig(memory_budgets=(10**9,)),
        local_steps=2,
        export=ExportConfig(onnx="off"),
    )
    r = federate(cfg, FakeGrid(nodes(1)))["rounds"][0]
    assert r["assignments"][0]["peak_method"] == "child"


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("strategy", "greedy", "fleetfit or exclude"),
        ("fleet-availability", "0.5,1.5", "probabilities in (0, 1]"),
        ("fleet-availability", "x", "probabilities"),
        ("fleet-classes", "0,a", "class indices"),
        ("fleet-classes", "0,-1", "class indices"),
        ("fleet-speeds", [1, 0], "positive numbers"),
        ("fleet-disk-budgets", "0,-1GB", "negative"),
        ("dp-clipping-norm", -1.0, "must be a number >= 0"),
        ("dp-noise-multiplier", 1.0, "needs dp-clipping-norm > 0"),
    ],
)
def test_bad_fleet_keys_are_refused(key, value, needle):
    with pytest.raises(ValueError) as e:
        ServerConfig.from_run_config({key: value})
    assert needle in str(e.value) and f"{key}={value!r}" in str(e.value)


@pytest.mark.parametrize(
    "fleet, needle",
    [
        (FleetConfig(availability=(0.5, 1.5)), "availability='0.5,1.5' is invalid: p"),
        (FleetConfig(classes=(0, -1)), "fleet-classes='0,-1' is invalid: class"),
        (FleetConfig(memory_budgets=("1GB",)), "budgets='1GB' is invalid: give the"),
        (FleetConfig(speeds=0.5), "fleet-speeds=0.5 is invalid: give a tuple"),
    ],
)
def test_a_fleet_built_in_python_passes_the_run_configs_checks(fleet, needle):
    with pytest.raises(ValueError) as e:
        ServerConfig(fleet=fleet).validate()
    assert needle in str(e.value)


def test_fleet_lists_are_typed_after_parsing_and_sent_as_strings():
    cfg = ServerConfig.from_run_config(
        {
            "fleet-memory-budgets": "1GB, 300MB",
            "fleet-disk-budgets": "0",
            "fleet-speeds": [1, 0.25],
            "fleet-availability": "0.9",
            "fleet-classes": "0,1",
        }
    )
    assert cfg.fleet == FleetConfig(
        memory_budgets=(10**9, 3 * 10**8),
        disk_budgets=(0,),
        speeds=(1.0, 0.25),
        availability=(0.9,),
        classes=(0, 1),
    )
    assert cfg.fleet.online_probability(5) == 0.9
    assert cfg.fleet.to_query() == {
        "fleet-memory-budgets": "1000000000,300000000",
        "fleet-disk-budgets": "0",
        "fleet-speeds": "1.0,0.25",
    }
    assert ServerConfig.from_run_config(cfg.to_run_config()) == cfg


def test_first_discovery_waits_node_wait_and_an_empty_round_says_why(tmp_path):
    class Mute(FakeGrid):  # connected nodes that never answer a query
        def _deliver(self, msg):
            if msg.metadata.message_type == "query":
                self.log.append(("query", msg.metadata.dst_node_id))
                return None
            return super()._deliver(msg)

    from server.app import FlowerTransport
    from server.loop import Federation

    cfg = config(tmp_path, num_server_rounds=2, round_timeout_s=5.0, node_wait_s=50.0)
    transport = FlowerTransport(Mute(nodes(2)), query_config=cfg.fleet.to_query())
    timeouts = []
    query = transport.query

    def spy(node_ids, timeout_s):
        timeouts.append(timeout_s)
        return query(node_ids, timeout_s)

    transport.query = spy  # type: ignore[method-assign]
    summary = Federation(cfg, transport).run()
    assert timeouts == [50.0, 50.0]  # nothing known yet: as long as for the nodes
    for r in summary["rounds"]:
        assert r["num_sampled"] == 0
        assert any("no node to sample" in e for e in r["errors"])
