"""Export of ``any_model`` workloads: dict inputs (transformers models on their own
loss) and tuple inputs export with their keys as input names, agree with torch, and
report torch and ONNX Runtime metrics; a model the exporter cannot take is one
``ExportError`` line, and a run records it and goes on."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from server.config import ExportConfig, ServerConfig
from server.export import RTOL, ExportError, export_model, unsupported_operator
from server.onnx_rounds import OnnxRounds
from wire.shape import RunShape
from workloads import get_workload

GPT2_MODULE = """
import torch
import transformers as tf


def build():
    tf.logging.set_verbosity_error()
    cfg = tf.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )
    ids = torch.randint(128, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": ids.clone()}
    return tf.GPT2LMHeadModel(cfg), (batch, None), None


def load_data(partition_id, num_partitions):
    g = torch.Generator().manual_seed(2)
    held = []
    for _ in range(2):
        ids = torch.randint(128, (3, 16), generator=g)
        labels = ids.clone()
        labels[0, :4] = -100  # padding the loss skips
        held.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "labels": labels})
    return [build()[1][0]], held
"""

BERT_MODULE = """
import torch
import transformers as tf


def build():
    tf.logging.set_verbosity_error()
    cfg = tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, vocab_size=128, max_position_embeddings=64,
        num_labels=3,
    )
    ids = torch.randint(128, (6, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "token_type_ids": torch.zeros_like(ids), "labels": ids[:, 0] % 3}
    return tf.BertForSequenceClassification(cfg), (batch, None), None
"""

PLAIN_MODULE = """
import torch
from torch import nn


class FixedLength(nn.Module):
    '''Tokens through a head over the whole, fixed-length window: only a static
    sequence axis exports.'''

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4)
        self.head = nn.Linear(4 * 10, 5)

    def forward(self, ids, scale):
        h = self.emb(ids) * scale
        return self.head(h.reshape(h.shape[0], -1))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale):
        y = self.lin(x) * scale
        if y.sum() > 0:  # a Python branch on a tensor's values
            return y * 2
        return y


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        loss = None if labels is None else ((logits[:, 0] - labels) ** 2).mean()
        return {"loss": loss, "logits": logits}


def fixed_length():
    ids = torch.randint(50, (4, 10), generator=torch.Generator().manual_seed(0))
    return FixedLength(), ((ids, torch.ones(4, 1, 1)), ids[:, 0] % 5), (
        nn.functional.cross_entropy
    )


def branchy():
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    return Branchy(), ((x, torch.ones(4, 1)), torch.tensor([0, 1, 2, 0])), (
        nn.functional.cross_entropy
    )


