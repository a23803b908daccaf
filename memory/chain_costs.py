"""What one training step of a chain of blocks costs, block by block, as it runs.

``chain_costs(modules, x, y, loss_fn, tracker, params)`` runs the forward block by
block, then the backward block by block, on whatever tensors it is given (fake ones
when profiling: shapes, no storage) and measures for each block:

- activations: the bytes of the tensors its forward saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` (``record_saved``) and keyed by storage,
  so views and parameters are not counted (parameters are state). Saved tensors that
  are the block's input or output are flagged (``saves_input``/``saves_output``), not
  counted: those boundary tensors are shared with the neighbouring block.
- workspace: the peak of live bytes during its forward (with and without autograd) and
  backward, above the level before it, from ``LiveBytes``, a dispatch mode that follows
  every storage's life.
- the loss: its saved tensors (the logits' softmax) and workspace belong to the last
  block.
- FLOPs, from ``torch.utils.flop_counter.FlopCounterMode``.

``block_state(blocks, optimizer)`` gives each block's state: parameter, gradient, AdamW
state (``exp_avg`` and ``exp_avg_sq``: 2 x the trainable parameter bytes) and buffer
bytes. A parameter shared by several blocks (GPT-2's head projection is the token
embedding) is counted once, in the first block that owns it; later users record it in
``shared_param_bytes``.

Example:
    >>> tracker = LiveBytes()  # doctest: +SKIP
    >>> with fake_mode, tracker:  # doctest: +SKIP
    ...     costs = chain_costs(modules, x, y, loss_fn, tracker, param_keys)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from memory.batch import batch_dependent_layer
from memory.blocks import Block
from memory.profile import BlockCosts

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADAMW_STATE_FACTOR = 2  # exp_avg and exp_avg_sq, each the size of the parameter


# --------------------------------------------------------------------------- tracking
class LiveBytes(TorchDispatchMode):
    """Follows every storage an op creates: live bytes now and the peak since reset.

    ``ignore``: storages (by ``id``) counted elsewhere (parameters, buffers, the
    batch) that a view op can hand back (``weight[a:b]``, ``weight.t()``); they are
    not new memory."""

    def __init__(self, ignore: set[int] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        self.ignore: set[int] = set() if ignore is None else ignore

    def _freed(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._refs or key in self.ignore:
            return
        nbytes = st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._freed(k, n))  # type: ignore[misc]
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def reset(self) -> int:
        self.peak = self.live
        return self.live

    def track_outputs(self, out: object) -> None:
        """Count every strided tensor an operator returned."""
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.track_outputs(out)
        return out


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views of one storage share it)."""
    return id(t.untyped_storage())


@contextlib.contextmanager
def record_saved(params: set[int], saved: dict[int, int]) -> Iterator[None]:
    """Records in ``saved`` (``{storage key: bytes}``) each storage autograd saves
    for backward, but those in ``params``."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in params:
            saved[id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole storage (what its views keep alive)."""
    return t.untyped_storage().nbytes()


def _flops(fc: FlopCounterMode) -> int:
    return int(fc.get_total_flops())


# --------------------------------------------------------------------------- one chain
@dataclass(frozen=True)
class _Forward:
    """What a block's forward measured, held until its backward is measured."""

    input_bytes: int
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    peak_bytes: int
    no_grad_peak_bytes: int
    flops: int

    def with_backward(self, peak_bytes: int, flops: int) -> BlockCosts:
        return BlockCosts(
            input_bytes=self.input_bytes,
            output_bytes=self.output_bytes,
            saved_bytes=self.saved_bytes,
            saves_input=self.saves_input,
            saves_output=self.saves_output,
            forward_peak_bytes=self.peak_bytes,
            forward_no_grad_peak_bytes=self.no_grad_peak_bytes,
            backward_peak_bytes=peak_bytes,
            forward_flops=self.flops,
            backward_flops=flops,
        )


