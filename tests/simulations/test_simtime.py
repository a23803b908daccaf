"""Simulated time (issue 16 item 3): the time model by hand, late updates dropped by
the server's loop, and the fleet file's link and deadline fields."""

from __future__ import annotations

import pytest

from server.config import FleetConfig, ServerConfig
from server.loop import Federation
from server.simtime import device_time, round_time
from simulations.fleet import FleetError, parse_fleet
from tests.fakes import DirectTransport
from wire.shape import RunShape


def test_time_model_by_hand_two_devices_and_a_deadline():
    # a: 10 steps of 0.2 s at speed 1 -> 2 s; 4 MB down at 2 MB/s (2 s) and 4 MB up
    #    at 1 MB/s (4 s): 8 s in all
    # b: the same plan at speed 0.25 -> 0.8 s a step, 8 s of compute; a part sends
    #    back 1 MB over 0.125 MB/s (8 s), 4 MB down at 2 MB/s (2 s): 18 s
    a = device_time(
        steps=10,
        step_s=0.2 / 1.0,
        down_bytes=4e6,
        up_bytes=4e6,
        downlink_bytes_per_s=2e6,
        uplink_bytes_per_s=1e6,
    )
    b = device_time(
        steps=10,
        step_s=0.2 / 0.25,
        down_bytes=4e6,
        up_bytes=1e6,
        downlink_bytes_per_s=2e6,
        uplink_bytes_per_s=1.25e5,
    )
    assert (a.compute_s, a.down_s, a.up_s, a.total_s) == pytest.approx((2, 2, 4, 8))
    assert (b.compute_s, b.down_s, b.up_s, b.total_s) == pytest.approx((8, 2, 8, 18))
    # no deadline: the round waits for the slowest
    assert round_time([a.total_s, b.total_s]) == (pytest.approx(18.0), [False, False])
    # a 12 s deadline: b is late, the server waited until the deadline
    assert round_time([a.total_s, b.total_s], 12.0) == (12.0, [False, True])
    # a deadline nobody misses: the slowest device, not the deadline
    assert round_time([a.total_s, b.total_s], 30.0)[0] == pytest.approx(18.0)
    assert round_time([], 30.0) == (0.0, [])
    # an unknown link is not modelled
    c = device_time(
        steps=3,
        step_s=1.0,
        down_bytes=1e9,
        up_bytes=1e9,
        downlink_bytes_per_s=None,
        uplink_bytes_per_s=None,
    )
    assert c.total_s == 3.0
    with pytest.raises(ValueError, match="uplink"):
        device_time(
            steps=1,
            step_s=1,
            down_bytes=1,
            up_bytes=1,
            downlink_bytes_per_s=1,
            uplink_bytes_per_s=0,
        )


def test_the_loop_drops_a_late_update_and_records_the_times(tmp_path):
    """Two devices with the same budget (the same plan): device 1 runs at half speed
    and sends its update over a slow uplink, past the deadline."""
    transport = DirectTransport(2)
    for cfg in transport.node_config.values():
        cfg["memory-budget"] = "1GB"
    deadline = 20.0
    cfg = ServerConfig(
        shape=RunShape(local_steps=3),
        num_server_rounds=2,
        min_nodes=2,
        out=str(tmp_path / "run"),
        client_measure="inline",
        export=ServerConfig().export.__class__(onnx="off"),
        fleet=FleetConfig(
            speeds=(1.0, 0.5),
            downlinks=(1e9, 1e9),
            uplinks=(1e9, 5e3),  # device 1: 153 KB of digits-cnn at 5 KB/s
        ),
        round_deadline_s=deadline,
    )
    summary = Federation(cfg, transport).run()
    elapsed = 0.0
    for r in summary["rounds"]:
        by_pid = {a["partition_id"]: a for a in r["assignments"]}
        fast, slow = by_pid[0], by_pid[1]
        assert fast["sim_step_s"] > 0
        assert slow["sim_step_s"] == pytest.approx(2 * fast["sim_step_s"])
        for a, (down, up) in ((fast, (1e9, 1e9)), (slow, (1e9, 5e3))):
            sent = a["message_bytes"]  # what the node received, about down_bytes
            want = 3 * a["sim_step_s"] + a["up_bytes"] / up
            assert a["sim_s"] == pytest.approx(want, abs=2 * sent / down)
        assert slow["up_bytes"] / 5e3 > deadline  # so it is late
        assert fast["status"] == "ok" and fast["sim_s"] < deadline
        assert slow["status"].startswith("late: ")
        assert r["num_clients"] == 1 and r["num_late"] == 1
        assert r["sim_round_s"] == deadline
        elapsed += deadline
        assert r["sim_elapsed_s"] == pytest.approx(elapsed)


