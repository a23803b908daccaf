"""Export to ONNX: every built-in workload agrees with torch within the bound, the
int8 model's accuracy change is reported, unsupported operators are named."""

from __future__ import annotations

import json
import math

import onnx
import pytest
import torch
from torch import nn

from server.export import (
    ExportError,
    export_model,
    export_onnx,
    unsupported_operator,
    verify,
)
from workloads import Workload, get_workload

FAST = ["digits-cnn", "digits-cnn-bn", "digits-mlp", "gpt-tiny"]
SLOW = [("gpt-byte", {}), ("gpt2-small", {}), ("gpt2-medium", {})]
SMALL_LM = {"batch_size": 2, "seq_len": 16}  # GPT-2 shapes: short sequences


def check_report(report, wl, tmp_path):
    check = report["verification"]
    assert check["ok"], check
    assert [r["batch_size"] for r in check["batches"]] == [1, 3, 8]
    for r in check["batches"]:
        assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["max_abs_output"]) == r["bound"]
    graph = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph
    (inp,) = graph.input
    assert inp.name == "inputs" and inp.type.tensor_type.shape.dim[0].dim_param
    assert [o.name for o in graph.output] == ["logits"]
    ev = report["evaluation"]
    assert ev["onnxruntime"]["accuracy"] == pytest.approx(
        ev["torch"]["accuracy"], abs=1.5 / ev["num_examples"]
    )
    assert ev["onnxruntime"]["loss"] == pytest.approx(ev["torch"]["loss"], rel=1e-4)
    int8 = report["int8"]
    assert (tmp_path / int8["file"]).exists() and int8["bytes"] < report["bytes"]
    assert math.isfinite(int8["accuracy_change"]) and abs(int8["accuracy_change"]) < 0.2
    on_disk = json.loads((tmp_path / "export.json").read_text())
    assert on_disk["int8"] == int8 and on_disk["workload"] == wl.name


@pytest.mark.parametrize("name", FAST)
def test_builtin_workload_exports_and_agrees(name, tmp_path):
    wl = get_workload(name)
    model = wl.make_model(1)
    report = export_model(model, wl, tmp_path / "model.onnx", quantize=True)
    check_report(report, wl, tmp_path)
    assert model.training  # export leaves the model's mode as it was


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["gpt-byte", "gpt2-small", "gpt2-medium"])
def test_large_workload_exports_and_agrees(name, tmp_path):
    # 32 held-out windows: the torch, ORT and int8 evaluations were a third of the time
    shape = SMALL_LM if name.startswith("gpt2") else {}
    wl = get_workload(name, eval_windows=32, **shape)
    report = export_model(wl.make_model(1), wl, tmp_path / "model.onnx", quantize=True)
    check_report(report, wl, tmp_path)


def test_verify_catches_a_disagreeing_model(tmp_path):
    wl = get_workload("digits-mlp")
    path = export_onnx(wl.make_model(0), wl, tmp_path / "model.onnx")
    check = verify(wl.make_model(1), wl, path)
    assert not check["ok"]
    assert all(r["max_abs_diff"] > r["bound"] for r in check["batches"])


@torch.library.custom_op("fleetfit_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Mystery(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mystery(self.lin(x))


def test_unsupported_operator_is_named(tmp_path):
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    wl = Workload(
        "mystery", "custom", 4, None, Mystery, nn.functional.cross_entropy,
        "example", (x, y),
    )  # fmt: skip
    with pytest.raises(ExportError, match=r"operator fleetfit_test\.mystery") as info:
        export_model(wl.make_model(0), wl, tmp_path / "model.onnx")
    assert unsupported_operator(info.value.__cause__) == "fleetfit_test.mystery"
    assert not (tmp_path / "model.onnx").exists()
