"""What each block of a training step costs: bytes of state and activations, time.

``profile_workload_fake(factory, inputs, targets, loss_fn)`` builds the model under
``FakeTensorMode`` (no weight is ever allocated, so a model larger than RAM can be
profiled) and runs one training step block by block on fake tensors, tracking:

- state: parameter, gradient, AdamW state (``exp_avg`` and ``exp_avg_sq``: 2 x the
  trainable parameter bytes) and buffer bytes per block. A parameter shared by several
  blocks (GPT-2's head projection is the token embedding) is counted once, in the first
  block that owns it; later users record it in ``shared_param_bytes``.
- activations: the bytes of the tensors each block's forward saves for backward, seen
  through ``torch.autograd.graph.saved_tensors_hooks`` and keyed by storage, so views
  and parameters are not counted (parameters are state). Saved tensors that are the
  block's input or output are flagged (``saves_input``/``saves_output``), not counted:
  those boundary tensors are shared with the neighbouring block.
- workspace: the peak of live bytes during the block's forward (with and without
  autograd) and backward, above the level before it, from a dispatch mode that follows
  every storage's life.
- the loss: its saved tensors (the logits' softmax) and workspace belong to the last
  block.
- FLOPs, from ``torch.utils.flop_counter.FlopCounterMode``.

Every cost is profiled for each number of micro-batches the planner may choose (the
divisors of the batch size) and, for the last block, for each number of loss chunks
(slices of the flattened token dimension).

Time: each block's forward and backward are timed on this machine with real tensors of
the block's shapes when that is affordable (memory and time), otherwise derived from
its FLOPs and a measured matmul rate; ``BlockCosts.time_source`` says which. Disk
bandwidth for the planner comes from ``measure_disk_bandwidth`` (a short write and
read in the offload directory, cached per directory).

Example:
    >>> prof = profile_workload_fake(lambda: GPT(cfg), x, y, lm_loss)  # doctest: +SKIP
    >>> print(prof.table())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from memory.blocks import Block, as_blocks
from memory.machine import cached
from memory.sizes import format_bytes

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADAMW_STATE_FACTOR = 2  # exp_avg and exp_avg_sq, each the size of the parameter


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class BlockCosts:
    """A block's activation costs and time for one micro-batch size (and loss chunk).

    Attributes:
        input_bytes: bytes of the block's input.
        output_bytes: bytes of its output (the loss's scalar for the last block).
        saved_bytes: bytes its forward saves for backward that are neither its input,
            its output nor parameters (storages counted once).
        saves_input: its forward saves (a view of) its input.
        saves_output: its forward saves (a view of) its output.
        forward_peak_bytes: peak live bytes during the forward with autograd, above the
            level before it (saved tensors, output and temporaries).
        forward_no_grad_peak_bytes: the same under ``no_grad``.
        backward_peak_bytes: peak live bytes during its backward above the level before
            it (the output gradient and saved tensors exist then): gradients of its
            parameters, its input gradient and temporaries, less what it frees.
        forward_flops: FLOPs of the forward.
        backward_flops: FLOPs of the backward.
        forward_s: forward time, seconds.
        backward_s: backward time, seconds.
        time_source: ``measured`` (timed with real tensors) or ``flops`` (FLOPs over
            the measured matmul rate).
        row_load_bytes: when the block is streamed, what it holds at once of its
            row-streamed parameters (``memory.streaming``): the pages of an
            embedding table its lookups touch, one vocabulary block of a chunked
            head's weight.
        row_grad_bytes: ... and of their gradients in its backward (a lookup's
            sparse gradient and the store's working set summing it in; a head's
            gradient block and the accumulator rows it is added to).
        row_dense_grad_bytes: the dense gradient bytes of those parameters inside
            ``backward_peak_bytes``, which a row-streamed backward does not make.
    """

    input_bytes: int
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    forward_peak_bytes: int
    forward_no_grad_peak_bytes: int
    backward_peak_bytes: int
    forward_flops: int
    backward_flops: int
    forward_s: float = 0.0
    backward_s: float = 0.0
    time_source: str = "flops"
    row_load_bytes: int = 0
    row_grad_bytes: int = 0
    row_dense_grad_bytes: int = 0


@dataclass(frozen=True)
class BlockProfile:
    """One block's state and its costs for each micro-batch count.

    Attributes:
        name: the block's module path.
        num_params: parameters it owns.
        param_bytes: bytes of the parameters it owns (shared ones: first owner only).
        grad_bytes: bytes of the gradients of its trainable parameters.
        optimizer_state_bytes: the optimizer's state for them (AdamW: 2 x).
        buffer_bytes: bytes of its buffers (BatchNorm statistics).
        max_param_tensor_bytes: its largest parameter tensor (the optimizer's
            per-tensor temporary).
        shared_param_bytes: bytes of parameters it uses that an earlier block owns.
        shared_with: names of the blocks owning those parameters.
        costs: ``{num_microbatches: BlockCosts}``.
        chunk_costs: last block only, ``{(num_microbatches, loss_chunks): BlockCosts}``
            for one chunk of a micro-batch, for ``loss_chunks > 1``.
        options: the planner's options allowed for this block (``memory.plan``
            letters: K keep, R recompute, O offload, S stream); empty: all.
        row_param_bytes: bytes of its own parameters that are row-streamed when
            the block is streamed (never loaded or given a gradient whole; see
            ``BlockCosts.row_load_bytes``).
        row_shared_bytes: bytes of the borrowed (tied) parameters it row-streams
            when their owner is streamed (a tied chunked head's weight).
    """

    name: str
    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    max_param_tensor_bytes: int
    shared_param_bytes: int
    shared_with: tuple[str, ...]
    costs: dict[int, BlockCosts]
    chunk_costs: dict[tuple[int, int], BlockCosts] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    row_param_bytes: int = 0
    row_shared_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state: what streaming takes off memory."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes

    # The whole-batch figures, named as in the issue.
    @property
    def input_bytes(self) -> int:
        return self.costs[1].input_bytes

    @property
    def output_bytes(self) -> int:
        return self.costs[1].output_bytes

    @property
    def saved_activation_bytes(self) -> int:
        """Bytes its forward saves for backward, input and output included."""
        c = self.costs[1]
        return (
            c.saved_bytes
            + c.saves_input * c.input_bytes
            + c.saves_output * c.output_bytes
        )

    @property
    def forward_s(self) -> float:
        return self.costs[1].forward_s

    @property
    def backward_s(self) -> float:
        return self.costs[1].backward_s


@dataclass(frozen=True)
class DiskBandwidth:
    """Measured sequential disk bandwidth of a directory, bytes per second."""

    directory: str
    read_bytes_per_s: float
    write_bytes_per_s: float


@dataclass(frozen=True)
class Profile:
    """The per-block costs of one training step of a workload.

    Attributes:
        blocks: per-block profiles, in forward order.
        batch_size: examples in the profiled batch.
        batch_dependent: the model has layers whose result depends on the whole batch
            (BatchNorm): micro-batching changes its results.
        batch_bytes: bytes of the example inputs and targets (alive the whole step).
        construction_peak_bytes: peak bytes while the model is built (its parameters
            and buffers plus anything built and dropped, such as an untied head).
        optimizer: ``adamw``.
        flops_per_s: the measured matmul rate used for FLOP-derived times.
        time_source: ``measured``, ``flops`` or ``mixed`` over the blocks.
        loss_chunk_options: the loss chunk counts profiled for the last block.
        loss_chunk_setting: the loss chunks every block was profiled with (the unit
            path's chunked head, ``memory.head``; 1: the model's own loss).
        update_by_chunks: a streamed block's update maps its parameters and stored
            gradients a chunk at a time, after unmapping them (the unit path,
            ``memory.streaming``); False: with its parameters mapped whole (the
            chain executor).
        disk: the measured disk bandwidth, if measured.
        runtime_bytes: the fixed cost of torch's first training step (see
            ``memory.overhead``), part of every event of a step; 0 if not measured.
    """

    blocks: tuple[BlockProfile, ...]
    batch_size: int
    batch_dependent: bool
    batch_bytes: int
    construction_peak_bytes: int
    optimizer: str = "adamw"
    flops_per_s: float = 0.0
    time_source: str = "flops"
    loss_chunk_options: tuple[int, ...] = (1,)
    loss_chunk_setting: int = 1
    update_by_chunks: bool = False
    disk: DiskBandwidth | None = None
    runtime_bytes: int = 0

    @property
    def microbatch_options(self) -> tuple[int, ...]:
        return tuple(sorted(self.blocks[0].costs))

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def state_bytes(self) -> int:
        return sum(b.state_bytes + b.buffer_bytes for b in self.blocks)

    def with_disk(self, disk: DiskBandwidth | None) -> Profile:
        return replace(self, disk=disk)

    def table(self) -> str:
        """A per-block table for people."""
        head = (
            f"{'block':<14}{'params':>12}{'state':>12}{'saved':>12}{'fwd peak':>12}"
            f"{'bwd peak':>12}{'fwd ms':>9}{'bwd ms':>9}  time"
        )
        rows = [head]
        for b in self.blocks:
            c = b.costs[1]
            rows.append(
                f"{b.name:<14}{format_bytes(b.param_bytes):>12}"
                f"{format_bytes(b.state_bytes):>12}"
                f"{format_bytes(b.saved_activation_bytes):>12}"
                f"{format_bytes(c.forward_peak_bytes):>12}"
                f"{format_bytes(c.backward_peak_bytes):>12}"
                f"{c.forward_s * 1e3:>9.2f}{c.backward_s * 1e3:>9.2f}  {c.time_source}"
            )
        return "\n".join(rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        for b in d["blocks"]:
            b["costs"] = {str(k): v for k, v in b["costs"].items()}
            b["chunk_costs"] = {f"{m}x{c}": v for (m, c), v in b["chunk_costs"].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        d = dict(d)
        blocks = []
        for b in d["blocks"]:
            b = dict(b)
            b["costs"] = {int(k): BlockCosts(**v) for k, v in b["costs"].items()}
            b["chunk_costs"] = {
                tuple(int(x) for x in k.split("x")): BlockCosts(**v)
                for k, v in b["chunk_costs"].items()
            }
            b["shared_with"] = tuple(b["shared_with"])
            b["options"] = tuple(b.get("options", ()))
            blocks.append(BlockProfile(**b))
        d["blocks"] = tuple(blocks)
        d["loss_chunk_options"] = tuple(d["loss_chunk_options"])
        if d.get("disk"):
            d["disk"] = DiskBandwidth(**d["disk"])
        return cls(**d)


# --------------------------------------------------------------------------- tracking
class _LiveBytes(TorchDispatchMode):
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.track(t)
        return out


def _storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


@contextlib.contextmanager
def _record_saved(params: set[int], saved: dict[int, int]) -> Iterator[None]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if id(st) not in params:
            saved[id(st)] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _flops(fc: FlopCounterMode) -> int:
    return int(fc.get_total_flops())


# --------------------------------------------------------------------------- one chain
def _chain_costs(
    modules: list[nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    tracker: _LiveBytes,
    params: set[int],
) -> list[BlockCosts]:
    """Run forward block by block then backward block by block; costs per block."""
    n = len(modules)
    records: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
    for j, mod in enumerate(modules):
        xin = x.detach()
        if j > 0 and xin.is_floating_point():
            xin.requires_grad_(True)
        info: dict = {}
        # without autograd first: BatchNorm statistics move once more, harmless here
        tracker.reset()
        level = tracker.live
        with torch.no_grad():
            out = mod(xin)
            if j == n - 1:
                out = loss_fn(out, y)
        del out
        info["fwd_ng"] = tracker.peak - level
        saved: dict[int, int] = {}
        level = tracker.reset()
        with FlopCounterMode(display=False) as fc, _record_saved(params, saved):
            out = mod(xin)
            if j == n - 1:
                out = loss_fn(out, y)
        info["fwd"] = tracker.peak - level
        info["fwd_flops"] = _flops(fc)
        kin, kout = _storage_key(xin), _storage_key(out)
        info["saves_input"] = kin in saved
        info["saves_output"] = kout in saved
        info["saved"] = sum(v for k, v in saved.items() if k not in (kin, kout))
        info["in"], info["out"] = _nbytes(xin), _nbytes(out)
        records.append((xin, out, info))
        x = out
    costs: list[BlockCosts] = []
    grad: torch.Tensor | None = None
    for j in reversed(range(n)):
        xin, out, info = records[j]
        if j == n - 1:
            grad = None  # the loss
        elif out.requires_grad:
            assert grad is not None
            grad = grad.view_as(out) if grad.shape != out.shape else grad
        level = tracker.reset()
        with FlopCounterMode(display=False) as fc:
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        info["bwd"] = tracker.peak - level
        info["bwd_flops"] = _flops(fc)
        grad = xin.grad
        records[j] = (xin, out, info)
        del out
        costs.append(
            BlockCosts(
                input_bytes=info["in"],
                output_bytes=info["out"],
                saved_bytes=info["saved"],
                saves_input=info["saves_input"],
                saves_output=info["saves_output"],
                forward_peak_bytes=info["fwd"],
                forward_no_grad_peak_bytes=info["fwd_ng"],
                backward_peak_bytes=info["bwd"],
                forward_flops=info["fwd_flops"],
                backward_flops=info["bwd_flops"],
            )
        )
    return costs[::-1]


def _slice_rows(t: torch.Tensor, parts: int) -> torch.Tensor:
    return t[: t.shape[0] // parts]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


# --------------------------------------------------------------------------- state
def _state(blocks: list[Block], optimizer: str) -> list[dict]:
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
            {
                "name": b.name,
                "num_params": n,
                "param_bytes": own,
                "grad_bytes": trainable,
                "optimizer_state_bytes": ADAMW_STATE_FACTOR * trainable,
                "buffer_bytes": buffers,
                "max_param_tensor_bytes": max_t,
                "shared_param_bytes": shared,
                "shared_with": tuple(dict.fromkeys(shared_with)),
            }
        )
    return out


def is_batch_dependent(model: nn.Module) -> bool:
    """True when some layer normalises over the batch (BatchNorm and its kin)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


