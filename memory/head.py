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

The loss is the model's own, and this is checked, not assumed: the chunked loss is
the cross entropy of the head's output (mean over the labels that count, shifted by
one token for a causal LM, ``-100`` ignored), so it is the model's loss only where the
model's forward returns the head's output unchanged as its logits and its loss is
that cross entropy alone. Every forward through an installed head checks the first
(the model's ``logits`` must be the very tensor the head returned: a soft-cap, a
logits bias or a scale applied after the head is refused whatever its value) and
that the model computed no auxiliary loss (a mixture-of-experts router's ``aux_loss``,
which its own loss would add); ``own_loss_refusal`` checks both, and the loss itself,
against the model's own forward on one example before a plan may chunk.

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
    _is_fake,
    causal_lm_targets,
    chunked_linear_cross_entropy,
)
from memory.declared_loss import LogitsCrossEntropy
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
        declared: the user's declared loss (``memory.declared_loss``): the targets
            are the step's ``targets`` (not ``labels`` in the inputs), and the loss
            is its cross entropy; None: the model's own loss from ``labels``.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str,
        chunks: int,
        causal: bool,
        declared: LogitsCrossEntropy | None = None,
    ) -> None:
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
        self.declared = declared
        self.ignore_index = IGNORE_INDEX if declared is None else declared.ignore_index
        self.vocab_chunks = vocab_blocks(head.weight)
        self.weight_rows: Callable[[torch.Tensor], WeightRows | None] | None = None
        """Where a streamed weight's rows come from (``memory.streaming``); None:
        the weight is in memory."""
        self._targets: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._returned: torch.Tensor | None = None
        self._calls = 0  # forward calls through the head since ``prepare``
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

    @classmethod
    def for_loss(
        cls, model: nn.Module, chunks: int, loss_fn: Any
    ) -> ChunkedHead | None:
        """The head that computes ``loss_fn`` in chunks: the model's own head for its
        own loss (``loss_fn`` None, ``find``), the declared loss's head (its ``head``
        must be found first: ``declared_head``), None for any other ``loss_fn``."""
        if loss_fn is None:
            return cls.find(model, chunks)
        if isinstance(loss_fn, LogitsCrossEntropy) and loss_fn.head is not None:
            return cls(model, loss_fn.head, chunks, loss_fn.shift, declared=loss_fn)
        return None

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
                ignore_index=self.ignore_index,
                weight_rows=rows,
            )
            if torch._C._current_graph_task_id() == -1:  # not a rerun in backward
                self._loss = loss if self._loss is None else self._loss + loss
                self._calls += 1
            shape = (*hidden.shape[:-1], head.out_features)
            out = hidden.new_zeros(()).expand(shape)
            self._returned = out
            return out

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
    def prepare(self, inputs: Any, targets: Any = None) -> Any:
        """The model's inputs without ``labels`` (a seq2seq model gets its
        ``decoder_input_ids`` from them); the targets are kept for the head. For a
        declared loss the inputs are the model's as they are and the targets are
        ``targets``."""
        self._calls = 0
        if self.declared is not None:
            self._targets = self.declared.targets_of(targets)
            return inputs
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
        self._returned = None
        self._calls = 0

    def check_output(self, output: Any) -> None:
        """Raise unless the model's ``output`` of a forward through the installed head
        shows that the chunked loss is its own loss: its ``logits`` are the very
        tensor the head returned (nothing applied after the head) and it computed no
        auxiliary loss.

        Raises:
            MemoryPlanError: the model transforms its logits after the head, or adds
                an auxiliary loss; plan with ``loss_chunks=1``.
        """
        why = _output_refusal(
            self.model, self.name, output, self._returned, self.declared
        )
        if why is None and self._calls > 1:
            why = (
                f"{type(self.model).__name__} calls its head {self.name!r} "
                f"{self._calls} times in one forward: each call would add a loss"
            )
        if why is not None:
            raise MemoryPlanError(f"{why}; plan with loss_chunks=1")

    def loss_of(
        self, model: nn.Module, inputs: Any, targets: Any = None
    ) -> torch.Tensor:
        """Forward of ``model`` on ``inputs`` with the loss computed in the head
        (``targets``: a declared loss's); call ``clear`` after its backward."""
        call = self.prepare(inputs, targets)
        self._loss = None
        out = call_model(model, call)
        self.check_output(out)
        del out
        loss = self._loss
        self._loss = None
        if loss is None:
            raise MemoryPlanError(
                f"the model's forward did not call its head {self.name!r}"
            )
        return loss


