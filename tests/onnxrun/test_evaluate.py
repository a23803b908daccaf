"""onnxrun: torch-free ONNX evaluation and its measured child process."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from onnxrun.evaluate import cross_entropy_sum, evaluate_arrays, make_session
from onnxrun.measure import OrtEvalError, evaluate_in_child
from server.export import export_onnx
from workloads import get_workload


@pytest.mark.child
def test_importing_onnxrun_does_not_import_torch():
    code = (
        "import sys, onnxrun, onnxrun.evaluate, onnxrun.measure; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'workloads', "
        "'memory', 'server', 'client')]; print(bad); assert not bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cross_entropy_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, 11, generator=g) * 4
    targets = torch.randint(11, (7, 5), generator=g)
    nll, correct = cross_entropy_sum(logits.numpy(), targets.numpy())
    ref = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="sum")
    assert nll == pytest.approx(float(ref), rel=1e-6)
    assert correct == int((logits.argmax(-1) == targets).sum())


@pytest.fixture(scope="module")
def mlp_onnx(tmp_path_factory):
    wl = get_workload("digits-mlp")
    model = wl.make_model(3)
    path = export_onnx(model, wl, tmp_path_factory.mktemp("mlp") / "model.onnx")
    return wl, model, path


def test_ort_metrics_equal_torch_evaluate(mlp_onnx):
    wl, model, path = mlp_onnx
    x, y = wl.eval_arrays()
    got = evaluate_arrays(make_session(str(path)), x, y, "image")
    ref = wl.evaluate(model)
    assert got["num_examples"] == len(wl.items(train=False))
    assert got["accuracy"] == ref["accuracy"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.child
def test_child_evaluates_without_torch_and_reports_its_peak(mlp_onnx):
    wl, model, path = mlp_onnx
    x, y = wl.eval_arrays()
    m = evaluate_in_child(path, x, y, "image")
    assert "torch" not in m.modules and "onnxruntime" in m.modules
    assert m.metrics["accuracy"] == wl.evaluate(model)["accuracy"]
    # numpy + onnxruntime: far below a torch process's ~300 MB after imports
    assert 20e6 < m.baseline_bytes < 250e6
    assert 0 < m.peak_bytes < 200e6
    assert m.hwm_bytes == m.baseline_bytes + m.peak_bytes


@pytest.mark.child
def test_child_failure_is_reported(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(OrtEvalError, match="ONNX evaluation failed"):
        evaluate_in_child(bad, np.zeros((1, 64), np.float32), np.zeros(1), "image")
