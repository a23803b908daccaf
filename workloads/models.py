"""Built-in models. Every model is a sequence of blocks: its children, in order, are
what its ``forward`` runs, so ``memory.blocks.as_blocks`` can plan over them.

- ``DigitsCNN``: a small CNN for scikit-learn's 8x8 digits (optionally with BatchNorm).
- ``MLP``: a plain multi-layer perceptron on the same digits.
- ``GPT``: a GPT-style decoder: ``embed`` (token + position), ``layers`` (an
  ``nn.ModuleList`` of pre-norm transformer layers) and ``head`` (final norm and the
  vocabulary projection, optionally tied to the token embedding as in GPT-2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _conv_stage(c_in: int, c_out: int, batch_norm: bool, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU())
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class DigitsCNN(nn.Sequential):
    """CNN for 1x8x8 digits: two conv stages, a hidden layer, a classifier (4 blocks)."""

    def __init__(
        self,
        channels: tuple[int, int] = (16, 32),
        hidden: int = 64,
        num_classes: int = 10,
        batch_norm: bool = False,
    ) -> None:
        c1, c2 = channels
        super().__init__(
            _conv_stage(1, c1, batch_norm, pool=False),
            _conv_stage(c1, c2, batch_norm, pool=True),  # 8x8 -> 4x4
            nn.Sequential(nn.Flatten(), nn.Linear(c2 * 16, hidden), nn.ReLU()),
            nn.Linear(hidden, num_classes),
        )


class MLP(nn.Sequential):
    """Multi-layer perceptron on flattened inputs; one block per hidden layer."""

    def __init__(
        self, in_features: int = 64, hidden: tuple[int, ...] = (128, 128), out: int = 10
    ) -> None:
        blocks: list[nn.Module] = []
        prev = in_features
        for i, width in enumerate(hidden):
            layers: list[nn.Module] = [nn.Flatten()] if i == 0 else []
            layers += [nn.Linear(prev, width), nn.ReLU()]
            blocks.append(nn.Sequential(*layers))
            prev = width
        blocks.append(nn.Linear(prev, out))
        super().__init__(*blocks)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-style decoder."""

    vocab_size: int  # tokens
    context: int  # longest sequence, tokens
    d_model: int  # width of the residual stream
    num_layers: int  # transformer layers
    num_heads: int  # attention heads; must divide d_model
    tie_weights: bool = False  # head projection shares the token embedding (GPT-2)

    def __post_init__(self) -> None:
        for field in ("vocab_size", "context", "d_model", "num_layers", "num_heads"):
            if getattr(self, field) <= 0:
                raise ValueError(f"GPTConfig.{field} must be positive")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.pos.num_embeddings:
            raise ValueError(
                f"sequence of {t} tokens exceeds the model's context of "
                f"{self.pos.num_embeddings}"
            )
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: causal self-attention and a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.num_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class GPT(nn.Module):
    """GPT-style decoder: ``embed``, ``layers`` (ModuleList), ``head``; run in that order."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg) for _ in range(cfg.num_layers)
        )
        self.head = Head(cfg)
        self.apply(self._init)
        if cfg.tie_weights:
            self.head.proj.weight = self.embed.tok.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


GPT_PRESETS: dict[str, GPTConfig] = {
    # tests: tiny and fast
    "gpt-tiny": GPTConfig(
        vocab_size=256, context=64, d_model=64, num_layers=2, num_heads=4
    ),
    # byte-level LM for the standard-library corpus, ~19M parameters
    "gpt-byte": GPTConfig(
        vocab_size=256, context=256, d_model=512, num_layers=6, num_heads=8
    ),
    # GPT-2 shapes (tied embeddings, 50,257 tokens), random weights, for memory and speed
    "gpt2-small": GPTConfig(
        vocab_size=50257,
        context=1024,
        d_model=768,
        num_layers=12,
        num_heads=12,
        tie_weights=True,
    ),
    "gpt2-medium": GPTConfig(
        vocab_size=50257,
        context=1024,
        d_model=1024,
        num_layers=24,
        num_heads=16,
        tie_weights=True,
    ),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