OWN_LOSS_RTOL = 1e-4
"""Relative tolerance of ``own_loss_refusal``'s comparison of the chunked loss with
the model's own (the chunked sums run in another order: float32 rounding, about
1e-7 relative; a transform or a different loss differs by far more)."""


def _first(value: Any) -> Any:
    """``output.logits`` / ``output["logits"]`` / ``output[0]``, or None."""
    logits = getattr(value, "logits", None)
    if logits is None and isinstance(value, dict):
        logits = value.get("logits")
    return logits


def _output_refusal(
    model: nn.Module,
    head: str,
    output: Any,
    returned: torch.Tensor | None,
    declared: LogitsCrossEntropy | None = None,
) -> str | None:
    name = type(model).__name__
    if returned is None:
        return f"the forward of {name} did not call its head {head!r}"
    if declared is not None:
        try:
            logits = declared.logits_of(output)
        except MemoryPlanError as e:
            return str(e)
        if logits is not returned:
            return (
                f"{name} changes its logits after its head {head!r} (or they are not "
                "that head's output): a chunked loss would train the raw head's cross "
                "entropy, not LogitsCrossEntropy of the model's logits"
            )
        return None
    logits = _first(output)
    if logits is None:
        return (
            f"{name}'s output ({type(output).__name__}) has no logits to check the "
            "chunked loss against"
        )
    if logits is not returned:
        return (
            f"{name} changes its logits after its head {head!r} (a soft-cap, a bias, a "
            "scale): a chunked loss would train the raw head's cross entropy, not the "
            "model's loss"
        )
    for key in ("aux_loss", "router_aux_loss", "z_loss"):
        extra = getattr(output, key, None)
        if extra is None and isinstance(output, dict):
            extra = output.get(key)
        if isinstance(extra, torch.Tensor):
            return (
                f"{name} computes an auxiliary loss ({key}) that its own loss adds: a "
                "chunked loss would drop it"
            )
    return None