def _fleet(**classes_extra):
    return {
        "clients": 2,
        "workload": "digits-cnn",
        "local-steps": 2,
        "split": "iid",
        "classes": [
            {"name": "a", "share": 0.5, "memory": "300MB", **classes_extra},
            {"name": "b", "share": 0.5, "memory": "1GB"},
        ],
    }


def test_fleet_file_links_take_units_and_defaults():
    f = parse_fleet(_fleet(uplink="8Mbit/s", downlink="2MB/s"))
    a, b = f.classes
    assert (a.uplink_bytes_per_s, a.downlink_bytes_per_s) == (1e6, 2e6)
    assert (b.uplink_bytes_per_s, b.downlink_bytes_per_s) == (6.25e5, 2.5e6)
    fc = f.fleet_config()
    assert fc.uplinks == (1e6, 6.25e5) and fc.downlinks == (2e6, 2.5e6)
    assert parse_fleet(_fleet(uplink=125000)).classes[0].uplink_bytes_per_s == 125000
    assert parse_fleet(_fleet(uplink="512KiB/s")).classes[0].uplink_bytes_per_s == (
        512 * 1024
    )
    d = _fleet()
    d["round-deadline"] = 90
    assert parse_fleet(d).round_deadline_s == 90.0
    assert parse_fleet(_fleet()).round_deadline_s == 0.0


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"uplink": "5Mbit"}, r"classes\[0\] \(a\)\.uplink = '5Mbit' has no '/s'"),
        ({"downlink": "fast/s"}, r"downlink = 'fast/s' is not a rate: give a rate"),
        ({"uplink": 0}, r"uplink = 0 must be a rate > 0"),
        ({"uplink": True}, r"uplink = True is not a rate"),
    ],
)
def test_fleet_file_bad_links_fail_naming_the_field(extra, message):
    with pytest.raises(FleetError, match=message):
        parse_fleet(_fleet(**extra))


def test_fleet_file_bad_deadline_and_pretrain_fail_naming_the_field():
    d = _fleet()
    d["round-deadline"] = -1
    with pytest.raises(FleetError, match="round-deadline=-1"):
        parse_fleet(d)
    for table, message in (
        ({"share": 0.7}, r"pretrain\.share = 0\.7 must be in \(0, 0\.5\]"),
        ({"steps": 0}, r"pretrain\.steps = 0 must be an integer >= 1"),
        ({"batch-size": -2}, r"pretrain\.batch-size = -2 must be"),
        ({"lr": "fast"}, r"pretrain\.lr = 'fast' must be a number"),
        ({"epochs": 3}, r"unknown field pretrain\.epochs = 3: known fields"),
    ):
        d = _fleet()
        d["pretrain"] = table
        with pytest.raises(FleetError, match=message):
            parse_fleet(d)
    d = _fleet()
    d["public-share"] = 0.2  # one spelling: [pretrain] share
    with pytest.raises(FleetError, match="unknown field public-share"):
        parse_fleet(d)
    d["pretrain"] = {"steps": 5}
    del d["public-share"]
    f = parse_fleet(d)
    assert f.pretrain is not None and f.pretrain.share == 0.2
    assert f.pretrain.lr == f.shape.lr and f.shape.public_share == 0.2
