"""The chunked loss head inside a transformers model: its own forward, without logits.

A model that ends in a linear layer feeding cross entropy (transformers causal and
masked LMs and seq2seq LMs, given ``labels``) computes the full logits and their loss in
its own forward. ``ChunkedHead`` moves the loss into the head unit: the model is called
without ``labels`` (a seq2seq model gets the ``decoder_input_ids`` it would have made
from them), the head's ``forward`` computes ``memory.chunked_loss``'s loss from its
input and its weight, in chunks, and hands the model an expanded zero tensor of the
logits' shape (no storage) instead of the logits. The loss is taken from the head after
the forward. Everything else of the model's forward runs unchanged; the head remains a
unit the plan can recompute or stream (a tied weight streams with its owner). The
loss runs over vocabulary blocks of at most ``HEAD_BLOCK_BYTES`` of weight; when the
head is streamed, its weight (its own, or a tied one it borrows) is read from the
store and its gradient written there a block at a time (``weight_rows``), never whole.

The loss is the model's own: mean over the labels that count, shifted by one token for
a causal LM (``causal_lm_targets``), with ``-100`` ignored.

Example:
    >>> head = ChunkedHead.find(model, chunks=8)  # doctest: +SKIP
    >>> with head:
    ...     loss = head.loss_of(model, inputs)  # inputs hold "labels"
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memory.batch import is_causal_lm
from memory.chunked_loss import (
    WeightRows,
    causal_lm_targets,
    chunked_linear_cross_entropy,
)
from memory.errors import MemoryPlanError
from memory.units import call_model

IGNORE_INDEX = -100

HEAD_BLOCK_BYTES = 8 * 2**20
"""Most bytes of the head's weight in one vocabulary block. A weight streamed from
disk is read a block at a time and its gradient written a block at a time, so one
block of weight and one of gradient are what a streamed head holds of them; a
resident head uses the same blocks, so both compute alike, bit for bit."""


def vocab_blocks(weight: torch.Tensor) -> int:
    """The vocabulary blocks of a head with this weight (``HEAD_BLOCK_BYTES`` each
    at most)."""
    nbytes = weight.numel() * weight.element_size()
    return max(1, min(weight.shape[0], math.ceil(nbytes / HEAD_BLOCK_BYTES)))


def vocab_block_bytes(weight: torch.Tensor) -> int:
    """Bytes of the largest vocabulary block of ``weight``."""
    rows = math.ceil(weight.shape[0] / vocab_blocks(weight))
    return rows * (weight.numel() // max(weight.shape[0], 1)) * weight.element_size()


class ChunkedHead:
    """A model's output linear layer computing a chunked cross entropy.

    Args:
        model: the model.
        name: the head's module path (a ``nn.Linear``).
        chunks: token chunks of the loss.
        causal: the labels are shifted by one (causal LM).
    """

    def __init__(self, model: nn.Module, name: str, chunks: int, causal: bool) -> None:
        modules = dict(model.named_modules(remove_duplicate=False))
        head = modules.get(name)
        if not isinstance(head, nn.Linear):
            raise MemoryPlanError(
                f"loss head {name!r} is not a linear layer of {type(model).__name__}"
            )
        if chunks < 1:
            raise MemoryPlanError(f"loss chunks must be at least 1, got {chunks}")
        self.model = model
        self.name = name
        self.head = head
        self.chunks = chunks
        self.causal = causal
        self.vocab_chunks = vocab_blocks(head.weight)
        self.weight_rows: Callable[[torch.Tensor], WeightRows | None] | None = None
        """Where a streamed weight's rows come from (``memory.streaming``); None:
        the weight is in memory."""
        self._targets: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._installed = False

    @classmethod
    def find(cls, model: nn.Module, chunks: int) -> ChunkedHead | None:
        """The head of a transformers LM (``get_output_embeddings()``), or None for a
        model without one."""
        get = getattr(model, "get_output_embeddings", None)
        out = get() if callable(get) else None
        if not isinstance(out, nn.Linear):
            return None
        name = next(
            (n for n, m in model.named_modules(remove_duplicate=False) if m is out),
            None,
        )
        if name is None:
            return None
        return cls(model, name, chunks, is_causal_lm(model))

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        if self._installed:
            return
        head = self.head
        own = head.__dict__.get("forward")
        self._own = own
        inner = head.forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            targets = self._targets
            if targets is None:  # not a training call: the real logits
                return inner(hidden)
            rows = None if self.weight_rows is None else self.weight_rows(head.weight)
            loss = chunked_linear_cross_entropy(
                hidden,
                head.weight,
                head.bias,
                targets,
                chunks=min(self.chunks, max(1, targets.numel())),
                vocab_chunks=self.vocab_chunks,
                weight_rows=rows,
            )
            if torch._C._current_graph_task_id() == -1:  # not a rerun in backward
                self._loss = loss if self._loss is None else self._loss + loss
            shape = (*hidden.shape[:-1], head.out_features)
            return hidden.new_zeros(()).expand(shape)

        head.forward = forward  # type: ignore[method-assign,assignment]
        self._installed = True

    def remove(self) -> None:
        if not self._installed:
            return
        if self._own is None:
            self.head.__dict__.pop("forward", None)
        else:
            self.head.forward = self._own  # type: ignore[method-assign]
        self._installed = False

    def __enter__(self) -> ChunkedHead:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ------------------------------------------------------------------ a loss
    def prepare(self, inputs: Any) -> dict:
        """The model's inputs without ``labels`` (a seq2seq model gets its
        ``decoder_input_ids`` from them); the targets are kept for the head."""
        if not isinstance(inputs, dict) or "labels" not in inputs:
            raise MemoryPlanError(
                "a chunked loss head needs the inputs as a dict with 'labels'"
            )
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        if getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            if (
                "decoder_input_ids" not in inputs
                and "decoder_inputs_embeds" not in inputs
            ):
                make = getattr(
                    self.model, "prepare_decoder_input_ids_from_labels", None
                )
                if make is None:
                    raise MemoryPlanError(
                        f"{type(self.model).__name__} cannot make decoder inputs from "
                        "labels; give decoder_input_ids"
                    )
                inputs["decoder_input_ids"] = make(labels=labels)
        if self.causal:
            self._targets = causal_lm_targets(labels, IGNORE_INDEX)
        else:
            self._targets = labels.reshape(-1)
        return inputs

    def clear(self) -> None:
        """After the backward: the head computes logits again (the targets stay until
        then, since a recomputed head reruns its forward in backward)."""
        self._targets = None
        self._loss = None

    def loss_of(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """Forward of ``model`` on ``inputs`` with the loss computed in the head;
        call ``clear`` after its backward."""
        call = self.prepare(inputs)
        self._loss = None
        out = call_model(model, call)
        del out
        loss = self._loss
        self._loss = None
        if loss is None:
            raise MemoryPlanError(
                f"the model's forward did not call its head {self.name!r}"
            )
        return loss