def own_loss_refusal(
    model: nn.Module, inputs: Any, *, rtol: float = OWN_LOSS_RTOL
) -> str | None:
    """Why a chunked head would not train ``model``'s own loss on ``inputs`` (a dict
    with ``labels``), or None when it does.

    Runs the model twice on the batch's first example, without gradients, from the
    same random state (dropout draws alike): once as it is, for its own loss with
    ``labels``, once through the installed chunked head; the second must return the
    head's output unchanged as its logits, compute no auxiliary loss, and give the
    same loss within ``rtol``. Buffers the forwards update (running statistics) are
    put back; the parameters are only read.
    """
    from memory.batch import batch_layout, first_items, loss_of

    name = type(model).__name__
    if not isinstance(inputs, dict) or "labels" not in inputs:
        return "the inputs have no labels (a chunked head computes the model's loss)"
    head = ChunkedHead.find(model, 2)
    if head is None:
        return f"{name} has no linear output layer (get_output_embeddings)"
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta or _is_fake(t) for t in tensors):
        return f"{name}'s weights are not in memory here: its loss cannot be compared"
    extra = _head_extra(head.head)
    if extra is not None:
        return extra
    one, _ = first_items(inputs, None, 1, batch_layout(model))
    saved = {k: b.clone() for k, b in model.named_buffers()}
    device = next((t.device for t in tensors), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []
    seen: list[torch.Tensor] = []  # the head's input in each run

    def grab(_m: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            seen.append(args[0].detach().clone())

    hook = head.head.register_forward_pre_hook(grab)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            own = loss_of(call_model(model, one), None, None).detach().float()
            torch.manual_seed(0)
            with head:
                call = head.prepare(one)
                head._loss = None
                out = call_model(model, call)
                why = _output_refusal(model, head.name, out, head._returned)
                got = head._loss
                del out
                head.clear()
    except Exception as e:  # the model's own forward failed on one example
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"{name}'s loss on one example could not be compared: {first_line}"
    finally:
        hook.remove()
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    if why is not None:
        return why
    if len(seen) == 2 and not _same(seen[0], seen[1]):
        # the loss of a random model hardly depends on its inputs: the head's
        # input must be the same too (a decoder fed other tokens without labels)
        return (
            f"{name}'s head {head.name!r} gets another input through the chunked "
            "head (the model builds its decoder inputs from labels another way)"
        )
    if got is None:
        return f"the forward of {name} did not call its head {head.name!r}"
    got = got.detach().float()
    if not torch.isfinite(own) or not torch.isclose(got, own, rtol=rtol, atol=0.0):
        return (
            f"{name}'s own loss on one example is {float(own):.6g}, the chunked head's "
            f"{float(got):.6g}: its loss is not the head's plain cross entropy"
        )
    return None


def _head_extra(head: nn.Module) -> str | None:
    """Why ``head`` is not a plain ``nn.Linear`` that the chunked loss can compute
    from its weight and bias, or None: a subclass with a forward of its own or
    parameters besides them (a learnable logit scale) is refused."""
    own = {n for n, _ in head.named_parameters()}
    if type(head).forward is not nn.Linear.forward or not own <= {"weight", "bias"}:
        return (
            f"the head {type(head).__name__} is not a plain Linear (parameters "
            f"{sorted(own)}): the chunked loss would drop what its forward adds"
        )
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not a.numel():
        return True
    return bool((a - b).abs().max() <= 1e-4 * max(float(a.abs().max()), 1e-6))


def declared_head(
    model: nn.Module, inputs: Any, loss_fn: LogitsCrossEntropy
) -> tuple[str | None, str | None]:
    """The module path of the ``nn.Linear`` whose output ``model`` returns as the
    logits of the declared loss, or None and why there is none.

    Runs the model once on the batch's first example, without gradients (buffers put
    back, the random state kept), with a hook on every ``nn.Linear``: the head is the
    one whose output is the logits by identity (a transform after it, such as a scale
    or a soft-cap, leaves no such Linear), called once; the head ``loss_fn.head``
    names, where given, must be it. A model built without its weights
    (``memory.materialize.params_on_meta``) runs as a fake copy (no memory)."""
    import contextlib

    from memory.batch import batch_layout, first_items, map_tensors

    name = type(model).__name__
    tensors = [*model.parameters(), *model.buffers()]
    one, _ = first_items(inputs, None, 1, batch_layout(model))
    run: nn.Module = model
    mode: Any = contextlib.nullcontext()
    if any(_is_fake(t) for t in tensors):
        if loss_fn.head is not None:
            return loss_fn.head, None  # as declared; every forward checks it
        return None, (
            f"{name}'s weights are fake tensors here: its head cannot be found; give "
            "LogitsCrossEntropy(head=...)"
        )
    if any(t.is_meta for t in tensors):  # built without weights: a fake copy runs
        from torch._subclasses.fake_tensor import FakeTensorMode

        from memory.units import _fake_of_meta

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        run = _fake_of_meta(model, mode)
        one = map_tensors(one, mode.from_tensor)
    linears: dict[int, tuple[str, nn.Linear]] = {}
    for n, m in run.named_modules(remove_duplicate=False):
        if isinstance(m, nn.Linear):
            linears.setdefault(id(m), (n, m))
    calls: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for key, (_, m) in linears.items():

        def hook(_m: nn.Module, _a: Any, out: Any, _k: int = key) -> None:
            calls.setdefault(_k, []).append(out)

        hooks.append(m.register_forward_hook(hook))
    saved = {k: b.clone() for k, b in run.named_buffers()}
    device = next((t.device for t in tensors), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), mode:
            out = call_model(run, one)
            logits = loss_fn.logits_of(out)
            hits = [k for k, outs in calls.items() if any(o is logits for o in outs)]
            counts = {k: len(outs) for k, outs in calls.items()}
            del out, logits
    except MemoryPlanError as e:
        return None, str(e)
    except Exception as e:  # the model's forward failed on one example
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None, f"{name}'s forward on one example failed: {first_line}"
    finally:
        calls.clear()
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for k, b in run.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    if not hits:
        return None, (
            f"{name}'s logits are not the output of a nn.Linear head (a transform "
            "after the head, or no Linear head): LogitsCrossEntropy cannot be chunked"
        )
    head_name, head = linears[hits[0]]
    if counts[hits[0]] != 1:
        return None, (
            f"{name} calls its head {head_name!r} {counts[hits[0]]} times in one "
            "forward: a chunked loss would add a loss for each"
        )
    if loss_fn.head is not None:
        named = dict(run.named_modules(remove_duplicate=False)).get(loss_fn.head)
        if named is not head:
            return None, (
                f"LogitsCrossEntropy names head {loss_fn.head!r}, but {name}'s logits "
                f"are the output of {head_name!r}"
            )
        return loss_fn.head, None
    return head_name, None


def declared_loss_refusal(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: LogitsCrossEntropy,
    *,
    rtol: float = OWN_LOSS_RTOL,
) -> tuple[LogitsCrossEntropy, str | None]:
    """The declared loss with its head found (``declared_head``), and why a chunked
    head would not compute it on ``(inputs, targets)`` (None: it does).

    As ``own_loss_refusal`` does, runs the model twice more on the batch's first
    example, without gradients, from the same random state: once as it is, for
    ``loss_fn``'s loss, once through the head installed as a chunked head, which must
    return the head's output unchanged as the logits and give the same loss within
    ``rtol``."""
    from memory.batch import batch_layout, first_items

    name = type(model).__name__
    head_name, why = declared_head(model, inputs, loss_fn)
    if head_name is None:
        return loss_fn, why
    found = loss_fn.with_head(head_name)
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta or _is_fake(t) for t in tensors):
        why = f"{name}'s weights are not in memory here: its loss cannot be compared"
        return found, why
    one, y1 = first_items(inputs, targets, 1, batch_layout(model))
    saved = {k: b.clone() for k, b in model.named_buffers()}
    device = next((t.device for t in tensors), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []
    head = ChunkedHead.for_loss(model, 2, found)
    assert head is not None
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            own = found(call_model(model, one), y1).detach().float()
            torch.manual_seed(0)
            with head:
                call = head.prepare(one, y1)
                head._loss = None
                out = call_model(model, call)
                try:
                    head.check_output(out)
                finally:
                    got = head._loss
                    del out
                    head.clear()
    except MemoryPlanError as e:
        return found, str(e).removesuffix("; plan with loss_chunks=1")
    except Exception as e:  # the model's forward or the loss failed on one example
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (
            found,
            f"{name}'s loss on one example could not be compared: {first_line}",
        )
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    if got is None:
        return found, f"the forward of {name} did not call its head {head_name!r}"
    got = got.detach().float()
    if not torch.isfinite(own) or not torch.isclose(got, own, rtol=rtol, atol=0.0):
        return found, (
            f"{name}'s LogitsCrossEntropy on one example is {float(own):.6g}, the "
            f"chunked head's {float(got):.6g}"
        )
    return found, None
