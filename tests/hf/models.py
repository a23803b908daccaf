"""Transformers architectures built from their configs (random weights, nothing
downloaded), with a batch each: the models users bring, for the memory tests.

``build(name, size)`` returns ``(model, batch)`` where ``batch`` is ``(inputs, None)``:
every model here computes its own loss from ``labels``. ``size`` is ``"test"`` (small,
for equivalence), ``"measured"`` (plain training's measured peak at least 4x the
runtime's fixed cost, for the measured tests) or ``"bench"`` (larger, for
benchmarks/memory_transformers.py).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers as tf
from torch import nn

# The modeling modules import lazily on first use: import them here, so that a
# measuring child that preloads this module counts them in its baseline, as it counts
# torch (library code, not training).
_CLASSES = (
    tf.GPT2LMHeadModel,
    tf.LlamaForCausalLM,
    tf.BertForMaskedLM,
    tf.ViTForImageClassification,
    tf.T5ForConditionalGeneration,
)

NAMES = ("gpt2", "llama", "bert", "vit", "t5")

_SIZES: dict[str, dict[str, dict[str, int]]] = {
    # d: width, L: layers, V: vocabulary, B: batch, T: tokens (or image side for vit)
    "test": {  # 4 x 64 tokens: the equivalences hold whatever the length
        "gpt2": dict(d=256, L=4, V=8192, B=4, T=64),
        "llama": dict(d=256, L=4, V=8192, B=4, T=64),
        "bert": dict(d=256, L=4, V=8192, B=4, T=64),
        "vit": dict(d=256, L=4, V=10, B=16, T=128),
        "t5": dict(d=256, L=3, V=8192, B=4, T=64),
    },
    # plain training's measured peak at least 4x the runtime's fixed cost (79 MiB),
    # and a third of it above the smallest plan also where the runtime's measured
    # first-step cost is 67-74 MiB (CI, a fresh environment) rather than 29 MiB
    "measured": {
        "gpt2": dict(d=256, L=7, V=8192, B=4, T=256),
        "llama": dict(d=256, L=10, V=8192, B=4, T=256),
        "bert": dict(d=256, L=11, V=8192, B=4, T=256),
        "vit": dict(d=256, L=6, V=10, B=32, T=160),
        "t5": dict(d=256, L=5, V=8192, B=8, T=192),
    },
    "bench": {  # larger than "measured" (GPT-2 small itself: benchmarks/memory_transformers.py)
        "gpt2": dict(d=512, L=8, V=32000, B=4, T=512),
        "llama": dict(d=512, L=8, V=32000, B=4, T=512),
        "bert": dict(d=512, L=8, V=30522, B=8, T=512),
        "vit": dict(d=512, L=8, V=1000, B=32, T=224),
        "t5": dict(d=512, L=6, V=32128, B=8, T=256),
    },
}


def _quiet() -> None:
    tf.logging.set_verbosity_error()


def build(
    name: str, size: str = "test", seed: int = 0, dropout: float = 0.0
) -> tuple[nn.Module, Any]:
    """A model with random weights and its batch ``(inputs, None)``.

    ``dropout`` is 0 by default: micro-batching draws other dropout masks than one
    whole batch, so equality with plain training holds only without dropout (recompute
    and offload keep the masks and are tested with dropout too)."""
    _quiet()
    s = _SIZES[size][name]
    d, L, V, B, T = s["d"], s["L"], s["V"], s["B"], s["T"]
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    heads = max(4, d // 64)
    if name == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=d,
            n_layer=L,
            n_head=heads,
            vocab_size=V,
            n_positions=T,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
        model: nn.Module = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, V, (B, T), generator=g)
        inputs: dict[str, torch.Tensor] = dict(input_ids=ids, labels=ids.clone())
    elif name == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=d,
            intermediate_size=int(8 * d / 3) // 8 * 8,
            num_hidden_layers=L,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            vocab_size=V,
            max_position_embeddings=T,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            attention_dropout=dropout,
        )
        model = tf.LlamaForCausalLM(cfg)
        ids = torch.randint(1, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - T // 4 :] = 0  # one padded row: the loss must count tokens
        labels = ids.clone()
        labels[mask == 0] = -100
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    elif name == "bert":
        cfg = tf.BertConfig(
            hidden_size=d,
            num_hidden_layers=L,
            num_attention_heads=heads,
            intermediate_size=4 * d,
            vocab_size=V,
            max_position_embeddings=T,
            pad_token_id=0,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        model = tf.BertForMaskedLM(cfg)
        ids = torch.randint(1, V, (B, T), generator=g)
        labels = torch.full_like(ids, -100)
        masked = torch.rand(B, T, generator=g) < 0.15
        labels[masked] = ids[masked]
        ids = ids.masked_fill(masked, 1)
        inputs = dict(input_ids=ids, labels=labels)
    elif name == "vit":
        patch = 16
        cfg = tf.ViTConfig(
            hidden_size=d,
            num_hidden_layers=L,
            num_attention_heads=heads,
            intermediate_size=4 * d,
            image_size=T,
            patch_size=patch,
            num_labels=V,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        model = tf.ViTForImageClassification(cfg)
        pix = torch.randn(B, 3, T, T, generator=g)
        inputs = dict(pixel_values=pix, labels=torch.randint(0, V, (B,), generator=g))
    elif name == "t5":
        cfg = tf.T5Config(
            d_model=d,
            d_ff=4 * d,
            d_kv=64,
            num_layers=L,
            num_decoder_layers=L,
            num_heads=heads,
            vocab_size=V,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            dropout_rate=dropout,
        )
        model = tf.T5ForConditionalGeneration(cfg)
        ids = torch.randint(2, V, (B, T), generator=g)
        labels = torch.randint(2, V, (B, T // 2), generator=g)
        labels[1, -8:] = -100
        inputs = dict(input_ids=ids, labels=labels)
    else:
        raise ValueError(f"unknown architecture {name!r}; one of {NAMES}")
    for mod in model.modules():  # training: no KV cache (T5's decoder has its own)
        if getattr(getattr(mod, "config", None), "use_cache", False):
            mod.config.use_cache = False
    model.train()
    return model, (inputs, None)


def build_batch(name: str, size: str = "test", seed: int = 0) -> tuple[nn.Module, Any]:
    """``build`` with JSON arguments: a factory for ``memory.step.train_measured``."""
    return build(name, size, seed)


def tiny_lm(
    config_class: Any, model_class: Any, vocab_size: int, **extra: Any
) -> nn.Module:
    """A two-layer transformers LM of width 32 (random weights, seed 0) from its config
    class, ``extra`` overriding the config: the tests' small causal LMs of any family."""
    _quiet()
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg.update(extra)
    return model_class(config_class(**cfg))
