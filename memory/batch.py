"""Batches as users write them: tensors, tuples or dicts of tensors, with or without targets.

The workload contract: the model is called as ``model(**inputs)`` (a dict),
``model(*inputs)`` (a tuple or list) or ``model(inputs)`` (anything else,
``memory.units.call_model``); the loss is ``loss_fn(output, targets)``, or the model's
own ``output.loss`` when no ``loss_fn`` is given (transformers models given ``labels``).

Micro-batching splits every tensor whose first dimension is the batch into equal
parts (other values, such as a shared position table, go to every part) and weights
each part's loss by its share of the items that count (``count_items``): for a mean
over tokens with padding or masking, a part's mean is not the batch mean, but the
weighted sum of the parts' means is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memory.errors import MemoryPlanError

IGNORE_INDEX = -100  # torch's and transformers' label that does not count


def tensors_of(x: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (dicts, tuples, lists, dataclass outputs)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_of(v)]
    if isinstance(x, tuple | list):
        return [t for v in x for t in tensors_of(v)]
    return []


def map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with ``fn`` applied to every tensor in it, the structure kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)({k: map_tensors(v, fn) for k, v in x.items()})
    if isinstance(x, tuple):
        items = [map_tensors(v, fn) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [map_tensors(v, fn) for v in x]
    return x


def batch_size_of(inputs: Any) -> int:
    """The batch size: the first dimension of the first tensor of the inputs."""
    for t in tensors_of(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    raise MemoryPlanError(
        "the inputs hold no tensor with a batch dimension; give tensors whose first "
        "dimension is the batch"
    )


def short_batch_microbatches(m: int, *, planned: int, actual: int) -> int:
    """Micro-batches for batches of ``actual`` examples under a plan that cuts
    ``planned``-example batches into ``m``.

    A client with fewer items than a batch trains short batches (all of one size),
    which need not split into the plan's ``m`` equal micro-batches; the smallest
    divisor ``k`` of ``actual`` with ``actual / k <= planned // m`` (at worst ``actual``
    micro-batches of one example) gives equal micro-batches no larger than the plan's,
    so its memory bound holds. ``planned`` is the largest batch of the round (the
    plan's batch or less, which only makes the bound safer).
    """
    if m <= 1 or actual % m == 0:
        return m
    per = max(1, planned // m)
    for k in range(1, actual + 1):
        if actual % k == 0 and actual // k <= per:
            return k
    return actual


def split_batch(inputs: Any, targets: Any, parts: int) -> list[tuple[Any, Any]]:
    """``parts`` equal micro-batches of ``(inputs, targets)`` along the batch dimension.

    Raises:
        MemoryPlanError: the batch does not divide into ``parts``.
    """
    if parts == 1:
        return [(inputs, targets)]
    n = batch_size_of(inputs)
    if n % parts:
        raise MemoryPlanError(
            f"a batch of {n} does not split into {parts} equal micro-batches; plan "
            "for this batch size"
        )
    size = n // parts

    def piece(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.dim() > 0 and t.shape[0] == n:
                return t[j * size : (j + 1) * size]
            return t

        return cut

    return [
        (map_tensors(inputs, piece(j)), map_tensors(targets, piece(j)))
        for j in range(parts)
    ]


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM: its loss shifts the labels by one token."""
    loss_type = getattr(model, "loss_type", None)
    if isinstance(loss_type, str):
        return loss_type == "ForCausalLM"
    name = type(model).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


def count_items(model: nn.Module, inputs: Any, targets: Any) -> int:
    """The items a mean loss averages over: labels that count, or examples.

    ``labels`` (in a dict of inputs) count where they are not ``-100``, after the
    one-token shift of a causal LM; integer targets with more than one dimension count
    the same way; anything else counts examples.
    """
    labels = inputs.get("labels") if isinstance(inputs, dict) else None
    if labels is None and isinstance(targets, torch.Tensor) and targets.dim() > 1:
        if not targets.is_floating_point():
            labels = targets
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        if labels.dim() > 1 and is_causal_lm(model) and targets is None:
            labels = labels[..., 1:]
        return int((labels != IGNORE_INDEX).sum())
    return batch_size_of(inputs)


def loss_of(output: Any, targets: Any, loss_fn: Callable | None) -> torch.Tensor:
    """``loss_fn(output, targets)``, or the model's own ``output.loss``.

    Raises:
        MemoryPlanError: no ``loss_fn`` and an output without a loss.
    """
    if loss_fn is not None:
        return loss_fn(output, targets)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise MemoryPlanError(
            f"the model's output ({type(output).__name__}) has no loss; give the "
            "inputs labels (transformers models compute their loss from them) or give "
            "a loss_fn(output, targets)"
        )
    return loss
