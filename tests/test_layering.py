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


def test_measured_children_are_given_function_objects():
    """A child's target is a function a reader (and a tool) can follow, never a
    ``"module:function"`` string (``memory.measure.target_name`` names it)."""
    bad = []
    for package in ("memory", "partition", "client", "server"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name not in {"measure_in_child", "train_in_child"}:
                    continue
                args = list(node.args[:1]) + [
                    k.value.elts[0]
                    for k in node.keywords
                    if k.arg == "warmup" and isinstance(k.value, ast.Tuple)
                ]
                if any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str)
                    for a in args
                ):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad
