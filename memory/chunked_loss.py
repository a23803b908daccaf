"""A linear + cross-entropy loss head that never holds the full logits.

A language model's head computes ``logits = hidden @ weight.T + bias`` for every token
and then the cross entropy of those logits with the targets. For GPT-2 small (vocab
V = 50,257) and a batch of 4 x 512 tokens the logits alone are 2048 x 50,257 fp32 =
411 MB, their gradient as much again, and the loss's own softmax a third copy: the head
dominates the peak of the whole training step. ``chunked_linear_cross_entropy`` computes
the same loss and gradients one block of rows (tokens), and optionally one block of the
vocabulary, at a time, the way Liger Kernel's fused linear cross entropy and Apple's Cut
Cross-Entropy do, so only one ``rows x vocab`` block of logits exists at any moment.

Definition: with ``hidden`` (N, d) (leading dims are flattened), ``weight`` (V, d),
``bias`` (V,) or None and ``labels`` (N,) int64::

    loss = F.cross_entropy(hidden @ weight.T + bias, labels,
                           ignore_index=ignore_index, reduction="sum") / count

where ``count`` is ``reduction_count`` when given (the number of items a mean is over,
e.g. the tokens of all micro-batches of a step, so that summing the micro-batches'
losses gives the whole batch's mean) and otherwise the number of labels that are not
``ignore_index`` (0 of them gives NaN, as the unchunked mean does).

How it runs, with ``R = ceil(N / chunks)`` rows and ``C = ceil(V / vocab_chunks)``
vocabulary entries per block:

- forward: for each vocabulary block, for each row chunk, the logits block
  ``h[rows] @ w[cols].T + b[cols]`` (R x C), the target logit if the target falls in the
  block, and an online logsumexp (running max and running sum of exponentials: N floats
  each, updated a row chunk at a time). The block is exponentiated in place. Saved for
  backward: ``hidden``, ``weight``, ``bias``, ``labels`` (the inputs: no new memory) and
  the per-row logsumexp (N floats).
- backward: for each block again, recompute the logits, turn them in place into
  ``softmax - onehot(target)`` (``exp(logit - lse)``, minus one at the target), scaled by
  ``grad_output / count`` and zeroed on ignored rows, then
  ``grad_hidden[rows] += g @ w[cols]``, ``grad_weight[cols] += g.T @ h[rows]`` and
  ``grad_bias[cols] += g.sum(0)``, all in place into the gradients.
- the vocabulary blocks are the outer loop, so each row meets them in order (the
  results do not depend on which loop is outside) and a weight streamed from disk
  (``weight_rows``, see ``WeightRows``) is read one block at a time, once per pass; its
  gradient is then handed over a block at a time (``C x d``) instead of being returned
  whole (``V x d``).

Memory, in bytes, with ``b`` the bytes of the input dtype and ``a`` those of the
accumulation dtype (float32 for float16/bfloat16 inputs, the input dtype otherwise):

- one block: ``B = R * C * a`` when the inputs are float32 or float64, and
  ``R * C * (b + 4)`` for float16/bfloat16, where the matmul's low-precision block and
  its float32 copy briefly coexist (forward: the cast; backward: the cast back for the
  gradient matmuls).
- forward peak above its inputs: ``3 * N * a + N`` (running max and sum, the target
  logits, the mask of labels that count; the sum becomes the saved logsumexp)
  ``+ B`` ``+ ~R * 64`` (per-row temporaries of a block: masks, local targets). The unchunked
  ``F.cross_entropy(F.linear(h, w, b), y)`` keeps ``N * V * b`` logits plus an
  ``N * V * b`` log-softmax saved for backward.
- backward peak above the level before it: the gradients it must produce
  (``N * d * b`` for ``hidden``, ``V * d * b`` for ``weight``, ``V * b`` for ``bias``,
  each only when that input requires grad) plus ``B + C * a + ~R * 64``. The unchunked
  backward materialises the ``N * V`` gradient of the logits (and, for lower precision,
  its float32 form) on top of the same gradients.

``head_chunk_bytes`` gives these figures for the planner; the tests check them against
live-storage tracking. Time: the backward recomputes the logits matmul once more, so
the head costs ``8 N V d`` FLOPs instead of ``6 N V d``; row chunks cost nothing else,
vocabulary chunks only more kernel launches.

Gradient accumulation is in the parameters' dtype (as Liger does); the logits block,
logsumexp and loss are computed in float32 for float16/bfloat16 inputs and the loss is
returned in float32 then, as transformers' causal-LM loss upcasts its logits. Autocast
is switched off inside (``hidden``, ``weight`` and ``bias`` must share one dtype: cast
them first). Only gradients of inputs that require grad are computed (a frozen head
computes no ``grad_weight``). Double backward is not supported.

Example:
    >>> h = model.transformer(ids).last_hidden_state  # doctest: +SKIP
    >>> loss = chunked_linear_cross_entropy(  # doctest: +SKIP
    ...     h, model.lm_head.weight, None, causal_lm_targets(labels), chunks=8)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.autograd.function import once_differentiable

__all__ = [
    "ChunkedLinearCrossEntropy",
    "WeightRows",
    "HeadChunkBytes",
    "causal_lm_targets",
    "chunked_linear_cross_entropy",
    "head_chunk_bytes",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# Per-row temporaries of one block (bool masks, int64 local targets, the running max,
# sum and target logit, their updates); an upper estimate, small next to the block.
ROW_TEMP_BYTES = 64


@runtime_checkable
class WeightRows(Protocol):
    """Where a streamed head's weight is read and its gradient written, a block of
    vocabulary rows at a time (``memory.streaming``: straight from and to the
    store's files), so neither the whole weight nor its whole gradient is ever in
    memory.

    ``rows(start, stop)`` gives rows ``[start, stop)`` of the weight (a view the
    caller drops after use); ``add_grad(start, stop, grad)`` takes the gradient of
    those rows from one backward (every row exactly once per backward, in order);
    ``done()`` follows the last block.
    """

    def rows(self, start: int, stop: int) -> torch.Tensor: ...

    def add_grad(self, start: int, stop: int, grad: torch.Tensor) -> None: ...

    def done(self) -> None: ...


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _bounds(n: int, parts: int) -> Iterator[tuple[int, int]]:
    """``parts`` near-equal non-empty slices of ``range(n)`` (sizes differ by <= 1)."""
    for i in range(parts):
        start, stop = i * n // parts, (i + 1) * n // parts
        if stop > start:
            yield start, stop


def _block(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype
) -> torch.Tensor:
    """``h @ w.T + b`` in the accumulation dtype (a fresh tensor: safe to edit)."""
    out = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
    return out.to(acc)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum CE(hidden @ weight.T + bias, labels) / count``, one logits block at a time.

    ``apply(hidden, weight, bias, labels, chunks, vocab_chunks, ignore_index, count)``
    with ``hidden`` (N, d), ``labels`` (N,) and ``count`` an int or None (the number of
    non-ignored labels). Inputs are not validated here: call
    ``chunked_linear_cross_entropy``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunks: int,
        vocab_chunks: int,
        ignore_index: int,
        reduction_count: int | None,
        rows: WeightRows | None = None,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        v = weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        dev = hidden.device
        with torch.autocast(device_type=dev.type, enabled=False):
            valid = labels != ignore_index
            run_max = torch.full((n,), -math.inf, dtype=acc, device=dev)
            run_sum = torch.zeros(n, dtype=acc, device=dev)
            target = torch.zeros(n, dtype=acc, device=dev)
            # vocabulary blocks outside, rows inside: a streamed weight is read once
            # per pass, a block at a time; every row still meets the blocks in order
            for v0, v1 in _bounds(v, vocab_chunks):
                w = weight[v0:v1] if rows is None else rows.rows(v0, v1)
                b = None if bias is None else bias[v0:v1]
                for s, e in _bounds(n, chunks):
                    y = labels[s:e]
                    logits = _block(hidden[s:e], w, b, acc)
                    inside = valid[s:e] & (y >= v0) & (y < v1)
                    local = torch.where(inside, y - v0, 0).unsqueeze(1)
                    picked = logits.gather(1, local).squeeze(1)
                    target[s:e] = torch.where(inside, picked, target[s:e])
                    new_max = torch.maximum(run_max[s:e], logits.amax(1))
                    rescale = torch.exp(run_max[s:e] - new_max)
                    block_sum = logits.sub_(new_max.unsqueeze(1)).exp_().sum(1)
                    del logits
                    run_sum[s:e] = run_sum[s:e] * rescale + block_sum
                    run_max[s:e] = new_max
                del w
            lse = run_sum.log_().add_(run_max)
            del run_max
            total = torch.zeros((), dtype=acc, device=dev)
            for s, e in _bounds(n, chunks):
                total += torch.where(valid[s:e], lse[s:e] - target[s:e], 0).sum()
            del target, valid
            count: torch.Tensor | int
            if reduction_count is None:
                count = (labels != ignore_index).sum()
            else:
                count = reduction_count
            loss = total / count
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.count = count
        ctx.chunks = chunks
        ctx.vocab_chunks = vocab_chunks
        ctx.ignore_index = ignore_index
        ctx.rows = rows
        return loss

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        rows: WeightRows | None = ctx.rows
        rest = (None,) * 6
        if not (need_h or need_w or need_b):
            return (None, None, None, *rest)
        n = hidden.shape[0]
        v = weight.shape[0]
        acc = lse.dtype
        ii = ctx.ignore_index
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            scale = grad_output.to(acc) / ctx.count
            gh = torch.zeros_like(hidden) if need_h else None
            gw = torch.zeros_like(weight) if need_w and rows is None else None
            gb = torch.zeros_like(bias) if need_b else None
            valid = labels != ii
            factor_all = torch.where(valid, scale, 0)
            for v0, v1 in _bounds(v, ctx.vocab_chunks):
                w = weight[v0:v1] if rows is None else rows.rows(v0, v1)
                b = None if bias is None else bias[v0:v1]
                gw_rows = None
                if need_w:
                    gw_rows = gw[v0:v1] if gw is not None else torch.zeros_like(w)
                for s, e in _bounds(n, ctx.chunks):
                    h, y = hidden[s:e], labels[s:e]
                    factor = factor_all[s:e].unsqueeze(1)
                    g = _block(h, w, b, acc)
                    g.sub_(lse[s:e].unsqueeze(1)).exp_().mul_(factor)
                    inside = valid[s:e] & (y >= v0) & (y < v1)
                    local = torch.where(inside, y - v0, 0).unsqueeze(1)
                    g.scatter_add_(
                        1, local, torch.where(inside.unsqueeze(1), -factor, 0)
                    )
                    if gb is not None:
                        gb[v0:v1] += g.sum(0).to(gb.dtype)
                    g = g.to(hidden.dtype)
                    if gh is not None:
                        gh[s:e].addmm_(g, w)
                    if gw_rows is not None:
                        gw_rows.addmm_(g.t(), h)
                    del g
                if rows is not None and gw_rows is not None:
                    rows.add_grad(v0, v1, gw_rows)
                del w, gw_rows
            if rows is not None and need_w:
                rows.done()
        return (gh, gw, gb, *rest)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunks: int,
    vocab_chunks: int = 1,
    ignore_index: int = -100,
    reduction_count: int | None = None,
    weight_rows: WeightRows | None = None,
) -> torch.Tensor:
    """The cross entropy of ``hidden @ weight.T + bias`` with ``labels``, chunked.

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias), labels,
    ignore_index=ignore_index, reduction="sum") / count`` (see the module docstring)
    and its gradients, holding one ``ceil(N / chunks) x ceil(V / vocab_chunks)`` block
    of logits at a time instead of all ``N x V``.

    Args:
        hidden: (..., d) floating point; leading dims are flattened to N rows.
        weight: (V, d), the same dtype and device as ``hidden``.
        bias: (V,) or None.
        labels: int64, ``hidden.shape[:-1]`` or (N,); entries in ``[0, V)`` or
            ``ignore_index``.
        chunks: row (token) chunks, >= 1 (more than N is allowed: empty ones skip).
        vocab_chunks: vocabulary chunks, >= 1; useful when N is small and V large.
        ignore_index: labels with this value contribute no loss and no gradient.
        reduction_count: the number of items the mean is over (e.g. the tokens of all
            micro-batches of a step); default: the number of non-ignored labels.
        weight_rows: read the weight's rows from here, a vocabulary block at a time,
            and hand the weight's gradient to it instead of returning one (see
            ``WeightRows``); ``weight`` then only gives the shape and dtype.

    Returns:
        A scalar: the input dtype, float32 for float16/bfloat16 inputs.

    Raises:
        ValueError: a shape, dtype or device mismatch, ``chunks``/``vocab_chunks`` not
            an int >= 1, ``reduction_count`` not None or an int >= 1, or a label outside
            ``[0, V)`` that is not ``ignore_index`` (checking this reads one boolean
            back from the device).
    """
    if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2:
        raise ValueError(
            f"hidden must be a tensor of shape (..., d), got "
            f"{getattr(hidden, 'shape', type(hidden).__name__)}"
        )
    if not hidden.is_floating_point():
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    d = hidden.shape[-1]
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.shape[1] != d:
        raise ValueError(
            f"weight must have shape (V, {d}) to match hidden {tuple(hidden.shape)}, "
            f"got {getattr(weight, 'shape', type(weight).__name__)}"
        )
    vocab = weight.shape[0]
    if vocab < 1:
        raise ValueError(
            f"weight must have at least one row, got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: "
            "cast one of them first"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (vocab,):
            raise ValueError(
                f"bias must be None or of shape ({vocab},), got "
                f"{getattr(bias, 'shape', type(bias).__name__)}"
            )
        if bias.dtype != hidden.dtype:
            raise ValueError(
                f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}"
            )
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64:
        raise ValueError(
            f"labels must be an int64 tensor, got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}"
        )
    lead = tuple(hidden.shape[:-1])
    n = math.prod(lead)
    if tuple(labels.shape) not in (lead, (n,)):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must be {lead} or ({n},) "
            f"to match hidden {tuple(hidden.shape)}"
        )
    for name, t in (("weight", weight), ("bias", bias), ("labels", labels)):
        if t is not None and t.device != hidden.device:
            raise ValueError(
                f"{name} is on {t.device}, hidden on {hidden.device}: one device"
            )
    if not _is_int(chunks) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    if not _is_int(vocab_chunks) or vocab_chunks < 1:
        raise ValueError(f"vocab_chunks must be an int >= 1, got {vocab_chunks!r}")
    if not _is_int(ignore_index):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if reduction_count is not None and (
        not _is_int(reduction_count) or reduction_count < 1
    ):
        raise ValueError(
            f"reduction_count must be None or an int >= 1, got {reduction_count!r}"
        )
    if weight_rows is not None and not isinstance(weight_rows, WeightRows):
        raise ValueError(
            f"weight_rows must provide rows, add_grad and done, got "
            f"{type(weight_rows).__name__}"
        )
    flat_labels = labels.reshape(n)
    if n and not _is_fake(flat_labels):  # profiling traces have no values to check
        bad = (flat_labels != ignore_index) & (
            (flat_labels < 0) | (flat_labels >= vocab)
        )
        if bool(bad.any()):
            first = int(flat_labels[bad][0])
            raise ValueError(
                f"labels must be in [0, {vocab}) or ignore_index={ignore_index}, "
                f"found {first}"
            )
    out = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(n, d),
        weight,
        bias,
        flat_labels,
        chunks,
        vocab_chunks,
        ignore_index,
        reduction_count,
        weight_rows,
    )
    return out  # type: ignore[no-any-return]


def causal_lm_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The targets of a causal LM, flattened: position t predicts ``labels[..., t+1]``.

    The shift transformers' causal-LM loss applies: pad the last dim with one
    ``ignore_index`` at the end, drop the first position, flatten. With it
    ``chunked_linear_cross_entropy(hidden, lm_head.weight, None,
    causal_lm_targets(labels), chunks=c)`` equals ``model(ids, labels=labels).loss``.

    Raises:
        ValueError: ``labels`` is not an integer tensor with at least one dim.
    """
    if (
        not isinstance(labels, torch.Tensor)
        or labels.ndim < 1
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
    ):
        raise ValueError(
            f"labels must be an integer tensor of shape (..., T), got "
            f"{getattr(labels, 'dtype', type(labels).__name__)} "
            f"{tuple(getattr(labels, 'shape', ()))}"
        )
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1).reshape(-1).to(torch.int64)


@dataclass(frozen=True)
class HeadChunkBytes:
    """Peak extra bytes of a chunked loss head (see the module docstring).

    Attributes:
        forward_bytes: peak live bytes during the forward above its inputs: three
            floats and a mask per row (running max, sum, target logit), one logits
            block and per-row temporaries.
        backward_workspace_bytes: peak transient bytes during the backward beyond the
            gradients: one block, the bias-gradient row sum, per-row temporaries.
        grad_bytes: the gradients the backward produces (0 unless ``hidden_size``
            was given; the bias gradient only with ``bias=True``).
    """

    forward_bytes: int
    backward_workspace_bytes: int
    grad_bytes: int

    @property
    def backward_bytes(self) -> int:
        """Peak live bytes during the backward above the level before it."""
        return self.backward_workspace_bytes + self.grad_bytes


def head_chunk_bytes(
    num_rows: int,
    vocab: int,
    chunks: int,
    dtype_bytes: int = 4,
    *,
    vocab_chunks: int = 1,
    hidden_size: int = 0,
    hidden_grad: bool = True,
    weight_grad: bool = True,
    bias: bool = False,
) -> HeadChunkBytes:
    """What ``chunked_linear_cross_entropy`` adds to memory, for the planner.

    Args:
        num_rows: N, the tokens of one call (one micro-batch).
        vocab: V.
        chunks: row chunks; ``vocab_chunks``: vocabulary chunks.
        dtype_bytes: bytes of the inputs' dtype (2: float16/bfloat16, computed in
            float32; 4: float32; 8: float64).
        hidden_size: d; with it ``grad_bytes`` counts the gradients of hidden (when
            ``hidden_grad``), weight (when ``weight_grad``) and bias (when ``bias``).

    Raises:
        ValueError: a count below its minimum (N, V, d >= 0; V, chunks >= 1) or
            ``dtype_bytes`` not 2, 4 or 8.
    """
    for name, val, low in (
        ("num_rows", num_rows, 0),
        ("vocab", vocab, 1),
        ("chunks", chunks, 1),
        ("vocab_chunks", vocab_chunks, 1),
        ("hidden_size", hidden_size, 0),
    ):
        if not _is_int(val) or val < low:
            raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    if dtype_bytes not in (2, 4, 8):
        raise ValueError(f"dtype_bytes must be 2, 4 or 8, got {dtype_bytes!r}")
    acc = 4 if dtype_bytes == 2 else dtype_bytes
    rows = -(-num_rows // chunks)
    cols = -(-vocab // vocab_chunks)
    per_elem = dtype_bytes + 4 if dtype_bytes == 2 else acc
    block = rows * cols * per_elem
    row_temps = rows * ROW_TEMP_BYTES if num_rows else 0
    forward = num_rows * (3 * acc + 1) + block + row_temps
    backward = block + (cols * acc if bias else 0) + row_temps if num_rows else 0
    grads = 0
    if hidden_size:
        grads += num_rows * hidden_size * dtype_bytes if hidden_grad else 0
        grads += vocab * hidden_size * dtype_bytes if weight_grad else 0
    grads += vocab * dtype_bytes if bias else 0
    return HeadChunkBytes(
        forward_bytes=forward, backward_workspace_bytes=backward, grad_bytes=grads
    )
