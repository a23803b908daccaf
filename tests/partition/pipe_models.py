"""Small models for the multi-process pipeline tests (``module:function`` workloads)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def deep_mlp() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """Eight blocks (enough for 4 ranks x 2 stages), batch 8, float32."""
    width = 32
    blocks: list[nn.Module] = [nn.Sequential(nn.Linear(16, width), nn.Tanh())]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(6)]
    blocks.append(nn.Linear(width, 5))
    model = nn.Sequential(*blocks)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 16, generator=g)
    y = torch.randint(5, (8,), generator=g)
    return model, (x, y), F.cross_entropy