# --------------------------------------------------------------------------- rates
_RATE_CACHE: dict[str, float] = {}
_DISK_CACHE: dict[str, DiskBandwidth] = {}


def measure_flops_per_s(size: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate, FLOP/s: the fastest of a few timed matmuls
    (other work on the machine only slows some of them), kept in the machine cache
    (``memory.machine``) so that plans do not drift between runs."""
    if "cpu" in _RATE_CACHE:
        return _RATE_CACHE["cpu"]

    def probe() -> float:
        a = torch.randn(size, size)
        b = torch.randn(size, size)
        a @ b  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return 2 * size**3 / min(times)

    rate = float(cached(f"matmul_flops_per_s_{size}", probe))
    _RATE_CACHE["cpu"] = rate
    return rate


def measure_disk_bandwidth(
    directory: str | os.PathLike | None = None, nbytes: int = 64 * 2**20
) -> DiskBandwidth:
    """Sequential write (with fsync) and read (page cache dropped) bandwidth.

    A short probe in ``directory`` (default: the system's temporary directory), the
    probe file removed; kept per directory for the life of the process and in the
    machine cache (``memory.machine``).
    """
    path = os.path.realpath(os.fspath(directory or tempfile.gettempdir()))
    if path in _DISK_CACHE:
        return _DISK_CACHE[path]
    os.makedirs(path, exist_ok=True)
    key = f"disk_bytes_per_s {path} {nbytes}"
    bw = DiskBandwidth(path, *cached(key, lambda: _disk_probe(path, nbytes)))
    _DISK_CACHE[path] = bw
    return bw


def _disk_probe(path: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes per second of ``path``."""
    chunk = os.urandom(min(nbytes, 4 * 2**20))
    fd, probe = tempfile.mkstemp(prefix=".fleetfit-bw-", dir=path)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < nbytes:
            written += os.write(fd, chunk)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, len(chunk)):
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(probe)
    return written / max(read_s, 1e-9), written / max(write_s, 1e-9)


# --------------------------------------------------------------------------- timing
def _real_like(t: torch.Tensor, example: torch.Tensor | None) -> torch.Tensor:
    if (
        example is not None
        and example.shape == t.shape
        and not example.is_floating_point()
    ):
        return example.clone()
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def _time_block(
    mod: nn.Module,
    x_shape: torch.Tensor,
    x_example: torch.Tensor | None,
    y_example: torch.Tensor | None,
    loss_fn: LossFn | None,
    repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds of ``mod`` with real tensors (random values)."""
    state: dict[str, torch.Tensor] = {}
    for name, p in mod.named_parameters(remove_duplicate=False):
        state[name] = nn.Parameter(torch.randn(p.shape, dtype=p.dtype) * 0.02)
    for name, b in mod.named_buffers(remove_duplicate=False):
        state[name] = torch.ones(b.shape, dtype=b.dtype)
    x = _real_like(x_shape, x_example)
    if x.is_floating_point():
        x.requires_grad_(True)

    def run() -> torch.Tensor:
        out = torch.func.functional_call(mod, state, (x,))
        return loss_fn(out, y_example) if loss_fn is not None else out  # type: ignore[arg-type]

    fwd, bwd = [], []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        if out.requires_grad:
            g = None if loss_fn is not None else torch.ones_like(out)
            torch.autograd.backward(out, g)
        t2 = time.perf_counter()
        if i > 1:  # two runs warm up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del out
        for p in state.values():  # type: ignore[assignment]
            p.grad = None
    # the minimum: the other processes of a busy machine only ever add time
    return min(fwd), min(bwd)


# --------------------------------------------------------------------------- entry
def profile_blocks(
    blocks: list[Block],
    example_inputs: torch.Tensor,
    example_targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    optimizer: str = "adamw",
    fake: bool = True,
    measure_time: bool = True,
    max_microbatches: int = 16,
    max_loss_chunks: int = 64,
    construction_peak_bytes: int | None = None,
    max_real_bytes: int | None = None,
    max_time_s: float = 2.0,
) -> Profile:
    """Profile a training step of a model given as blocks.

    Args:
        blocks: the model as ``as_blocks`` gives it (real, fake or meta-free modules).
        example_inputs: a batch of inputs (real tensors: their shapes and, for integer
            inputs such as tokens, their values are used).
        example_targets: the batch's targets.
        loss_fn: ``loss_fn(output, targets)``, a scalar.
        optimizer: ``adamw`` (its state is 2 x the trainable parameter bytes).
        fake: trace on fake copies of the blocks (no activation is allocated); with
            False the step runs on real copies.
        measure_time: time blocks with real tensors when affordable; otherwise every
            time is FLOPs over the measured matmul rate.
        max_microbatches: profile micro-batch counts up to this (divisors of the batch).
        max_loss_chunks: profile loss chunk counts (powers of two) up to this.
        construction_peak_bytes: peak bytes of building the model (default: its
            parameters and buffers).
        max_real_bytes: largest block (state and activations) timed with real tensors
            (default: a quarter of the available memory, at most 2 GiB).
        max_time_s: blocks whose FLOPs predict a longer forward plus backward are not
            timed but derived from FLOPs.

    Returns:
        The ``Profile``; its ``disk`` is unset (see ``measure_disk_bandwidth``).
    """
    if not blocks:
        raise ValueError("profile_blocks needs at least one block")
    holder = nn.ModuleList([b.module for b in blocks])
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

        if _is_fake_module(holder):
            fake_mode = _fake_mode_of(holder)
        else:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            with FakeCopyMode(fake_mode):
                holder = copy.deepcopy(holder)
    else:
        holder = copy.deepcopy(holder)
    names = [b.name for b in blocks]
    work_blocks = [Block(n, m) for n, m in zip(names, holder)]
    state = _state(work_blocks, optimizer)
    params = list(holder.parameters())
    batch = int(example_inputs.shape[0]) if example_inputs.dim() else 1
    tracker = _LiveBytes()

    def fakeify(t: torch.Tensor) -> torch.Tensor:
        if fake_mode is None:
            return t
        if isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
            return t
        return fake_mode.from_tensor(t)

    x_all, y_all = fakeify(example_inputs), fakeify(example_targets)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    costs_by_m: dict[int, list[BlockCosts]] = {}
    chunk_costs: dict[tuple[int, int], BlockCosts] = {}
    chunk_options = [1]
    with ctx, tracker:
        param_keys = {_storage_key(p) for p in params}
        for m in _divisors(batch, max_microbatches):
            x, y = _slice_rows(x_all, m), _slice_rows(y_all, m)
            costs_by_m[m] = _chain_costs(
                list(holder), x, y, loss_fn, tracker, param_keys
            )
            for p in params:
                p.grad = None
        # loss chunks: the last block on a slice of the flattened token rows
        last_in_shape = _last_input_shape(list(holder), x_all)
        if last_in_shape is not None and tuple(last_in_shape[:-1]) == tuple(
            y_all.shape
        ):
            rows_all = int(torch.Size(last_in_shape[:-1]).numel())
            for m in costs_by_m:
                rows = rows_all // m
                c = 2
                while c <= max_loss_chunks and rows % c == 0:
                    xin = torch.empty(
                        (rows // c, last_in_shape[-1]), dtype=torch.float32
                    )
                    yc = y_all.reshape(-1)[: rows // c]
                    cc = _chain_costs(
                        [holder[-1]], xin, yc, loss_fn, tracker, param_keys
                    )
                    chunk_costs[(m, c)] = cc[0]
                    chunk_options.append(c)
                    for p in params:
                        p.grad = None
                    c *= 2
    rate = measure_flops_per_s()
    sources: set[str] = set()
    profiles: list[BlockProfile] = []
    n = len(holder)
    budget_real = (
        max_real_bytes if max_real_bytes is not None else _default_real_bytes()
    )
    input_shapes = _input_shapes(list(holder), x_all, fake_mode)
    for j, st in enumerate(state):
        by_m: dict[int, BlockCosts] = {}
        full = costs_by_m[1][j]
        t_fwd = t_bwd = None
        src = "flops"
        est_s = (full.forward_flops + full.backward_flops) / rate
        real_bytes = (
            2 * (st["param_bytes"] + st["shared_param_bytes"])
            + full.forward_peak_bytes
            + full.backward_peak_bytes
            + full.input_bytes
        )
        if measure_time and real_bytes <= budget_real and est_s <= max_time_s:
            try:
                t_fwd, t_bwd = _time_block(
                    holder[j],
                    input_shapes[j],
                    example_inputs if j == 0 else None,
                    example_targets if j == n - 1 else None,
                    loss_fn if j == n - 1 else None,
                    repeats=3 if est_s < 0.2 else 1,
                )
                src = "measured"
            except Exception as e:  # a block that will not run on random values
                logger.info(
                    "timing %s with real tensors failed (%s); using FLOPs",
                    st["name"],
                    e,
                )
        for m, cs in costs_by_m.items():
            by_m[m] = _with_time(cs[j], full, t_fwd, t_bwd, rate, src)
        sources.add(src)
        chunked: dict[tuple[int, int], BlockCosts] = {}
        if j == n - 1:
            chunked = {
                k: _with_time(v, full, t_fwd, t_bwd, rate, src)
                for k, v in chunk_costs.items()
            }
        profiles.append(BlockProfile(costs=by_m, chunk_costs=chunked, **st))
    construction = construction_peak_bytes
    if construction is None:
        construction = sum(p.numel() * p.element_size() for p in params) + sum(
            b.numel() * b.element_size() for b in holder.buffers()
        )
    return Profile(
        blocks=tuple(profiles),
        batch_size=batch,
        batch_dependent=is_batch_dependent(holder),
        batch_bytes=_nbytes_real(example_inputs) + _nbytes_real(example_targets),
        construction_peak_bytes=int(construction),
        optimizer=optimizer,
        flops_per_s=rate,
        time_source=sources.pop() if len(sources) == 1 else "mixed",
        loss_chunk_options=tuple(sorted(set(chunk_options))),
    )


def _nbytes_real(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _default_real_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(2 * 2**30, int(line.split()[1]) * 1024 // 4)
    except OSError:
        pass
    return 2**30


def _with_time(
    c: BlockCosts,
    full: BlockCosts,
    t_fwd: float | None,
    t_bwd: float | None,
    rate: float,
    src: str,
) -> BlockCosts:
    """Times for a slice: measured whole-batch time scaled by the slice's FLOPs."""
    if t_fwd is None or t_bwd is None:
        return replace(
            c,
            forward_s=c.forward_flops / rate,
            backward_s=c.backward_flops / rate,
            time_source="flops",
        )
    fr = c.forward_flops / full.forward_flops if full.forward_flops else 1.0
    br = c.backward_flops / full.backward_flops if full.backward_flops else 1.0
    return replace(c, forward_s=t_fwd * fr, backward_s=t_bwd * br, time_source=src)


def _is_fake_module(mod: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in mod.parameters())


def _fake_mode_of(mod: nn.Module):  # noqa: ANN202
    for p in mod.parameters():
        return p.fake_mode  # type: ignore[attr-defined]
    return None


@torch.no_grad()
def _input_shapes(
    modules: list[nn.Module], x: torch.Tensor, fake_mode: object
) -> list[torch.Tensor]:
    """Each block's input (fake tensors, for their shapes and dtypes)."""
    ctx: Any = fake_mode if fake_mode is not None else contextlib.nullcontext()
    shapes = []
    with ctx:
        for mod in modules:
            shapes.append(x)
            x = mod(x)
    return shapes


@torch.no_grad()
def _last_input_shape(modules: list[nn.Module], x: torch.Tensor) -> torch.Size | None:
    for mod in modules[:-1]:
        x = mod(x)
    return x.shape if x.is_floating_point() and x.dim() >= 2 else None


def profile_workload_fake(
    factory: Callable[[], nn.Module],
    example_inputs: torch.Tensor,
    example_targets: torch.Tensor,
    loss_fn: LossFn,
    **kwargs: object,
) -> Profile:
    """Profile a model that is never built for real.

    ``factory()`` runs under ``FakeTensorMode``: its parameters are fake tensors (shapes
    and dtypes, no storage), so profiling a model larger than memory costs a few MB.
    Its construction peak (parameters plus anything built and dropped, such as a head
    projection replaced by a tied embedding) is tracked as it runs.

    Args:
        factory: builds the model (e.g. ``lambda: GPT(cfg)``).
        example_inputs, example_targets, loss_fn: as for ``profile_blocks``.
        **kwargs: passed to ``profile_blocks``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = _LiveBytes()
    with mode, tracker:
        model = factory()
        kept = [t for t in (*model.parameters(), *model.buffers())]  # noqa: C416
        construction = tracker.peak
    del kept
    blocks = as_blocks(model)
    kwargs.setdefault("construction_peak_bytes", construction)
    return profile_blocks(blocks, example_inputs, example_targets, loss_fn, **kwargs)  # type: ignore[arg-type]


def loading_from_file(profile: Profile) -> Profile:
    """The profile of a run that reads its weights unit by unit from a file
    (``partition.run.train_workload(init_file=...)``, ``memory.step.train_measured(
    init_state=...)``, see ``memory.materialize``): building the model holds at most
    the largest unit's parameters beyond what stays resident, which every step holds
    anyway."""
    largest = max((b.param_bytes for b in profile.blocks), default=0)
    return replace(profile, construction_peak_bytes=largest)