def chain_costs(
    modules: list[nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    tracker: LiveBytes,
    params: set[int],
) -> list[BlockCosts]:
    """Run forward block by block then backward block by block; costs per block.

    Args:
        modules: the chain; the last one's output goes to ``loss_fn``.
        x: the first block's input.
        y: the targets.
        loss_fn: ``loss_fn(output, targets)``, a scalar.
        tracker: the live-bytes mode the step runs under (entered by the caller).
        params: storage keys (``storage_key``) of the parameters: never activations.

    Returns:
        Each block's ``BlockCosts``, in forward order, without times.
    """
    n = len(modules)
    records: list[tuple[torch.Tensor, torch.Tensor, _Forward]] = []
    for j, mod in enumerate(modules):
        xin = x.detach()
        if j > 0 and xin.is_floating_point():
            xin.requires_grad_(True)
        # without autograd first: BatchNorm statistics move once more, harmless here
        tracker.reset()
        level = tracker.live
        with torch.no_grad():
            out = mod(xin)
            if j == n - 1:
                out = loss_fn(out, y)
        del out
        no_grad_peak = tracker.peak - level
        saved: dict[int, int] = {}
        level = tracker.reset()
        with FlopCounterMode(display=False) as fc, record_saved(params, saved):
            out = mod(xin)
            if j == n - 1:
                out = loss_fn(out, y)
        peak = tracker.peak - level
        kin, kout = storage_key(xin), storage_key(out)
        forward = _Forward(
            input_bytes=storage_nbytes(xin),
            output_bytes=storage_nbytes(out),
            saved_bytes=sum(v for k, v in saved.items() if k not in (kin, kout)),
            saves_input=kin in saved,
            saves_output=kout in saved,
            peak_bytes=peak,
            no_grad_peak_bytes=no_grad_peak,
            flops=_flops(fc),
        )
        records.append((xin, out, forward))
        x = out
    costs: list[BlockCosts] = []
    grad: torch.Tensor | None = None
    for j in reversed(range(n)):
        xin, out, forward = records[j]
        if j == n - 1:
            grad = None  # the loss
        elif out.requires_grad:
            assert grad is not None
            grad = grad.view_as(out) if grad.shape != out.shape else grad
        level = tracker.reset()
        with FlopCounterMode(display=False) as fc:
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        costs.append(forward.with_backward(tracker.peak - level, _flops(fc)))
        grad = xin.grad
        del out
    return costs[::-1]


# --------------------------------------------------------------------------- state
@dataclass(frozen=True)
class BlockState:
    """A block's state: the ``memory.profile.BlockProfile`` fields that do not
    depend on the batch, with the same names and meanings (documented there)."""

    name: str
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    max_param_tensor_bytes: int
    shared_param_bytes: int
    shared_with: tuple[str, ...]


def block_state(blocks: list[Block], optimizer: str) -> list[BlockState]:
    """Each block's state bytes; a parameter shared by blocks is its first user's.

    Raises:
        ValueError: an optimizer other than ``adamw``.
    """
    if optimizer != "adamw":
        raise ValueError(f"optimizer {optimizer!r} is not supported; use 'adamw'")
    owner: dict[int, str] = {}
    out = []
    for b in blocks:
        own = shared = n = 0
        trainable = max_t = 0
        shared_with: list[str] = []
        for p in b.module.parameters():
            key = id(p)
            nbytes = p.numel() * p.element_size()
            if key in owner and owner[key] != b.name:
                shared += nbytes
                shared_with.append(owner[key])
                continue
            owner[key] = b.name
            own += nbytes
            n += p.numel()
            max_t = max(max_t, nbytes)
            if p.requires_grad:
                trainable += nbytes
        buffers = sum(t.numel() * t.element_size() for t in b.module.buffers())
        out.append(
            BlockState(
                name=b.name,
                num_params=n,
                param_bytes=own,
                grad_bytes=trainable,
                optimizer_state_bytes=ADAMW_STATE_FACTOR * trainable,
                buffer_bytes=buffers,
                max_param_tensor_bytes=max_t,
                shared_param_bytes=shared,
                shared_with=tuple(dict.fromkeys(shared_with)),
            )
        )
    return out


def is_batch_dependent(model: nn.Module) -> bool:
    """True when some layer's step depends on the whole batch or on the number of
    forwards (BatchNorm and its kin, spectral_norm: ``memory.batch``'s
    ``batch_dependent_layer``): micro-batches would change what it computes."""
    return batch_dependent_layer(model) is not None
