"""A profile: what each block of a training step costs, as plain data.

A ``Profile`` holds, per block (``BlockProfile``), the bytes of its state (parameters,
gradients, optimizer state, buffers) and, for each number of micro-batches the planner
may choose, its activation costs and times (``BlockCosts``); the last block also for
each number of loss chunks. ``Profile.to_dict``/``Profile.from_dict`` round-trip it
through JSON-ready dicts. ``memory.plan`` and ``partition.planner`` plan from it.

Profiles are made by ``memory.chain_profile`` (a model run as a chain of blocks, on
fake tensors) and ``memory.unit_profile`` (any model, per unit, under hooks); the disk
bandwidth by ``memory.probes.measure_disk_bandwidth``. ``loading_from_file(profile)``
is the profile of a run that reads its weights from a file.

Example:
    >>> from memory.chain_profile import profile_workload_fake  # doctest: +SKIP
    >>> prof = profile_workload_fake(lambda: GPT(cfg), x, y, lm_loss)  # doctest: +SKIP
    >>> print(prof.table())  # doctest: +SKIP
    >>> Profile.from_dict(prof.to_dict()) == prof  # doctest: +SKIP
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from memory.sizes import format_bytes


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
        batch_bytes: bytes alive the whole step outside the blocks: the example
            inputs and targets, and what no block holds (parameters outside every
            unit with their gradients and optimizer state,
            ``memory.unit_profile.outside_state_bytes``; what a part keeps,
            ``server.assign``).
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
    loss_chunk_refusal: str | None = None

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


def loading_from_file(profile: Profile) -> Profile:
    """The profile of a run that reads its weights unit by unit from a file
    (``partition.run.train_workload(init_file=...)``, ``memory.step.train_measured(
    init_state=...)``, see ``memory.materialize``): building the model holds at most
    the largest unit's parameters beyond what stays resident, which every step holds
    anyway."""
    largest = max((b.param_bytes for b in profile.blocks), default=0)
    return replace(profile, construction_peak_bytes=largest)
