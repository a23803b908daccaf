"""Tiny transformers causal LMs for the pipeline tests (``module:function``
workloads): random weights from a config, no download, the model's own loss."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 128
SEQ = 16
BATCH = 4


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> tuple[Any, tuple[dict, None], None]:
    """GPT-2, 2 layers, d=32: its head tied to its token embedding."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg), (_batch(), None), None


def llama() -> tuple[Any, tuple[dict, None], None]:
    """Llama, 3 layers, d=32, grouped-query attention, rotary embeddings, untied."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(
        num_hidden_layers=3,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg), (_batch(), None), None
