"""An ``int8`` frozen base (``memory.lora.Int8Linear``): per-row symmetric int8
weights, float32 arithmetic, a backward that dequantizes again instead of keeping
the weight or the input, and which layers it converts (untied linear layers only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memory.lora import (
    Int8Linear,
    LoraSpec,
    dequantize,
    frozen_base_bytes,
    int8_linears,
    quantize,
)
from workloads.models import GPT, GPTConfig


def test_quantize_rounds_each_row_to_its_own_scale():
    torch.manual_seed(0)
    w = torch.randn(6, 10)
    w[3] = 0.0  # an all-zero row: scale 1, all zeros
    q, scale = quantize(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.shape == w.shape and scale.shape == (6,)
    assert int(q.abs().max()) == 127  # each non-zero row uses the full range
    assert torch.equal(q[3], torch.zeros(10, dtype=torch.int8)) and scale[3] == 1
    err = (dequantize(q, scale) - w).abs()
    assert bool((err <= scale.unsqueeze(1) / 2 + 1e-7).all())  # half a step at most


def test_int8_linear_forward_and_input_gradient_are_the_dequantized_layers():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    m = Int8Linear.from_linear(lin)
    w = dequantize(m.qweight, m.scale)
    x = torch.randn(3, 5, 16, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    y = m(x)
    ref = ref_x @ w.t() + lin.bias.detach()
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert x.grad is not None and torch.equal(x.grad, ref_x.grad)
    assert m.bias is not None and m.bias.grad is None  # frozen
    assert not any(p.requires_grad for p in m.parameters())


def test_int8_linear_keeps_neither_its_input_nor_a_float_weight_for_backward():
    m = Int8Linear.from_linear(nn.Linear(32, 24, bias=False))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x = torch.randn(4, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).sum().backward()
    assert saved, "the backward must dequantize from something saved"
    assert {t.dtype for t in saved} <= {torch.int8, torch.float32}
    assert all(t.dtype == torch.int8 or t.dim() == 1 for t in saved), [
        (t.dtype, tuple(t.shape)) for t in saved
    ]


def test_a_conv1d_converts_with_its_weight_transposed():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conv = tf.pytorch_utils.Conv1D(12, 20)  # nf=12 outputs, nx=20 inputs
    m = Int8Linear.from_linear(conv)
    assert m.qweight.shape == (12, 20)
    x = torch.randn(2, 20)
    assert torch.allclose(m(x), conv(x), atol=0.05)


def test_tied_heads_and_adapter_factors_stay_float32():
    tied = GPT(GPTConfig(256, 16, 32, 1, 4, tie_weights=True))
    paths = int8_linears(tied)
    assert "head.proj" not in paths  # the embedding's weight
    assert {"layers.0.qkv", "layers.0.fc"} <= set(paths)
    untied = GPT(GPTConfig(256, 16, 32, 1, 4))
    assert "head.proj" in int8_linears(untied)


def test_frozen_base_bytes_counts_int8_weights_scales_and_the_rest():
    layer = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.Linear(32, 8))
    int8 = {id(layer[1]), id(layer[2])}
    floats = sum(p.numel() * 4 for p in layer.parameters())
    assert frozen_base_bytes(layer, "float32", set()) == (floats, 0)
    assert frozen_base_bytes(layer, "bfloat16", set()) == (floats // 2, 0)
    held, transient = frozen_base_bytes(layer, "int8", int8)
    # LayerNorm (16 floats) and the biases (32 + 8) stay float32
    assert held == 4 * (16 + 32 + 8) + (8 * 32 + 4 * 32) + (32 * 8 + 4 * 8)
    assert transient == 4 * 8 * 32  # one layer's weight dequantized at a time


def test_lora_spec_accepts_int8_and_names_the_choices():
    assert LoraSpec(rank=4, alpha=8.0, base_dtype="int8").base_dtype == "int8"
    with pytest.raises(ValueError, match="float32, bfloat16, int8"):
        LoraSpec(rank=4, alpha=8.0, base_dtype="int4")
