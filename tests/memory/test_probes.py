"""memory.probes: this machine's disk bandwidth (the matmul rate's cache:
test_machine_cache.py)."""

from __future__ import annotations

from memory.probes import measure_disk_bandwidth


def test_disk_bandwidth_probe(tmp_path):
    bw = measure_disk_bandwidth(tmp_path, nbytes=8 * 2**20)
    assert bw.read_bytes_per_s > 1e6 and bw.write_bytes_per_s > 1e6
    assert measure_disk_bandwidth(tmp_path) is bw  # cached
    assert list(tmp_path.iterdir()) == []
