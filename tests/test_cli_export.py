"""``fleetfit export``: a saved model.safetensors to ONNX, from its metadata alone."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort

from fleetfit.cli import main
from server.persist import save_model
from workloads import get_workload


def test_export_checkpoint_from_its_metadata(tmp_path, capsys):
    wl = get_workload("gpt-tiny", seq_len=24)
    model = wl.make_model(5)
    ckpt = tmp_path / "run" / "model.safetensors"
    save_model(
        ckpt,
        model.state_dict(),
        {"workload": "gpt-tiny", "settings": json.dumps({"seq-len": 24})},
    )
    out = tmp_path / "out" / "tiny.onnx"
    assert (
        main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--quantize"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "max |diff|" in printed and "int8" in printed
    report = json.loads((tmp_path / "out" / "tiny.export.json").read_text())
    assert report["verification"]["ok"] and report["input"]["shape"] == ["batch", 24]
    assert (tmp_path / "out" / "tiny.int8.onnx").exists()
    assert "accuracy_change" in report["int8"]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).integers(0, 256, (5, 24))
    assert sess.run(None, {"inputs": x})[0].shape == (5, 24, 256)


def test_export_bad_checkpoints_fail_with_a_message(tmp_path, capsys):
    out = str(tmp_path / "m.onnx")
    assert main(["export", "--checkpoint", str(tmp_path / "none"), "--out", out]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    plain = tmp_path / "plain.safetensors"
    save_model(plain, get_workload("digits-mlp").make_model(0).state_dict(), {})
    assert main(["export", "--checkpoint", str(plain), "--out", out]) == 2
    assert "no 'workload' metadata" in capsys.readouterr().err
    wrong = tmp_path / "wrong.safetensors"
    save_model(wrong, get_workload("digits-mlp").make_model(0).state_dict(),
               {"workload": "digits-cnn"})  # fmt: skip
    assert main(["export", "--checkpoint", str(wrong), "--out", out]) == 2
    assert "does not hold a digits-cnn model" in capsys.readouterr().err
