"""Cluster descriptions: TOML and Python, units, validation naming field and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from partition.cluster import (
    Cluster,
    ClusterError,
    load_cluster,
    parse_bandwidth,
    parse_rate,
    parse_seconds,
)

CLUSTERS = Path(__file__).resolve().parents[2] / "partition" / "clusters"


@pytest.mark.parametrize(
    "text,want",
    [
        ("100MB/s", 100e6),
        ("1Gbit/s", 125e6),
        ("800Mbps", 100e6),
        ("12.5 MB/s", 12.5e6),
        (5e6, 5e6),
    ],
)
def test_bandwidth_units(text, want):
    assert parse_bandwidth(text) == pytest.approx(want)


@pytest.mark.parametrize(
    "text,want", [("0.5ms", 5e-4), ("20us", 2e-5), ("1s", 1.0), (0, 0.0)]
)
def test_latency_units(text, want):
    assert parse_seconds(text) == pytest.approx(want)


@pytest.mark.parametrize(
    "text,want", [("20GFLOP/s", 2e10), ("312TFLOPS", 3.12e14), (1e9, 1e9)]
)
def test_rate_units(text, want):
    assert parse_rate(text) == pytest.approx(want)


@pytest.mark.parametrize("bad", ["fast", "-1MB/s", "10 parsecs", "0MB/s", True])
def test_bad_bandwidth_names_the_value(bad):
    with pytest.raises(ClusterError, match="link.bandwidth"):
        parse_bandwidth(bad, "link.bandwidth")


def test_hosts_expand_to_devices_and_links_resolve():
    c = Cluster.from_dict(
        {
            "network": {"bandwidth": "10MB/s", "latency": "1ms"},
            "hosts": [
                {"name": "a", "devices": 2, "memory": "1GB", "compute": "10GFLOP/s"},
                {"name": "b", "memory": "2GB", "compute": 5e9},
            ],
            "links": [{"hosts": ["b", "a"], "bandwidth": "1MB/s"}],
        }
    )
    assert [d.name for d in c.devices] == ["a:0", "a:1", "b"]
    assert c.devices[2].memory_bytes == 2 * 10**9
    assert c.link(0, 1) is c.intra
    assert c.link(0, 2).bandwidth_bytes_per_s == 1e6
    assert c.link(0, 2).latency_s == pytest.approx(1e-3)  # from [network]
    assert c.link(0, 2).transfer_s(1e6) == pytest.approx(1.001)


@pytest.mark.parametrize(
    "host,match",
    [
        ({"name": "a", "compute": 1e9}, r"hosts\[0\] \(a\) needs memory"),
        ({"name": "a", "memory": "1GB"}, r"hosts\[0\] \(a\) needs compute"),
        ({"name": "a", "memory": "lots", "compute": 1e9}, r"hosts\[0\].memory"),
        ({"name": "a", "memory": "1GB", "compute": "x"}, r"hosts\[0\].compute 'x'"),
        (
            {"name": "a", "memory": "1GB", "compute": 1e9, "devices": 0},
            r"hosts\[0\].devices must be an integer >= 1, got 0",
        ),
        ({"name": "a", "memory": "1GB", "compute": 1e9, "gpu": 1}, "unknown field"),
        (
            {"name": "a", "memory": "1GB", "compute": 1e9, "cpu_limit": 0},
            r"hosts\[0\].cpu_limit must be a positive number of cores, got 0",
        ),
        (
            {"name": "a", "memory": "1GB", "compute": 1e9, "cpu_limit": "half"},
            r"hosts\[0\].cpu_limit must be a positive number of cores, got 'half'",
        ),
        (
            {"name": "a", "memory": "1GB", "compute": 1e9, "cpu_period": "10ms"},
            r"hosts\[0\] \(a\) has cpu_period but no cpu_limit",
        ),
        (
            {
                "name": "a",
                "memory": "1GB",
                "compute": 1e9,
                "cpu_limit": 0.5,
                "cpu_period": "0ms",
            },
            r"hosts\[0\].cpu_period must be > 0, got '0ms'",
        ),
    ],
)
def test_bad_hosts_name_field_and_value(host, match):
    with pytest.raises(ClusterError, match=match):
        Cluster.from_dict({"hosts": [host]})


def test_cpu_limit_and_period_are_read():
    c = Cluster.from_dict(
        {
            "hosts": [
                {
                    "name": "a",
                    "devices": 2,
                    "memory": "1GB",
                    "compute": 1e9,
                    "cpu_limit": 0.25,
                    "cpu_period": "10ms",
                },
                {"name": "b", "memory": "1GB", "compute": 1e9, "cpu_limit": 2},
                {"name": "c", "memory": "1GB", "compute": 1e9},
            ]
        }
    )
    got = [(d.cpu_limit, d.cpu_period_s) for d in c.devices]
    assert got == [(0.25, pytest.approx(0.01))] * 2 + [(2.0, 0.1), (None, 0.1)]


def test_link_to_unknown_host_is_refused():
    with pytest.raises(ClusterError, match="unknown host 'c'"):
        Cluster.from_dict(
            {
                "hosts": [{"name": "a", "memory": "1GB", "compute": 1e9}],
                "links": [{"hosts": ["a", "c"]}],
            }
        )


def test_probe_measures_once_for_every_probed_host():
    calls = []

    def probe():
        calls.append(1)
        return 3e9

    c = Cluster.from_dict(
        {
            "hosts": [
                {"name": "a", "memory": "1GB", "compute": "probe"},
                {"name": "b", "memory": "1GB", "compute": "probe"},
            ]
        },
        probe=probe,
    )
    assert [d.flops_per_s for d in c.devices] == [3e9, 3e9] and len(calls) == 1


def test_example_cluster_files_load():
    files = sorted(CLUSTERS.glob("*.toml"))
    assert files, "no example clusters"
    for f in files:
        c = load_cluster(f, probe=lambda: 1e10)
        assert c.num_devices >= 1 and c.name == f.stem


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_cluster(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("hosts = [")
    with pytest.raises(ClusterError, match="not valid TOML"):
        load_cluster(bad)
