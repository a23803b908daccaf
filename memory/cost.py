"""The memory and time model of a training step: what every planner asks.

Per unit (a block of the model's chain: ``memory.profile.BlockProfile``), the model
knows its bytes of state (parameters, gradients, AdamW state), of activations kept
from its forward to its backward, recomputed (only its input kept) or offloaded, and the
transient peaks of its forward, backward and optimizer update, in each setting of
micro-batches and loss chunks. ``events`` lists every event of a step as
``partition.local`` runs it (see docs/memory.md) with its bytes; the peak is their
maximum, with the allocator slack (``slack``). The same events priced over a span of
units with micro-batches in flight are a pipeline stage's (``price_stage``): the stage
planner of ``partition.planner`` and the GPU layouts of ``partition.gpu`` ask this
module, as the single-device search of ``memory.plan`` does.

Example:
    >>> pred = predict(profile, MemoryPlan.plain(names))  # doctest: +SKIP
    >>> pred.peak_bytes, pred.peak_event  # doctest: +SKIP
    (734003200, 'backward of lm_head')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from memory.errors import MemoryPlanError
from memory.profile import BlockCosts, DiskBandwidth, Profile
from memory.spec import Activations, MemoryPlan, State

KEEP, RECOMPUTE, OFFLOAD, STREAM, INPUTS_TO_DISK = "K", "R", "O", "S", "D"
OPTIONS = (KEEP, RECOMPUTE, OFFLOAD, STREAM, INPUTS_TO_DISK)
CHAIN_OPTIONS = (KEEP, RECOMPUTE, OFFLOAD, STREAM)
"""What a block allows when its profile names no options (the chain executor's)."""
AS_PLAN: dict[str, tuple[Activations, State, bool]] = {
    KEEP: ("keep", "resident", False),
    RECOMPUTE: ("recompute", "resident", False),
    OFFLOAD: ("offload", "resident", False),
    STREAM: ("recompute", "stream", False),
    INPUTS_TO_DISK: ("recompute", "resident", True),  # recompute, inputs on disk
}

ALLOCATOR_SLACK_FRACTION = 0.05
"""Allocator and bookkeeping overhead on top of the modelled bytes (fraction). At 0.03
the transformers ViT's plan at a third of its plain peak was predicted within 0.01% of
its measured peak and the run-time guard stopped it 0.1 MiB over the budget (a
plan fills its budget). At 0.05, with the runtime measured per workload
(``memory.overhead.workload_runtime_bytes``), the test suite's transformers plans were
predicted 0.97-1.07x their measured peaks, but CI's machine measured T5's plan at a
third 0.3-1.1 MiB over its budget, at 0.07 and again at 0.09: there that plan's
anonymous memory was 11.2 MiB above this machine's for the same plan (the T5 plan
with 16 loss chunks: 105.8 MiB against 94.6). The likely cause is MKL's pool of
matrix-multiply work buffers, memory no tensor shows, sized by the CPU's MKL code
path: it held 8.4 MiB of that plan's step here (CI's CPU is not known to this
session). Measuring children now run with the pool off (``memory.measure.CHILD_ENV``), and at 0.05 the transformers rows measure
0.97-1.06x their raw modelled bytes (every row within its slacked figure); the 0.09
that covered the pool over-predicted the smallest plans by up to 18% without it."""

ALLOCATOR_SLACK_BYTES = 4 * 2**20
"""... plus this many bytes (interpreter objects, small allocations, page rounding)."""

STREAM_CHUNK_BYTES = 16 * 2**20
"""The store maps a streamed tensor's AdamW state in chunks of at most this size."""


STREAM_UPDATE_CHUNKS = 5
"""Chunk-sized buffers alive at the peak of a streamed tensor's AdamW update: its
``exp_avg`` and ``exp_avg_sq`` mapped and the functional AdamW's temporaries (measured
with resident-set figures on a streamed transformers head: 40 MiB for one 8 MiB
tensor)."""


def stream_update_bytes(max_tensor_bytes: int) -> int:
    """Working set of a streamed block's AdamW update: ``STREAM_UPDATE_CHUNKS``
    chunks of its largest tensor (a chunk is at most ``STREAM_CHUNK_BYTES``)."""
    return STREAM_UPDATE_CHUNKS * min(STREAM_CHUNK_BYTES, max_tensor_bytes)


DEFAULT_DISK = DiskBandwidth("", 200e6, 200e6)


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` says about one plan.

    Attributes:
        peak_bytes: predicted peak above the import baseline, slack included.
        step_s: predicted time of one step.
        disk_bytes: bytes on disk at once (offloaded activations, streamed state).
        peak_event: the event that sets the peak, in words.
        breakdown: that event's bytes by component.
    """

    peak_bytes: int
    step_s: float
    disk_bytes: int
    peak_event: str
    breakdown: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- the model
class CostModel:
    """Per-block numbers for one (micro-batches, loss chunks) setting.

    Args:
        profile: the units' measured (or analytic) costs.
        m: micro-batches per step on this device, run one after another (their
            gradients accumulate when ``m > 1``).
        c: loss chunks of the last unit (1: the head unchunked).
        slices: the batch's share each unit's costs are taken at (the profile's
            ``costs[slices]``); default ``m``. A pipeline with ``d`` data-parallel
            replicas runs ``m`` micro-batches of ``1/(d*m)`` of the batch each.
    """

    def __init__(
        self, profile: Profile, m: int, c: int, *, slices: int | None = None
    ) -> None:
        self.profile = profile
        self.m, self.c = m, c
        blocks = profile.blocks
        self.n = len(blocks)
        self.costs: list[BlockCosts] = [b.costs[slices or m] for b in blocks]
        if c > 1:
            self.chunk = blocks[-1].chunk_costs[(m, c)]
        self.base = (
            profile.batch_bytes
            + sum(b.buffer_bytes for b in blocks)
            + profile.runtime_bytes
        )
        self.opt_temp = self.optimizer_temp([False] * self.n)
        # A resident block's gradients while they are alive. A unit that borrows a
        # tied parameter (a head tied to the embedding) holds that parameter's
        # gradient too: autograd keeps it in the shared leaf's buffer from the
        # borrower's backward until the owner's (the unit path; a borrower is
        # resident only with a resident owner).
        self.grads = [
            b.grad_bytes + (b.shared_param_bytes if profile.update_by_chunks else 0)
            for b in blocks
        ]
        names = [b.name for b in blocks]
        self.owner_of = [
            [names.index(o) for o in b.shared_with if o in names] for b in blocks
        ]
        self.lenders = {o for owners in self.owner_of for o in owners}
        bw = profile.disk or DEFAULT_DISK
        self.read_s = 1.0 / bw.read_bytes_per_s
        self.write_s = 1.0 / bw.write_bytes_per_s

    def optimizer_temp(
        self, streamed: Sequence[bool], span: tuple[int, int] | None = None
    ) -> int:
        """AdamW's per-tensor temporaries (sqrt, divide) in the optimizer step of
        the blocks not ``streamed`` (a streamed block updates in its backward, a
        chunk at a time), of the units in ``span`` (default: all)."""
        a, b = span if span is not None else (0, self.n)
        blocks = self.profile.blocks
        return 2 * max(
            (blocks[k].max_param_tensor_bytes for k in range(a, b) if not streamed[k]),
            default=0,
        )

    def options(self, k: int) -> tuple[str, ...]:
        allowed = self.profile.blocks[k].options or CHAIN_OPTIONS
        if self.c > 1 and k == self.n - 1:
            # the chunked head always reruns per chunk
            return tuple(o for o in (RECOMPUTE, STREAM) if o in allowed)
        return tuple(o for o in OPTIONS if o in allowed)

    def held_boundary(self, i: int, prev: str, cur: str) -> int:
        """Bytes of block i's input kept from its forward to the backward."""
        if i == 0:
            return 0  # the batch, in base
        a, b = self.costs[i - 1], self.costs[i]
        if cur == INPUTS_TO_DISK:  # on disk, unless the previous block keeps it
            return b.input_bytes if prev in (KEEP, OFFLOAD) and a.saves_output else 0
        if cur in (RECOMPUTE, STREAM):
            return b.input_bytes
        if prev in (KEEP, OFFLOAD) and a.saves_output:
            return b.input_bytes
        if cur in (KEEP, OFFLOAD) and b.saves_input:
            return b.input_bytes
        return 0

    def kept(self, k: int, cur: str) -> int:
        return self.costs[k].saved_bytes if cur == KEEP else 0

    def shared_load(self, k: int, streamed: Sequence[bool]) -> int:
        b = self.profile.blocks[k]
        if not b.shared_param_bytes:
            return 0
        return b.shared_param_bytes if any(streamed[o] for o in self.owner_of[k]) else 0

    def forward_local(self, k: int, cur: str, shared: int) -> int:
        """Forward event of block k beyond the kept prefix and resident state."""
        c = self.costs[k]
        if self.c > 1 and k == self.n - 1:
            local = self.chunk.forward_no_grad_peak_bytes
        else:
            local = (
                c.forward_peak_bytes
                if cur in (KEEP, OFFLOAD)
                else c.forward_no_grad_peak_bytes
            )
        b = self.profile.blocks[k]
        own, lent = self.rows(k, cur, shared)
        stream = b.param_bytes - own if cur == STREAM else 0
        rows = c.row_load_bytes if own or lent else 0
        return (c.input_bytes if k > 0 else 0) + local + stream + rows + shared - lent

    def rows(self, k: int, cur: str, shared: int) -> tuple[int, int]:
        """Bytes of block k's own and borrowed parameters streamed by rows in this
        setting (``memory.streaming``): its own when it is streamed, a borrowed one
        when its owner is (``shared`` > 0)."""
        b = self.profile.blocks[k]
        return (b.row_param_bytes if cur == STREAM else 0), (
            b.row_shared_bytes if shared else 0
        )

    def backward_peak(self, k: int, cur: str, shared: int) -> int:
        """Block k's ``backward_peak_bytes``, its row-streamed parameters' dense
        gradients replaced by their row pieces when they are streamed by rows."""
        c = self.costs[k]
        own, lent = self.rows(k, cur, shared)
        if not (own or lent):
            return c.backward_peak_bytes
        dense = min(c.backward_peak_bytes, c.row_dense_grad_bytes)
        return c.backward_peak_bytes - dense + c.row_load_bytes + c.row_grad_bytes

    def backward_local(self, k: int, cur: str, shared: int) -> int:
        """Backward event of block k beyond the kept prefix (itself included)."""
        c = self.costs[k]
        b = self.profile.blocks[k]
        last = k == self.n - 1
        grad_out = 0 if last else c.output_bytes
        own_out = (
            c.output_bytes
            if (cur in (KEEP, OFFLOAD) and c.saves_output and not last)
            else 0
        )
        own, lent = self.rows(k, cur, shared)
        peak = self.backward_peak(k, cur, shared)
        # the chain executor adds a micro-batch's gradients to the whole mapped
        # accumulator; the unit path adds them a chunk at a time after unmapping the
        # parameters (inside ``update`` below)
        acc = (
            b.grad_bytes - own
            if self.m > 1 and cur == STREAM and not self.profile.update_by_chunks
            else 0
        )
        if self.c > 1 and last:
            ch = self.chunk
            rerun = max(
                ch.forward_peak_bytes,
                ch.saved_bytes
                + ch.saves_output * ch.output_bytes
                + ch.backward_peak_bytes,
            )
            # The input gradient is assembled whole and the head's gradients
            # accumulate, a borrowed (tied) one included; from the second chunk on,
            # autograd computes each chunk's parameter gradients into fresh tensors
            # before adding them, so one more copy of them is alive.
            borrowed_grad = b.shared_param_bytes if shared else 0
            temp = b.grad_bytes + b.shared_param_bytes
            local = c.input_bytes + rerun + b.grad_bytes + borrowed_grad + temp
        elif cur == KEEP:
            local = c.backward_peak_bytes
        elif cur == OFFLOAD:
            local = c.saved_bytes + c.backward_peak_bytes
        else:
            local = max(
                c.forward_peak_bytes,
                c.saved_bytes + c.saves_output * c.output_bytes + peak,
            )
            if cur == INPUTS_TO_DISK:
                local += c.input_bytes  # read back for the rerun
        if cur == STREAM:
            # the update maps the store's accumulated gradients too, when there are
            # any (micro-batches, a tied parameter's other uses)
            stored = b.grad_bytes if (self.m > 1 or k in self.lenders or own) else 0
            work = stream_update_bytes(b.max_param_tensor_bytes)
            # row-streamed gradients are in the store by now
            held = b.grad_bytes - own
            params = b.param_bytes - own
            if self.profile.update_by_chunks:
                # parameters unmapped first, then mapped a chunk at a time with the
                # state (inside ``work``) and, when there are any, the stored gradients
                chunk = min(STREAM_CHUNK_BYTES, b.max_param_tensor_bytes)
                update = held + c.input_bytes + work + chunk * (stored > 0)
                local = max(params + local + acc, update)
            else:
                update = held + stored + c.input_bytes + work
                local = params + max(local + acc, update)
        return grad_out + own_out + local + shared - lent

    def tied_grad(self, k: int) -> int:
        """The borrowed (tied) gradient in ``grads[k]``: alive in autograd's buffer
        whenever the owner is resident, whatever block k does."""
        return self.grads[k] - self.profile.blocks[k].grad_bytes

    def held_grad(self, k: int, streamed: Sequence[bool]) -> int:
        """Gradient bytes block k keeps in memory in this plan."""
        if not streamed[k]:
            return self.grads[k]
        return self.tied_grad(k) if not self.shared_load(k, streamed) else 0

    def resident_po(self, k: int) -> int:
        b = self.profile.blocks[k]
        return b.param_bytes + b.optimizer_state_bytes

    def resident_all(self, k: int) -> int:
        return self.resident_po(k) + self.grads[k]

    def disk(self, k: int, cur: str) -> int:
        b, c = self.profile.blocks[k], self.costs[k]
        if cur == OFFLOAD:
            return c.saved_bytes
        if cur == INPUTS_TO_DISK:
            return c.input_bytes
        if cur == STREAM:
            grads = (
                b.grad_bytes
                if (self.m > 1 or b.shared_param_bytes or b.row_param_bytes)
                else 0
            )
            return b.param_bytes + b.optimizer_state_bytes + grads
        return 0

    def time(self, k: int, cur: str) -> float:
        c, b, m = self.costs[k], self.profile.blocks[k], self.m
        if self.c > 1 and k == self.n - 1:
            ch = self.chunk
            t = m * self.c * (ch.forward_s * 2 + ch.backward_s)
        elif cur == KEEP:
            t = m * (c.forward_s + c.backward_s)
        elif cur == OFFLOAD:
            t = m * (
                c.forward_s
                + c.backward_s
                + c.saved_bytes * (self.write_s + self.read_s)
            )
        else:
            t = m * (2 * c.forward_s + c.backward_s)
        if cur == INPUTS_TO_DISK:
            t += m * c.input_bytes * (self.write_s + self.read_s)
        if cur == STREAM:
            # a row-streamed parameter is read a micro-batch's rows at a time, its
            # gradient written to the store and read back by the update
            own = b.row_param_bytes
            loads = b.param_bytes - own + (c.row_load_bytes if own else 0)
            reads = 2 * m * loads + b.optimizer_state_bytes + b.param_bytes + own
            writes = b.param_bytes + b.optimizer_state_bytes + own
            if m > 1:
                reads += (m - 1) * (b.grad_bytes - own)
                writes += (m - 1) * (b.grad_bytes - own)
            t += reads * self.read_s + writes * self.write_s
        return t


def slack(raw: int) -> int:
    return int(math.ceil(raw * (1 + ALLOCATOR_SLACK_FRACTION))) + ALLOCATOR_SLACK_BYTES


def unslack(budget: int) -> int:
    """The largest raw peak whose slacked figure fits ``budget``."""
    raw = int((budget - ALLOCATOR_SLACK_BYTES) / (1 + ALLOCATOR_SLACK_FRACTION))
    while raw > 0 and slack(raw) > budget:
        raw -= 1
    while slack(raw + 1) <= budget:
        raw += 1
    return raw


# --------------------------------------------------------------------------- events
Event = tuple[str, int, dict[str, int]]
"""(what happens, raw bytes alive, those bytes by component)."""


def events(
    model: CostModel,
    choices: Sequence[str],
    *,
    span: tuple[int, int] | None = None,
    in_flight: float = 1,
    base_bytes: int | None = None,
) -> list[Event]:
    """Every event of a step with its raw bytes and a breakdown.

    With the defaults, the step of the whole chain on one device. With ``span`` (units
    ``a..b-1``, ``choices`` for those units only) it is a pipeline stage's: its own
    state resident, ``in_flight`` micro-batches' kept activations alive at once (the
    other ``in_flight - 1`` held through each event of the one in its forward or
    backward), and ``base_bytes`` instead of the whole batch (the stage's micro-batch
    inputs, receive buffers, runtime). A stage has no construction event (its model
    is built before its first step, its peak is its step's).
    """
    p = model.profile
    a, b = span if span is not None else (0, model.n)
    assert len(choices) == b - a, (len(choices), a, b)
    ks = range(a, b)
    ch = {k: choices[k - a] for k in ks}
    # a unit outside the span is resident on another device: never streamed here
    streamed = [ch.get(k) == STREAM for k in range(model.n)]
    po_res = sum(model.resident_po(k) for k in ks if not streamed[k])
    # own gradients; a tied one (``held_grad`` less own) only in backward events
    # from the borrower's backward down to the owner's
    own_g = {k: p.blocks[k].grad_bytes if not streamed[k] else 0 for k in ks}
    tied = {k: model.held_grad(k, streamed) - own_g[k] for k in ks}
    g_res = sum(own_g.values())
    # a stage's first unit holds its received input like a unit after a recompute
    held = {
        k: model.held_boundary(k, ch[k - 1] if k > a else RECOMPUTE, ch[k]) for k in ks
    }
    kept = {k: model.kept(k, ch[k]) for k in ks}
    # the other micro-batches in flight hold everything this stage keeps for them
    others = int((in_flight - 1) * (sum(kept.values()) + sum(held.values())))
    base = model.base if base_bytes is None else base_bytes
    out: list[Event] = []
    for j in ks:
        sh = model.shared_load(j, streamed)
        acts = others + sum(kept[k] + held[k] for k in range(a, j))
        local = model.forward_local(j, ch[j], sh)
        # later units' gradients count as resident (every micro-batch after the first)
        g_later = sum(own_g[k] for k in range(j + 1, b))
        parts = {
            "base": base,
            "resident": po_res + (g_res if model.m > 1 else g_later),
            "activations": acts,
            "local": local,
        }
        out.append((f"forward of {p.blocks[j].name}", sum(parts.values()), parts))
    for j in reversed(ks):
        sh = model.shared_load(j, streamed)
        g_later = sum(own_g[k] for k in range(j + 1, b))
        waiting = sum(
            tied[k]
            for k in range(j + 1, b)
            if tied[k] and min(model.owner_of[k], default=model.n) <= j
        )
        acts = others + sum(kept[k] + held[k] for k in range(a, j + 1))
        local = model.backward_local(j, ch[j], sh)
        res = po_res + (g_res if model.m > 1 else g_later) + waiting
        parts = {"base": base, "resident": res, "activations": acts, "local": local}
        out.append((f"backward of {p.blocks[j].name}", sum(parts.values()), parts))
    parts = {
        "base": base,
        "resident": po_res + g_res,
        "activations": 0,
        "local": model.optimizer_temp(streamed, span=(a, b)),
    }
    out.append(("optimizer step", sum(parts.values()), parts))
    if span is None:
        parts = {
            "base": 0,
            "resident": 0,
            "activations": 0,
            "local": p.construction_peak_bytes,
        }
        out.append(("model construction", p.construction_peak_bytes, parts))
    return out


def activation_bytes(
    model: CostModel, choices: Sequence[str], span: tuple[int, int]
) -> int:
    """Bytes one micro-batch holds from its forward to its backward in units
    ``span`` (kept activations and held inputs: what ``events`` counts once per
    micro-batch in flight)."""
    a, b = span
    total = 0
    for k in range(a, b):
        prev = choices[k - 1 - a] if k > a else RECOMPUTE
        total += model.kept(k, choices[k - a])
        total += model.held_boundary(k, prev, choices[k - a])
    return total


@dataclass(frozen=True)
class StagePrice:
    """What a pipeline stage (a span of units) costs in memory.

    Attributes:
        peak_bytes: its predicted peak, slack included (``slack``).
        raw_bytes: the same without slack.
        activation_bytes: held per micro-batch from its forward to its backward.
        static_bytes: ``raw_bytes`` less ``in_flight`` micro-batches' activations:
            what the event simulator adds to the activations it finds in flight.
        peak_event: the event that sets the peak, in words.
    """

    peak_bytes: int
    raw_bytes: int
    activation_bytes: int
    static_bytes: int
    peak_event: str


def price_stage(
    model: CostModel,
    span: tuple[int, int],
    choices: Sequence[str],
    *,
    in_flight: float,
    base_bytes: int,
) -> StagePrice:
    """The peak of units ``span`` run as one pipeline stage with ``in_flight``
    micro-batches held at once (see ``events``)."""
    evs = events(model, choices, span=span, in_flight=in_flight, base_bytes=base_bytes)
    name, raw, _ = max(evs, key=lambda e: e[1])
    act = activation_bytes(model, choices, span)
    return StagePrice(slack(raw), raw, act, raw - int(in_flight * act), name)


def predict(profile: Profile, plan: MemoryPlan) -> Prediction:
    """Predicted peak, step time and disk bytes of ``plan`` (the cost model)."""
    choices = choices_of(plan)
    c = plan.loss_chunks
    if profile.loss_chunk_setting > 1 or not profile.blocks[-1].chunk_costs:
        if c != profile.loss_chunk_setting:
            raise MemoryPlanError(
                f"the plan has {c} loss chunks but the profile was made with "
                f"{profile.loss_chunk_setting}; profile with loss_chunks={c}"
            )
        c = 1  # the chunked head is inside every block's costs
    model = CostModel(profile, plan.num_microbatches, c)
    return predict_choices(model, choices)


def predict_choices(model: CostModel, choices: Sequence[str]) -> Prediction:
    name, raw, parts = max(events(model, choices), key=lambda e: e[1])
    t = sum(model.time(k, ch) for k, ch in enumerate(choices))
    disk = sum(model.disk(k, ch) for k, ch in enumerate(choices))
    return Prediction(slack(raw), t, disk, name, parts)


def choices_of(plan: MemoryPlan) -> list[str]:
    inv = {v: k for k, v in AS_PLAN.items()}
    out = []
    for b in plan.blocks:
        key = (b.activations, b.state, b.offload_inputs)
        if b.state == "stream":
            key = ("recompute", "stream", False)
        out.append(inv[key])
    return out
