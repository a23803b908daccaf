"""``SimulationSettings`` composes the server's own shape and sub-configs: one name
and one default per setting, from the Python API to the train instruction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.config import ExportConfig, FleetConfig, ServerConfig
from simulations.run import SimulationSettings
from wire.instruction import TrainInstruction
from wire.shape import RunShape


def test_a_simulation_keeps_the_run_configs_defaults():
    cfg = SimulationSettings().server_config()
    assert cfg == replace(ServerConfig(), out="runs/simulation", min_nodes=10)


def test_the_shape_travels_whole_to_the_instruction():
    shape = RunShape(workload="digits-mlp", local_steps=3, seed=4, split="natural")
    fleet = FleetConfig(memory_budgets=(10**9, 5 * 10**8), classes=(0, 1))
    settings = SimulationSettings(
        shape=shape,
        num_clients=2,
        num_server_rounds=2,
        fleet=fleet,
        export=ExportConfig(onnx="off"),
    )
    cfg = settings.validate()
    assert cfg.shape == shape and cfg.fleet == fleet and cfg.min_nodes == 2
    assert ServerConfig.from_run_config(cfg.to_run_config()) == cfg
    sent = TrainInstruction(shape=cfg.shape, classes=cfg.fleet.classes).to_config()
    assert sent["classes"] == "0,1" and sent["local-steps"] == 3
    got = TrainInstruction.from_config(sent)
    assert got.shape == shape and got.classes == (0, 1)


@pytest.mark.parametrize(
    "fleet, needle",
    [
        (FleetConfig(memory_budgets=("1GB",)), "fleet-memory-budgets='1GB' is inv"),
        (FleetConfig(speeds=(1.0, 0.0)), "fleet-speeds='1.0,0.0' is invalid: pos"),
    ],
)
def test_settings_refuse_a_bad_fleet_naming_the_run_config_key(fleet, needle):
    with pytest.raises(ValueError, match=needle):
        SimulationSettings(num_clients=2, fleet=fleet).validate()
