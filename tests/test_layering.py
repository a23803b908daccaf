"""Imports flow one way: {workloads, memory} <- partition <- {client, server} <-
simulations <- fleetfit (../shared/STYLE.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "workloads": {
        "flwr",
        "memory",
        "partition",
        "client",
        "server",
        "simulations",
        "fleetfit",
    },
    "memory": {
        "flwr",
        "partition",
        "client",
        "server",
        "simulations",
        "fleetfit",
        "workloads",
    },
    # torch-free: the runtime of devices too small to import torch
    "onnxrun": {
        "torch",
        "flwr",
        "workloads",
        "memory",
        "partition",
        "client",
        "server",
        "simulations",
        "fleetfit",
    },
    "partition": {"flwr", "client", "server", "simulations", "fleetfit"},
    "client": {"simulations", "fleetfit"},
    "server": {"simulations", "fleetfit", "client"},
    "simulations": {"fleetfit"},
}


def imported_tops(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    tops = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_flow_one_way(package):
    bad = []
    for path in (ROOT / package).rglob("*.py"):
        wrong = imported_tops(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, bad


def test_client_uses_only_the_server_protocol():
    for path in (ROOT / "client").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] == "server"
            ):
                assert (
                    node.module == "server"
                    and [a.name for a in node.names] == ["protocol"]
                    or node.module == "server.protocol"
                ), path
