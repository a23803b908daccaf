"""``fleetfit export``: a saved model.safetensors to ONNX, from its metadata alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from fleetfit.cli import main
from fleetfit.cmd_export import summary_lines
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


GPT2_MODULE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build():
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(cfg), ({"input_ids": ids, "labels": ids.clone()}, None), None
"""


def test_export_custom_workload_checkpoint(tmp_path, monkeypatch, capsys):
    """A ``module:function`` workload fixes its own batch: the settings' batch shape
    is not applied to it (``with_shape`` refuses one), and the export goes through."""
    pytest.importorskip("transformers")
    import torch

    from server import persist
    from server.config import ServerConfig
    from wire.shape import RunShape

    (tmp_path / "ff_cli_gpt2.py").write_text(GPT2_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    spec = "ff_cli_gpt2:build"
    model = get_workload(spec).make_model(3)
    ckpt = tmp_path / "run" / persist.MODEL_FILE
    shape = RunShape(workload=spec, batch_size=4, seq_len=16)
    settings = ServerConfig(shape=shape).to_run_config()
    persist.save_model(  # as server.loop.Federation._save writes it
        ckpt,
        model.state_dict(),
        {
            "fleetfit-schema": str(persist.SCHEMA_VERSION),
            "workload": spec,
            "round": "2",
            "settings": json.dumps(settings, sort_keys=True),
        },
    )
    out = tmp_path / "out" / "gpt2.onnx"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out + printed.err
    assert "input_ids ['batch', 'seq']" in printed.out
    assert "held-out perplexity: torch" in printed.out
    report = json.loads((tmp_path / "out" / "gpt2.export.json").read_text())
    assert report["model_class"] == "GPT2LMHeadModel" and report["verification"]["ok"]
    assert report["checkpoint"] == str(ckpt)
    ids = np.random.default_rng(1).integers(0, 128, (3, 10))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids})[0]
    with torch.no_grad():  # the checkpoint's weights, not the function's
        ref = model.eval()(torch.from_numpy(ids), use_cache=False).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_summary_says_what_was_not_computed():
    report = {
        "bytes": 1000,
        "input": {"name": "x", "shape": ["batch", 4]},
        "verification": {
            "max_abs_diff": 1e-7,
            "tolerance": "max |ort - torch| <= ...",
            "batches": [{"batch_size": 1}, {"batch_size": 4, "seq_len": 2}],
        },
        "evaluation": {
            "metric": "accuracy",
            "num_examples": 4,
            "torch": {"loss": 0.5, "accuracy": 0.75},
            "onnxruntime": None,
            "onnxruntime_not_computed": "the model's own loss is not a cross-entropy",
        },
        "int8": {"error": "int8 quantisation failed: RuntimeError: no"},
    }
    lines = summary_lines(report, Path("m.onnx"))
    assert "over batch sizes [1, 4 x 2 tokens]" in lines[1]
    assert lines[2] == (
        "held-out accuracy: torch 0.7500, onnxruntime not computed (the model's own "
        "loss is not a cross-entropy)"
    )
    assert lines[3] == "int8: int8 quantisation failed: RuntimeError: no"
