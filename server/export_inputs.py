"""The graph inputs of an ``any_model`` workload's export, and its metrics from logits.

A ``module:function`` workload may give a dict of tensors (``model(**inputs)``, a
transformers model, often with ``labels`` inside), a tuple (``model(*inputs)``) or one
tensor, and train on the model's own ``output.loss``. ``server.export`` exports such a
model through ``LogitsModel``: ``forward(*tensors)`` puts the tensors back in their
dict keys or tuple positions, calls the model (``use_cache=False``,
``return_dict=True`` where its config has them: no KV cache in the graph) and returns
its ``logits``. ``ModelInputs`` says which tensors those are and what they are named:
the dict keys (``inputs.0``, ... for a tuple; ``inputs`` for one tensor), without
``labels`` and None values.

``LogitsMetrics`` computes, from logits alone (ONNX Runtime's), the loss and accuracy
``workloads.node_data.evaluate_batches`` computes in torch, where that is clearly
defined: the workload's ``loss_fn`` of a model whose output is its logits, or for the
model's own loss cross-entropy over its labels (-100 ignored; shifted by one token for
a causal LM); otherwise it says why not.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workloads.node_data import batch_size_of

INPUT_NAME = "inputs"  # a tensor input; ``inputs.<i>`` for the items of a tuple
TRAINING_ONLY_KEYS = ("labels",)  # dict inputs that feed only the loss: not exported
CALL_FLAGS = {"use_cache": False, "return_dict": True}  # no KV cache in the graph
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # labels shifted by one token
IGNORE_INDEX = -100  # labels the loss skips (torch's and transformers' convention)


@dataclass(frozen=True)
class ModelInputs:
    """Which tensors of a batch's inputs the graph takes, and how the model gets them.

    Attributes:
        layout: ``tensor``, ``dict`` (``model(**inputs)``) or ``tuple``
            (``model(*inputs)``).
        names: the graph's input names, one per tensor.
        slots: where each tensor goes: its dict key or tuple position.
        constants: the other (non-tensor, non-None) values, passed as they are.
        length: the tuple's length (``tuple`` only).
    """

    layout: str
    names: tuple[str, ...]
    slots: tuple[str | int, ...]
    constants: tuple[tuple[str | int, Any], ...] = ()
    length: int = 1

    @classmethod
    def of(cls, inputs: Any) -> ModelInputs:
        """The layout of a workload's example inputs.

        Raises:
            ValueError: not a tensor, tuple or dict of tensors (nested containers
                included), or no tensor in it.
        """
        if isinstance(inputs, torch.Tensor):
            return cls("tensor", (INPUT_NAME,), (0,))
        items: list[tuple[str | int, Any]]
        if isinstance(inputs, dict):
            items = [
                (k, v)
                for k, v in inputs.items()
                if k not in TRAINING_ONLY_KEYS and v is not None
            ]
            layout = "dict"
        elif isinstance(inputs, tuple | list):
            items = list(enumerate(inputs))
            layout = "tuple"
        else:
            raise ValueError(f"its inputs are a {type(inputs).__name__}")
        for k, v in items:
            if isinstance(v, dict | tuple | list):
                raise ValueError(
                    f"input {k!r} is a {type(v).__name__}: export takes a tensor, a "
                    "tuple of tensors or a dict of tensors"
                )
        slots = tuple(k for k, v in items if isinstance(v, torch.Tensor))
        if not slots:
            raise ValueError("its inputs hold no tensor besides the labels")
        names = tuple(
            str(k) if layout == "dict" else f"{INPUT_NAME}.{k}" for k in slots
        )
        constants = tuple((k, v) for k, v in items if not isinstance(v, torch.Tensor))
        return cls(layout, names, slots, constants, len(inputs))

    def tensors(self, inputs: Any) -> tuple[torch.Tensor, ...]:
        """The graph's tensors of ``inputs`` (the example, or a held-out batch).

        Raises:
            ValueError: ``inputs`` lacks one of them.
        """
        if self.layout == "tensor":
            got: tuple[Any, ...] = (inputs,)
        else:
            try:
                got = tuple(inputs[k] for k in self.slots)
            except (KeyError, IndexError, TypeError):
                got = ()
        if len(got) != len(self.slots) or not all(
            isinstance(t, torch.Tensor) for t in got
        ):
            raise ValueError(
                f"a batch does not hold the exported inputs {', '.join(self.names)}"
            )
        return got

    def call(
        self, model: nn.Module, tensors: Sequence[torch.Tensor], **flags: Any
    ) -> Any:
        """``model`` called as the workload calls it, ``tensors`` in their slots."""
        if self.layout == "tensor":
            return model(tensors[0], **flags)
        placed = [*self.constants, *zip(self.slots, tensors, strict=True)]
        if self.layout == "dict":
            return model(**{str(k): v for k, v in placed}, **flags)
        args: list[Any] = [None] * self.length
        for k, v in placed:
            args[int(k)] = v
        return model(*args, **flags)


def call_flags(model: nn.Module) -> dict[str, Any]:
    """``CALL_FLAGS`` the model's config has and its ``forward`` takes."""
    config = getattr(model, "config", None)
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {
        k: v
        for k, v in CALL_FLAGS.items()
        if hasattr(config, k) and (k in params or takes_any)
    }


def logits_of(out: Any) -> torch.Tensor:
    """An output object's ``logits``, or the output itself when it is a tensor.

    Raises:
        ValueError: neither.
    """
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"its output ({type(out).__name__}) is neither a tensor nor has logits"
        )
    return logits