def regressor():
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    return Regressor(), ({"x": x, "labels": torch.randn(4)}, None), None
"""


def workload(tmp_path, monkeypatch, module, source, fn):
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    wl = get_workload(f"{module}:{fn}")
    assert wl.any_model
    return wl


def graph_inputs(path):
    graph = onnx.load(str(path), load_external_data=False).graph
    return {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
        for i in graph.input
    }, graph


def test_gpt2_dict_inputs_export_and_agree(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    wl = workload(tmp_path, monkeypatch, "ff_gpt2", GPT2_MODULE, "build")
    model = wl.make_model(1)
    path = tmp_path / "out" / "model.onnx"
    report = export_model(model, wl, path, quantize=True)

    inputs, graph = graph_inputs(path)
    assert inputs == {
        "input_ids": ["batch", "seq"],
        "attention_mask": ["batch", "seq"],
    }  # labels left out; batch and sequence axes dynamic
    assert [o.name for o in graph.output] == ["logits"]
    names = {i.name for i in graph.initializer}
    assert "transformer.h.0.attn.c_attn.weight" in names  # state-dict names
    assert report["sequence_axis"] == "dynamic"
    assert report["model_class"] == "GPT2LMHeadModel"

    check = report["verification"]
    assert check["ok"], check
    assert [(r["batch_size"], r.get("seq_len")) for r in check["batches"]] == [
        (1, None),
        (3, None),
        (4, None),
        (4, 8),
    ]
    # ORT's logits against torch's, independently of verify, at another length
    batch = wl.example[0]
    ids, mask = batch["input_ids"][:2, :11], batch["attention_mask"][:2, :11]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    )
    with torch.no_grad():
        ref = model.eval()(input_ids=ids, attention_mask=mask).logits.numpy()
    assert np.abs(got - ref).max() <= RTOL * max(1.0, np.abs(ref).max())

    ev = report["evaluation"]
    assert ev["metric"] == "perplexity"
    assert ev["num_examples"] == 2 * (3 * 15 - 3)  # shifted labels, 3 of them -100
    for key in ("loss", "accuracy", "perplexity"):
        assert ev["onnxruntime"][key] == pytest.approx(ev["torch"][key], rel=1e-4)
        assert np.isfinite(ev["int8"][key])
    assert report["int8"]["bytes"] < report["bytes"]
    assert (path.parent / report["int8"]["file"]).exists()
    on_disk = json.loads((path.parent / "export.json").read_text())
    assert on_disk["verification"] == check and on_disk["workload"] == wl.name


def test_bert_classifier_exports_and_agrees(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    wl = workload(tmp_path, monkeypatch, "ff_bert", BERT_MODULE, "build")
    report = export_model(wl.make_model(1), wl, tmp_path / "model.onnx")
    inputs, _ = graph_inputs(tmp_path / "model.onnx")
    assert list(inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    assert report["verification"]["ok"], report["verification"]
    ev = report["evaluation"]
    assert ev["metric"] == "accuracy" and ev["num_examples"] == 6
    assert ev["onnxruntime"]["loss"] == pytest.approx(ev["torch"]["loss"], rel=1e-4)
    assert ev["onnxruntime"]["accuracy"] == ev["torch"]["accuracy"]


def test_tuple_inputs_fall_back_to_a_static_sequence_axis(tmp_path, monkeypatch):
    wl = workload(tmp_path, monkeypatch, "ff_plain", PLAIN_MODULE, "fixed_length")
    report = export_model(wl.make_model(0), wl, tmp_path / "model.onnx")
    inputs, _ = graph_inputs(tmp_path / "model.onnx")
    assert inputs == {"inputs.0": ["batch", 10], "inputs.1": ["batch", 1, 1]}
    assert report["sequence_axis"] == "static"  # the exporter fixed it, silently
    assert report["sequence_axis_note"] == (
        "the exporter fixed the length of inputs.0 at 10 (the model needs that length)"
    )
    assert report["inputs"][0]["shape"] == ["batch", 10]
    assert report["verification"]["ok"]
    ev = report["evaluation"]  # the workload's loss_fn on ORT's logits
    assert ev["onnxruntime"]["loss"] == pytest.approx(ev["torch"]["loss"], rel=1e-5)


def test_a_refused_sequence_axis_is_retried_static(tmp_path, monkeypatch):
    wl = workload(tmp_path, monkeypatch, "ff_plain", PLAIN_MODULE, "fixed_length")
    export = torch.onnx.export

    def refuse_sequence_axes(*args, dynamic_shapes, **kwargs):
        if any(1 in axes for axes in dynamic_shapes[0]):
            raise RuntimeError("no symbolic lengths here")
        return export(*args, dynamic_shapes=dynamic_shapes, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", refuse_sequence_axes)
    report = export_model(wl.make_model(0), wl, tmp_path / "model.onnx")
    assert report["sequence_axis"] == "static"
    assert report["sequence_axis_note"] == (
        "the exporter refused a dynamic sequence axis (RuntimeError: no symbolic "
        "lengths here)"
    )
    assert report["verification"]["ok"]


def test_metrics_not_defined_by_logits_are_not_computed(tmp_path, monkeypatch):
    wl = workload(tmp_path, monkeypatch, "ff_plain", PLAIN_MODULE, "regressor")
    report = export_model(wl.make_model(0), wl, tmp_path / "model.onnx", quantize=True)
    inputs, _ = graph_inputs(tmp_path / "model.onnx")
    assert inputs == {"x": ["batch", 4]}
    ev = report["evaluation"]
    assert ev["torch"]["loss"] >= 0 and ev["onnxruntime"] is None
    assert "not a cross-entropy" in ev["onnxruntime_not_computed"]
    assert "file" in report["int8"] and "int8" not in ev


def test_unexportable_model_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch):
    wl = workload(tmp_path, monkeypatch, "ff_plain", PLAIN_MODULE, "branchy")
    with pytest.raises(ExportError) as info:
        export_model(wl.make_model(0), wl, tmp_path / "model.onnx")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot export ff_plain:branchy (Branchy) to ONNX: ")
    assert "data-dependent" in message and "torch.cond" in message
    assert not list(tmp_path.glob("*.onnx*"))

    cfg = ServerConfig(
        shape=RunShape(workload=wl.name),
        num_server_rounds=1,
        export=ExportConfig(onnx="end"),
    )
    out = tmp_path / "run"
    out.mkdir()
    assert OnnxRounds(cfg, wl, out).after_round(wl.make_model(0), 1) is None
    failed = json.loads((out / "export.json").read_text())
    assert failed["error"] == message and failed["round"] == 1


def test_a_failed_decomposition_is_not_called_a_missing_operator():
    try:
        try:
            raise ValueError(
                "Cannot view a tensor with shape torch.Size([s27, 12, 2, 16])\n\n"
                "While executing %view_4 : [num_users=1] = call_function["
                "target=torch.ops.aten.view.default](args = (%t, [%s, 12, -1]))"
            )
        except ValueError as e:
            raise RuntimeError("Failed to decompose the FX graph for ONNX") from e
    except RuntimeError as e:
        assert unsupported_operator(e) is None
