"""Imports flow one way: {workloads, memory} <- partition <- wire <- {client, server}
<- simulations <- fleetfit (../shared/STYLE.md); client and server share only wire."""

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
        "wire",
    },
    "memory": {
        "flwr",
        "partition",
        "client",
        "server",
        "simulations",
        "fleetfit",
        "workloads",
        "wire",
    },
    # torch-free: the runtime of devices too small to import torch
    "onnxrun": {
        "torch",
        "flwr",
        "workloads",
        "memory",
        "partition",
        "wire",
        "client",
        "server",
        "simulations",
        "fleetfit",
    },
    "partition": {"flwr", "wire", "client", "server", "simulations", "fleetfit"},
    # the wire contract: owned by neither side
    "wire": {"partition", "client", "server", "simulations", "fleetfit"},
    "client": {"server", "simulations", "fleetfit"},
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


def test_the_wire_contract_imports_without_torch_but_for_its_windows():
    """A torch-free node process can read and write messages: only wire.windows
    (which walks a model) imports torch."""
    for path in (ROOT / "wire").rglob("*.py"):
        if path.name != "windows.py":
            assert not imported_tops(path) & {"torch", "memory", "workloads"}, path
