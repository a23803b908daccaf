"""A dense decoder-only transformer as the GPU layout model sees it: its shapes, from
a preset, a transformers ``config.json`` or explicit numbers.

    spec = TransformerSpec.from_config("config.json", seq_len=8192)
    spec = TransformerSpec("mine", num_layers=32, hidden=4096, ffn=14336,
                           num_heads=32, num_kv_heads=8, vocab=128256, seq_len=8192)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers config keys, Llama/Mistral first, GPT-2 second
_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "num_heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
}
_GATED_ACTS = {"silu", "swish", "swiglu", "geglu"}


@dataclass(frozen=True)
class TransformerSpec:
    """A dense decoder-only transformer: Llama-style (SwiGLU MLP, grouped-query
    attention) when ``gated``, GPT-style (a 2-matrix GELU MLP) otherwise."""

    name: str
    num_layers: int  # L
    hidden: int  # h
    ffn: int  # MLP inner width (SwiGLU: each of the 3 matrices is h x ffn)
    num_heads: int  # a
    num_kv_heads: int
    vocab: int
    seq_len: int  # s, tokens per sequence
    gated: bool = True  # SwiGLU (3 MLP matrices) or GELU (2)
    tied: bool = False  # input embedding and output head share one matrix

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "ffn", "num_heads", "num_kv_heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} {getattr(self, field)} must be at least 1")
        if self.vocab < 1 or self.seq_len < 1:
            raise ValueError(
                f"vocab {self.vocab} and seq_len {self.seq_len} must be at least 1"
            )
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden {self.hidden} is not a multiple of heads {self.num_heads}; "
                "give a head count that divides the hidden size"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"heads {self.num_heads} is not a multiple of kv-heads "
                f"{self.num_kv_heads}; give kv-heads dividing the head count"
            )

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.num_kv_heads // self.num_heads

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.ffn
        mlp = (3 if self.gated else 2) * h * f
        return 2 * h * h + 2 * h * self.kv_dim + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward and backward; MFU's numerator):
        ``6N`` for the weights (the head counted even when tied) and ``6Lhs`` for
        causal attention (half of PaLM's ``12Lhs``, which counts the masked half)."""
        head = self.vocab * self.hidden if self.tied else 0
        return 6 * (self.num_params + head) + 6 * self.num_layers * self.hidden * (
            self.seq_len
        )

    def with_seq(self, seq_len: int | None) -> TransformerSpec:
        if seq_len is None:
            return self
        return TransformerSpec(**{**self.__dict__, "seq_len": seq_len})

    @classmethod
    def from_config(
        cls, path: str | Path, seq_len: int | None = None
    ) -> TransformerSpec:
        """The shapes in a transformers ``config.json`` (Llama, Mistral, GPT-2 keys).

        Raises:
            ValueError: the file is missing, not JSON, or lacks a needed key (the
                message names the key and the flag that can stand in for it).
        """
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"config file {str(p)!r} does not exist; give a "
                "transformers config.json"
            )
        try:
            cfg: dict[str, Any] = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {str(p)!r} is not JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"config file {str(p)!r} holds no JSON object")

        def need(field: str) -> int:
            for key in _KEYS[field]:
                if isinstance(cfg.get(key), int):
                    return int(cfg[key])
            flag = "--" + field.replace("num_", "").replace("_", "-")
            raise ValueError(
                f"config file {str(p)!r} has no {' or '.join(_KEYS[field])}; "
                f"add it, or describe the model with explicit flags ({flag} ...)"
            )

        L, h, a, V = (need(k) for k in ("num_layers", "hidden", "num_heads", "vocab"))
        kv = cfg.get("num_key_value_heads") or a
        act = str(cfg.get("hidden_act") or cfg.get("activation_function") or "")
        gated = act in _GATED_ACTS
        ffn = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * h
        seq = (
            seq_len
            or cfg.get("max_position_embeddings")
            or cfg.get("n_positions")
            or cfg.get("n_ctx")
        )
        if not seq:
            raise ValueError(
                f"config file {str(p)!r} has no max_position_embeddings or "
                "n_positions; give the sequence length with --seq"
            )
        # transformers' default is tied; Llama/Mistral configs say false
        tied = bool(cfg.get("tie_word_embeddings", True))
        name = str(cfg.get("_name_or_path") or cfg.get("model_type") or p.stem)
        return cls(name, L, h, int(ffn), a, int(kv), V, int(seq), gated, tied)


MODELS = {
    "llama2-7b": TransformerSpec("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
    "llama2-13b": TransformerSpec("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
    "llama2-70b": TransformerSpec("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
    "llama3-8b": TransformerSpec("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192),
    "llama3-70b": TransformerSpec("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192),
    "llama3-405b": TransformerSpec(
        "llama3-405b", 126, 16384, 53248, 128, 8, 128256, 8192
    ),
    "gpt3-175b": TransformerSpec(
        "gpt3-175b", 96, 12288, 4 * 12288, 96, 96, 50257, 2048, gated=False, tied=True
    ),
}
"""Shapes from the Llama 2 paper (Touvron et al. 2023), the Llama 3 model cards
and GPT-3 (Brown et al. 2020)."""
