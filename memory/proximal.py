"""FedProx's proximal term (Li et al. 2020), the same for every training path.

A client minimises ``loss(w) + mu / 2 * ||w - w0||^2``, ``w0`` the global model it was
sent. The term's gradient, ``mu * (w - w0)``, is added to each trained parameter's
gradient just before the optimizer step, so a plan's forward and backward (recompute,
offload, micro-batches, chunked loss) are untouched and the step equals plain
autograd on the regularised loss. Added once per update, after the micro-batches'
gradients are summed, it is not counted once per micro-batch.

``w0`` is a copy of the trained parameters as the step starts: it sits where they do,
at 4 bytes per fp32 parameter, for the whole step. The memory model counts it:
``anchored(profile)`` is the profile a planner prices when ``proximal_mu > 0`` (the
trained blocks' parameter bytes held through the step, no streaming). Parameters
streamed from disk are updated block by block inside the store, where no anchor is
kept: ``proximal_mu > 0`` with a streaming plan is refused (``ProximalTerm.refuse``),
and ``anchored`` never offers one.
A parameter without a gradient is left alone: AdamW does not step it, so it is still
``w0`` and its proximal gradient is zero.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from memory.cost import CHAIN_OPTIONS, STREAM
from memory.profile import Profile


class ProximalTerm:
    """``mu * (w - w0)`` added to the gradients of ``params`` (those that require
    one); ``mu`` 0 holds no copy and does nothing."""

    def __init__(self, params: Iterable[torch.Tensor], mu: float) -> None:
        if not mu >= 0:
            raise ValueError(f"proximal mu={mu!r} must be a number >= 0")
        self.mu = mu
        self.anchors: list[tuple[torch.Tensor, torch.Tensor]] = (
            [(p, p.detach().clone()) for p in params if p.requires_grad]
            if mu > 0
            else []
        )

    @torch.no_grad()
    def add_to_grads(self) -> None:
        """Add the term's gradient to every anchored parameter that has one."""
        for p, w0 in self.anchors:
            if p.grad is not None:
                p.grad.add_(p.detach() - w0, alpha=self.mu)

    @staticmethod
    def refuse(mu: float, streamed: Iterable[object], where: str) -> None:
        """``ValueError`` for ``mu > 0`` with any streamed block in ``streamed``."""
        names = list(streamed)
        if mu > 0 and names:
            raise ValueError(
                f"proximal-mu={mu:g} cannot be applied to parameters streamed from "
                f"disk ({where}: blocks {names[:5]}); give this node a budget that "
                "keeps its parameters in memory, or set proximal-mu=0"
            )


def anchor_bytes(profile: Profile) -> int:
    """Bytes of ``w0``: the parameters of the blocks that train (those with gradient
    bytes; a part profile's frozen blocks have none), each shared one once."""
    return sum(b.param_bytes for b in profile.blocks if b.grad_bytes > 0)


def anchored(profile: Profile, mu: float) -> Profile:
    """``profile`` as the planner must price it under FedProx's term ``mu``: the
    anchor ``w0`` held through the step (added to the bytes alive the whole step,
    ``batch_bytes``) and no block streamed. ``mu`` 0: ``profile`` itself."""
    if not mu > 0:
        return profile
    blocks = tuple(
        replace(b, options=tuple(o for o in b.options or CHAIN_OPTIONS if o != STREAM))
        for b in profile.blocks
    )
    return replace(
        profile,
        blocks=blocks,
        batch_bytes=profile.batch_bytes + anchor_bytes(profile),
    )
