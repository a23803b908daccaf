"""Aggregating LoRA adapters by their products: FLoRA's stacking.

A device ``k`` that trained adapters on a target module returns ``A_k`` (r_k x in)
and ``B_k`` (out x r_k); what it trained is the update ``s_k B_k @ A_k``
(``s_k = alpha / r_k``). Averaging the factors separately is unsound:
``mean(B) @ mean(A)`` is not ``mean(B @ A)`` (it adds cross terms ``B_j A_k``), and
factors of different ranks cannot be averaged at all.

FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
Heterogeneous Low-Rank Adaptations", NeurIPS 2024) stacks them instead:

    B_stack = [p_1 s_1 B_1 | ... | p_K s_K B_K]      (out x sum r_k)
    A_stack = [A_1; ...; A_K]                         (sum r_k x in)
    B_stack @ A_stack = sum_k p_k s_k B_k @ A_k       (exactly)

with ``p_k`` the devices' example weights. It is exact for any mix of ranks (no
zero-padding as in HetLoRA, no truncation as in FlexLoRA's SVD), costs one product
per target module, and the stacked update is merged into the global weights: the
next round's devices start from the merged base with fresh adapters (``B = 0``), as
FLoRA's clients do.

In a round the server turns every accepted adapter reply into the dense weights it
trained (``merged_update``: ``W + s_k B_k @ A_k`` for its target keys), so that the
norm bound, central DP's clipping and the server optimizer act on the update a
device made, not on its factors; the per-key weighted mean of those
(``server.aggregate.weighted_average``) is ``W + B_stack @ A_stack`` for keys only
adapters trained, and mixes with ``full`` and ``part`` devices' values key by key.
``stack`` and ``merge`` are the factor-level form (tested equal).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from memory.lora import factor_keys


@dataclass(frozen=True)
class AdapterReply:
    """One device's adapter factors (wire keys) with its weight and scaling."""

    factors: Mapping[str, torch.Tensor]  # "<path>.lora_A" / "<path>.lora_B"
    num_examples: int
    scaling: float  # alpha / rank


def delta(
    a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool = False
) -> torch.Tensor:
    """The dense update ``scaling * B @ A`` in float64, shaped as the module's weight
    (transposed for a fan-in-fan-out ``Conv1D``)."""
    d = scaling * (b.to(torch.float64) @ a.to(torch.float64))
    return d.T if transposed else d


def stack(
    replies: Sequence[AdapterReply], path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacked factors of one target module, in float64:
    ``B_stack @ A_stack`` is the example-weighted mean of the devices' updates."""
    total = sum(r.num_examples for r in replies)
    if total <= 0:
        raise ValueError("no examples among the adapter replies")
    ka, kb = factor_keys(path)
    a_stack = torch.cat([r.factors[ka].to(torch.float64) for r in replies], dim=0)
    b_stack = torch.cat(
        [
            r.factors[kb].to(torch.float64) * (r.scaling * r.num_examples / total)
            for r in replies
        ],
        dim=1,
    )
    return b_stack, a_stack


def merge(
    state: Mapping[str, torch.Tensor],
    replies: Sequence[AdapterReply],
    paths: Sequence[str],
    transposed: Mapping[str, bool] | None = None,
) -> dict[str, torch.Tensor]:
    """``state`` with every target module's weight plus its stacked update (the
    global model after a round in which only adapters trained those keys): a plain
    state dict, the model's own keys."""
    out = dict(state)
    for p in paths:
        b, a = stack(replies, p)
        key = f"{p}.weight"
        d = delta(a, b, 1.0, bool(transposed and transposed.get(p)))
        out[key] = (state[key].to(torch.float64) + d).to(state[key].dtype)
    return out


def merged_update(
    reference: Mapping[str, torch.Tensor],
    factors: Mapping[str, torch.Tensor],
    paths: Sequence[str],
    scaling: float,
    transposed: Mapping[str, bool] | None = None,
) -> dict[str, torch.Tensor]:
    """The target weights one device's adapters amount to: ``W + s B @ A`` per target
    module, keyed ``"<path>.weight"`` (the model's keys; the reply as a ``part``-like
    update of those keys)."""
    out: dict[str, torch.Tensor] = {}
    for p in paths:
        ka, kb = factor_keys(p)
        key = f"{p}.weight"
        ref = reference[key]
        d = delta(
            factors[ka], factors[kb], scaling, bool(transposed and transposed.get(p))
        )
        out[key] = (ref.to(torch.float64) + d).to(ref.dtype)
    return out


def check_factors(
    factors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise ``ValueError`` unless ``factors`` holds exactly the keys of ``shapes``,
    with those shapes, floating and finite."""
    missing = sorted(set(shapes) - set(factors))
    extra = sorted(set(factors) - set(shapes))
    if missing or extra:
        raise ValueError(
            f"adapter keys differ: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for k, shape in shapes.items():
        v = factors[k]
        if tuple(v.shape) != tuple(shape):
            raise ValueError(f"{k}: shape {tuple(v.shape)} != {tuple(shape)}")
        if not v.is_floating_point():
            raise ValueError(f"{k}: dtype {v.dtype} is not floating")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{k}: contains NaN or Inf")


__all__ = [
    "AdapterReply",
    "check_factors",
    "delta",
    "merge",
    "merged_update",
    "stack",
]
