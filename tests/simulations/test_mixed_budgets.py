"""On Flower's simulation engine (Ray): a fleet with mixed memory budgets, most below
the whole-model minimum. Every device contributes each round (the whole model, a
window of it, or, too small for any training, an evaluation and the budget it would
need), every training peak is measured in a child process and within its budget, and
the model improves."""

from __future__ import annotations

import pytest

from memory.plan import min_budget_bytes
from memory.sizes import parse_bytes
from server.assign import Assigner, part_profile
from server.config import FleetConfig, ServerConfig
from simulations.run import SimulationSettings, simulate
from wire.shape import RunShape
from workloads import get_workload

pytestmark = pytest.mark.simulation

MiB = 2**20


def minimum_budgets(workload: str, reserve_bytes: int) -> tuple[int, int]:
    """The smallest budgets (runtime reserve included, no disk) that train the head
    alone and the whole model: the thresholds between none, part and full."""
    wl = get_workload(workload)
    a = Assigner(
        wl,
        wl.make_model(0),
        local_steps=1,
        runtime_reserve_bytes=reserve_bytes,
        train_time_s=1e3,
    )
    last = len(a.names) - 1
    head = min_budget_bytes(part_profile(a.profile, last, last), disk_budget_bytes=0)
    whole = min_budget_bytes(a.profile, disk_budget_bytes=0)
    return head + reserve_bytes, whole + reserve_bytes


def test_mixed_budgets_every_device_contributes_within_budget(tmp_path):
    reserve = parse_bytes(ServerConfig().runtime_reserve, allow_zero=True)
    head_min, whole_min = minimum_budgets("digits-cnn", reserve)
    budgets = [
        2 * whole_min,  # full
        whole_min + 256 * 1024,  # full, just
        (head_min + whole_min) // 2,  # part: a window of blocks plus the head
        head_min + 64 * 1024,  # part: the head alone
        head_min - MiB,  # none: evaluates, and says what it would need
    ]
    expected = {0: "full", 1: "full", 2: "part", 3: "part", 4: "none"}
    summary = simulate(
        SimulationSettings(
            shape=RunShape(local_steps=10, seed=1),
            num_clients=len(budgets),
            num_server_rounds=3,
            out=str(tmp_path / "run"),
            fleet=FleetConfig(memory_budgets=tuple(budgets), disk_budgets=(0,)),
            client_measure="child",
        )
    )

    print(
        f"\nhead alone needs {head_min / MiB:.2f} MiB, the whole model "
        f"{whole_min / MiB:.2f} MiB (runtime reserve {reserve / MiB:.0f} MiB)"
    )
    print("round  partition  budget MiB  kind  window  peak MiB  method     status")
    for r in summary["rounds"]:
        for a in r["assignments"]:
            peak = a["measured_peak_bytes"]
            print(
                f"{r['round']:5d}  {a['partition_id']:9d}  "
                f"{a['budget_bytes'] / MiB:10.2f}  {a['kind']:4s}  "
                f"{str(a['window'] or '-'):6s}  "
                f"{'-' if peak is None else f'{peak / MiB:8.2f}'}  "
                f"{a['peak_method'] or '-':9s}  {a['status']}"
                + (
                    f" (needs {a['min_budget_bytes'] / MiB:.2f} MiB)"
                    if a["min_budget_bytes"]
                    else ""
                )
            )
        print(f"round {r['round']}: accuracy {r['accuracy']:.4f} loss {r['loss']:.4f}")

    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    for r in summary["rounds"]:
        got = {a["partition_id"]: a for a in r["assignments"]}
        assert {p: a["kind"] for p, a in got.items()} == expected
        assert r["num_sampled"] == 5 and r["num_clients"] == 4
        assert r["num_failed"] == 0 and r["num_rejected"] == 0
        for p, a in got.items():
            assert a["budget_bytes"] == budgets[p]
            assert a["measured_peak_bytes"] is not None
            assert 0 < a["measured_peak_bytes"] <= a["budget_bytes"], a
            if a["kind"] == "none":
                # the reply came (status "none", not "no reply"), with the smallest
                # budget that would get this device a part of the model
                assert a["status"] == "none"
                assert a["min_budget_bytes"] == head_min > a["budget_bytes"]
                assert a["peak_method"] == "ort-child"
                assert a["eval_num_examples"] > 0
            else:
                assert a["status"] == "ok" and a["peak_method"] == "child"
                assert a["num_examples"] > 0 and a["message_bytes"] > 100_000
        start, stop = got[2]["window"]
        assert stop > start  # a window of blocks, not only the head
        assert got[3]["window"] == [3, 3]  # the head alone
    first, last = summary["rounds"][0], summary["rounds"][-1]
    assert last["accuracy"] > first["accuracy"] + 0.1
    assert last["loss"] < first["loss"]