class LogitsModel(nn.Module):
    """What is exported: ``forward(*tensors)`` calls ``model`` with the tensors in
    their slots (and ``call_flags``) and returns its logits."""

    def __init__(self, model: nn.Module, spec: ModelInputs) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.flags = call_flags(model)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return logits_of(self.spec.call(self.model, tensors, **self.flags))


def batch_rows(
    tensors: Sequence[torch.Tensor], batch: int, n: int
) -> tuple[torch.Tensor, ...]:
    """``n`` examples made from the ``batch`` given: rows sliced, or repeated then
    sliced, of every tensor whose first axis is the batch."""
    out = []
    for t in tensors:
        if t.dim() and t.shape[0] == batch:
            t = t.repeat(-(-n // batch), *([1] * (t.dim() - 1)))[:n]
        out.append(t.contiguous())
    return tuple(out)


def is_tokens(t: torch.Tensor) -> bool:
    """2-D integers (token ids, attention masks) long enough for a symbolic length
    (``torch.export`` specialises sizes 0 and 1)."""
    return (
        t.dim() == 2
        and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        and t.shape[1] >= 2
    )


def dynamic_shapes(
    tensors: Sequence[torch.Tensor], batch: int, *, seq: bool
) -> tuple[dict[int, Any], ...]:
    """Per tensor, its dynamic axes: the batch where the first axis is the batch and,
    with ``seq``, the length of token tensors (one ``seq`` dimension per length)."""
    batch_dim = torch.export.Dim("batch", min=1, max=1 << 20)
    seq_dims: dict[int, Any] = {}
    shapes = []
    for t in tensors:
        axes: dict[int, Any] = {}
        if t.dim() and t.shape[0] == batch:
            axes[0] = batch_dim
            if seq and is_tokens(t):
                name = f"seq_{len(seq_dims)}" if seq_dims else "seq"
                if int(t.shape[1]) not in seq_dims:
                    seq_dims[int(t.shape[1])] = torch.export.Dim(name, min=1)
                axes[1] = seq_dims[int(t.shape[1])]
        shapes.append(axes)
    return tuple(shapes)


def _labels(inputs: Any, targets: Any, own_loss: bool) -> torch.Tensor | None:
    """What the loss compares the logits with: the model's ``labels`` input for its
    own loss, else the targets (or, without them, the ``labels`` input)."""
    given = inputs.get("labels") if isinstance(inputs, dict) else None
    if not own_loss and isinstance(targets, torch.Tensor):
        return targets
    return given if isinstance(given, torch.Tensor) else None


class LogitsMetrics:
    """Loss, accuracy (and perplexity for per-token labels) accumulated from logits,
    counted as ``workloads.node_data.evaluate_batches`` counts them.

    Args:
        model: the torch model (its class says whether it is a causal LM; its config
            whether its own loss is a classification's).
        loss_fn: the workload's loss function, or None for the model's own loss.
        output_is_logits: the torch model returns its logits as a tensor (only then
            can ``loss_fn`` take the graph's logits).
    """

    def __init__(
        self, model: nn.Module, loss_fn: Callable | None, output_is_logits: bool
    ) -> None:
        self.causal = type(model).__name__.endswith(CAUSAL_SUFFIXES)
        self.loss_fn = loss_fn
        self.problem_type = getattr(
            getattr(model, "config", None), "problem_type", None
        )
        self.output_is_logits = output_is_logits
        self.total = 0.0
        self.count = self.correct = self.scored = 0
        self.token_level = False

    def add(self, logits: torch.Tensor, inputs: Any, targets: Any) -> None:
        """One batch's logits (from the graph) against its labels.

        Raises:
            ValueError: the loss is not clearly defined from logits (the reason).
        """
        own = self.loss_fn is None
        labels = _labels(inputs, targets, own)
        n = batch_size_of(inputs)
        shifted = logits
        if labels is not None and labels.dim() >= 2:
            self.token_level = True
            if self.causal:
                labels = labels[:, 1:]
                shifted = logits[:, :-1] if logits.dim() >= 3 else logits
            n = int((labels != IGNORE_INDEX).sum())
        if own:
            self.total += self._own_loss_sum(shifted, labels)
        else:
            if not self.output_is_logits:
                raise ValueError(
                    "the workload's loss_fn takes the model's output object, and the "
                    "graph gives its logits only"
                )
            assert self.loss_fn is not None
            self.total += float(self.loss_fn(logits, targets)) * n
        self.count += n
        if labels is not None and shifted.shape[:-1] == labels.shape:
            keep = labels != IGNORE_INDEX
            self.correct += int((shifted.argmax(-1)[keep] == labels[keep]).sum())
            self.scored += int(keep.sum())

    def _own_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor | None) -> float:
        if labels is None:
            raise ValueError("the held-out batches have no labels for the model's loss")
        if labels.is_floating_point() or self.problem_type not in (
            None,
            "single_label_classification",
        ):
            kind = self.problem_type or f"{labels.dtype} labels".replace("torch.", "")
            raise ValueError(f"the model's own loss is not a cross-entropy ({kind})")
        if logits.shape[:-1] != labels.shape or logits.shape[-1] < 2:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match labels "
                f"{tuple(labels.shape)} as a cross-entropy over classes"
            )
        flat = logits.reshape(-1, logits.shape[-1]).double()
        return float(
            F.cross_entropy(
                flat, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
        )

    def result(self) -> dict[str, float]:
        loss = self.total / max(self.count, 1)
        out = {"loss": loss, "accuracy": self.correct / max(self.scored, 1)}
        if self.token_level:
            out["perplexity"] = math.exp(min(loss, 50.0))
        out["num_examples"] = float(self.count)
        return out
