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

A model says what its batch is where that rule does not hold, with a class (or
instance) attribute ``batch_inputs`` (``batch_layout``):

- ``batch_inputs = ()``: nothing is batch-shaped; the batch is one whole (a graph's
  node features and edge index, a set): it is never cut, by micro-batches or by the
  probes that run on a slice, and counts as a batch of one;
- ``batch_inputs = ("x", "labels")`` (dict keys) or ``(0,)`` (positions of a tuple):
  only these inputs are cut, along their first dimension (the batch size is the first
  one's); targets are cut where their first dimension is that size.

Example:
    >>> class GraphNet(nn.Module):  # doctest: +SKIP
    ...     batch_inputs = ()  # one graph: never split
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


Layout = tuple[str | int, ...] | None
"""What a model's ``batch_inputs`` says: None (every tensor whose first dimension is
the batch), ``()`` (a whole batch, never cut) or the batch-shaped inputs' keys."""


def batch_layout(model: nn.Module | None) -> Layout:
    """The model's ``batch_inputs`` (see the module docstring); None without one.

    Raises:
        MemoryPlanError: ``batch_inputs`` is not a tuple or list of input names or
            positions.
    """
    value = getattr(model, "batch_inputs", None) if model is not None else None
    if value is None:
        return None
    if not isinstance(value, tuple | list) or not all(
        isinstance(k, str | int) and not isinstance(k, bool) for k in value
    ):
        raise MemoryPlanError(
            f"{type(model).__name__}.batch_inputs is {value!r}; give a tuple of the "
            "batch-shaped inputs' names or positions, or () for a batch that must "
            "never be cut"
        )
    return tuple(value)


def _chosen(inputs: Any, layout: Layout) -> list[torch.Tensor]:
    """The batch-shaped tensors of ``inputs`` under ``layout`` (not ``()``)."""
    if layout is None:
        return tensors_of(inputs)
    out: list[torch.Tensor] = []
    for key in layout:
        try:
            value = inputs[key]
        except (KeyError, IndexError, TypeError):
            raise MemoryPlanError(
                f"batch_inputs names {key!r}, which the inputs "
                f"({type(inputs).__name__}) do not have; name dict keys or tuple "
                "positions"
            ) from None
        out += tensors_of(value)
    return out


def batch_size_of(inputs: Any, layout: Layout = None) -> int:
    """The batch size: the first dimension of the first (batch-shaped) tensor of the
    inputs; 1 for a whole batch (``layout`` ``()``)."""
    if layout == ():
        return 1
    for t in _chosen(inputs, layout):
        if t.dim() > 0:
            return int(t.shape[0])
    raise MemoryPlanError(
        "the inputs hold no tensor with a batch dimension; give tensors whose first "
        "dimension is the batch (or set the model's batch_inputs = () for a batch "
        "that must never be cut)"
    )


def first_items(inputs: Any, targets: Any, k: int, layout: Layout = None) -> tuple:
    """``(inputs, targets)`` cut to their first ``k`` items (a probe's slice): the
    whole batch where it must not be cut."""
    if layout == ():
        return inputs, targets
    n = batch_size_of(inputs, layout)
    if k >= n:
        return inputs, targets
    return _cut(inputs, targets, n, layout, lambda t: t[:k])


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


def _cut(
    inputs: Any,
    targets: Any,
    n: int,
    layout: Layout,
    cut: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[Any, Any]:
    def batchy(t: torch.Tensor) -> torch.Tensor:
        return cut(t) if t.dim() > 0 and t.shape[0] == n else t

    if layout is None:
        x = map_tensors(inputs, batchy)
    elif isinstance(inputs, dict):
        x = {k: map_tensors(v, batchy) if k in layout else v for k, v in inputs.items()}
    elif isinstance(inputs, tuple | list):
        items = [
            map_tensors(v, batchy) if i in layout else v for i, v in enumerate(inputs)
        ]
        x = type(inputs)(items) if isinstance(inputs, list) else tuple(items)
    else:
        x = map_tensors(inputs, batchy)
    return x, map_tensors(targets, batchy)


def split_batch(
    inputs: Any, targets: Any, parts: int, layout: Layout = None
) -> list[tuple[Any, Any]]:
    """``parts`` equal micro-batches of ``(inputs, targets)`` along the batch dimension
    (of the batch-shaped inputs, ``layout``).

    Raises:
        MemoryPlanError: the batch does not divide into ``parts``, or must not be cut.
    """
    if parts == 1:
        return [(inputs, targets)]
    if layout == ():
        raise MemoryPlanError(
            f"the model's batch must not be cut (batch_inputs = ()), but the plan has "
            f"{parts} micro-batches; plan with num_microbatches=1"
        )
    n = batch_size_of(inputs, layout)
    if n % parts:
        raise MemoryPlanError(
            f"a batch of {n} does not split into {parts} equal micro-batches; plan "
            "for this batch size"
        )
    size = n // parts

    def piece(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[j * size : (j + 1) * size]

        return cut

    return [_cut(inputs, targets, n, layout, piece(j)) for j in range(parts)]


def batch_dependent_layer(
    model: nn.Module, *, training_only: bool = False
) -> str | None:
    """The first layer whose step depends on the whole batch, or on how many forwards
    a step runs, in words (``"BatchNorm2d 'layers.0' normalises over the batch"``);
    None without one.

    Micro-batches change what these layers compute, so a plan with micro-batches
    trains a different model than whole batches do:

    - ``BatchNorm`` (any, ``SyncBatchNorm`` and the lazy ones included): it normalises
      with the statistics of the batch it sees, a micro-batch's;
    - ``InstanceNorm`` with ``track_running_stats``: its running statistics move once
      per forward, so once per micro-batch;
    - ``spectral_norm`` (the parametrization or the older hook): each forward in
      training mode advances its power iteration, once per micro-batch, and the next
      forward reads the result.

    ``training_only``: only layers in training mode count (in eval mode they read
    fixed statistics and iterate nothing).
    """
    from torch.nn.utils.parametrizations import _SpectralNorm
    from torch.nn.utils.spectral_norm import SpectralNorm

    for name, m in model.named_modules():
        if training_only and not m.training:
            continue
        what = type(m).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return f"{what} {name!r} normalises over the batch"
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and (
            m.track_running_stats
        ):
            return f"{what} {name!r} updates its running statistics every forward"
        if isinstance(m, _SpectralNorm) or any(
            isinstance(h, SpectralNorm) for h in m._forward_pre_hooks.values()
        ):
            return (
                f"spectral_norm at {name!r} advances its power iteration every forward"
            )
    return None


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
    return batch_size_of(inputs, batch_layout(model))


def loss_count(
    model: nn.Module, loss_fn: Callable | None, inputs: Any, targets: Any
) -> int:
    """The items ``loss_fn``'s mean averages over on this batch: the loss's own
    ``count(targets)`` where it declares one (``memory.LogitsCrossEntropy``: its
    targets that are not ignored, after its shift), else ``count_items``."""
    count = getattr(loss_fn, "count", None)
    if callable(count):
        return int(count(targets))
    return count_items(model, inputs, targets)


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
