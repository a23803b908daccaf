"""A declared loss: cross entropy on a model's output logits, which a plan may chunk.

A plan can compute a language model's loss in its head, chunk by chunk, without ever
holding the full logits (``memory.head.ChunkedHead``), only where it knows that the
loss is the plain cross entropy of the head's output: a user's own ``loss_fn`` is a
function the planner cannot see into, so it gets no loss chunks. ``LogitsCrossEntropy``
says what the loss is instead of leaving it to be guessed: pass it as ``loss_fn`` and
it computes exactly::

    F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=...)

(mean over the targets that are not ``ignore_index``; with ``shift`` position ``t``
predicts ``targets[..., t + 1]``, as a causal LM's loss). Plain training with it is
ordinary training. A plan with loss chunks computes the same cross entropy in the
model's output ``nn.Linear`` (the head), chunk by chunk from its input, after checking
on one example that the model's logits are that Linear's output by identity (nothing
applied after it) and that both losses agree (``memory.head.declared_loss_refusal``);
micro-batches are weighted by their counted targets (``count``).

Supported: mean reduction, an ``ignore_index``, an optional one-token shift; the logits
are the model's output tensor, its ``logits`` attribute or key, or a named key or
tuple position. Anything else (label smoothing, class weights, a sum, a transform of
the logits) is not this loss: write your own ``loss_fn`` (trained without loss chunks).

Example:
    >>> loss_fn = LogitsCrossEntropy(shift=True)  # doctest: +SKIP
    >>> planned = plan_training(gpt, ids, ids, loss_fn)  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from memory.chunked_loss import causal_lm_targets
from memory.errors import MemoryPlanError


@dataclass(frozen=True)
class LogitsCrossEntropy:
    """``loss_fn(output, targets)``: mean cross entropy of the output's logits.

    Attributes:
        ignore_index: targets with this value count for neither loss nor mean.
        shift: position ``t`` predicts ``targets[..., t + 1]`` (a causal LM given its
            own input ids as targets); the last position predicts nothing.
        logits: where the logits are in the model's output: None (the output tensor
            itself, or its ``logits`` attribute or key), a key or attribute name, or
            a tuple position.
        head: the module path of the ``nn.Linear`` whose output the logits are (None:
            found by running the model on one example, ``memory.head``).
    """

    ignore_index: int = -100
    shift: bool = False
    logits: str | int | None = None
    head: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ignore_index, int) or isinstance(
            self.ignore_index, bool
        ):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if not isinstance(self.shift, bool):
            raise ValueError(f"shift must be True or False, got {self.shift!r}")
        if self.logits is not None and (
            isinstance(self.logits, bool) or not isinstance(self.logits, str | int)
        ):
            raise ValueError(
                f"logits must be None, a key or a tuple position, got {self.logits!r}"
            )
        if self.head is not None and not isinstance(self.head, str):
            raise ValueError(f"head must be a module path or None, got {self.head!r}")

    def with_head(self, head: str) -> LogitsCrossEntropy:
        """The same loss with its head's module path."""
        return replace(self, head=head)

    def logits_of(self, output: Any) -> torch.Tensor:
        """The logits in the model's ``output``.

        Raises:
            MemoryPlanError: the output has no such tensor.
        """
        key = self.logits
        found: Any = None
        if key is None:
            if isinstance(output, torch.Tensor):
                return output
            found = getattr(output, "logits", None)
            if found is None and isinstance(output, dict):
                found = output.get("logits")
        elif isinstance(key, int):
            if isinstance(output, tuple | list) and -len(output) <= key < len(output):
                found = output[key]
        elif isinstance(output, dict):
            found = output.get(key)
        else:
            found = getattr(output, key, None)
        if not isinstance(found, torch.Tensor):
            where = "logits" if key is None else repr(key)
            raise MemoryPlanError(
                f"the model's output ({type(output).__name__}) has no {where} tensor "
                "for LogitsCrossEntropy; give logits= (a key or tuple position)"
            )
        return found

    def targets_of(self, targets: Any) -> torch.Tensor:
        """The targets row by row of the flattened logits (int64; shifted, with
        ``ignore_index`` for the last position, where ``shift``).

        Raises:
            MemoryPlanError: the targets are not an integer tensor.
        """
        if (
            not isinstance(targets, torch.Tensor)
            or targets.is_floating_point()
            or targets.is_complex()
            or targets.dtype == torch.bool
            or (self.shift and targets.dim() < 1)
        ):
            raise MemoryPlanError(
                "LogitsCrossEntropy takes integer class targets (a tensor shaped as "
                f"the logits without their last dimension), got {type(targets).__name__}"
                f" {getattr(targets, 'dtype', '')}"
            )
        if self.shift:
            return causal_lm_targets(targets, self.ignore_index)
        return targets.reshape(-1).to(torch.int64)

    def count(self, targets: Any) -> int:
        """The targets the mean is over (not ``ignore_index``): a micro-batch's weight."""
        return int((self.targets_of(targets) != self.ignore_index).sum())

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        logits = self.logits_of(output)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.targets_of(targets),
            ignore_index=self.ignore_index,
        )
