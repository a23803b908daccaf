"""The single-device planner: the fastest plan whose predicted peak fits a budget.

Per block the plan chooses what happens to the activations its forward saves (``keep``,
``recompute``, ``offload``) and to its parameters, gradients and AdamW state
(``resident`` or ``stream`` from disk; streaming implies recompute), plus the number of
micro-batches and of loss chunks. ``predict`` is the cost model: the peak of the events
of a step as ``partition.local`` runs it (see docs/memory.md), the step time (compute,
recompute and disk I/O at the measured bandwidth) and the bytes on disk.

The search is exact for the cost model. For each micro-batch count, loss chunk count and
state of the owners of shared parameters, a dynamic programme walks the chain of blocks
keeping, per choice of the previous block, the Pareto set of partial plans over
(time, disk bytes and three memory quantities that fully determine every later event:
see ``_Walker``). A dominated partial plan cannot lead to a better complete plan, so
the optimum is kept; tests check it against brute force.

Example:
    >>> plan = plan_memory(profile, parse_bytes("512MB"), batch_size=4)  # doctest: +SKIP
    >>> plan.predicted_peak_bytes <= 512 * 10**6  # doctest: +SKIP
    True
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from memory.errors import BudgetError, MemoryPlanError
from memory.profile import BlockCosts, BlockProfile, DiskBandwidth, Profile
from memory.sizes import format_bytes
from memory.spec import BlockPlan, MemoryPlan

logger = logging.getLogger(__name__)

KEEP, RECOMPUTE, OFFLOAD, STREAM = "K", "R", "O", "S"
OPTIONS = (KEEP, RECOMPUTE, OFFLOAD, STREAM)
_AS_PLAN = {
    KEEP: ("keep", "resident"),
    RECOMPUTE: ("recompute", "resident"),
    OFFLOAD: ("offload", "resident"),
    STREAM: ("recompute", "stream"),
}

DEFAULT_DISK_SHARE = 0.5
"""Default disk budget: this share of the free space in the offload directory."""

ALLOCATOR_SLACK_FRACTION = 0.03
"""Allocator and bookkeeping overhead on top of the modelled bytes (fraction)."""

ALLOCATOR_SLACK_BYTES = 4 * 2**20
"""... plus this many bytes (interpreter objects, small allocations, page rounding)."""

STREAM_UPDATE_BYTES = 2 * 16 * 2**20
"""Working set of a streamed block's AdamW update (the store maps state in 16 MiB
chunks: ``exp_avg`` and ``exp_avg_sq``)."""

_DEFAULT_DISK = DiskBandwidth("", 200e6, 200e6)


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
class _Model:
    """Per-block numbers for one (micro-batches, loss chunks) setting."""

    def __init__(self, profile: Profile, m: int, c: int) -> None:
        self.profile = profile
        self.m, self.c = m, c
        blocks = profile.blocks
        self.n = len(blocks)
        self.costs: list[BlockCosts] = [b.costs[m] for b in blocks]
        if c > 1:
            self.chunk = blocks[-1].chunk_costs[(m, c)]
        self.base = profile.batch_bytes + sum(b.buffer_bytes for b in blocks)
        max_tensor = max((b.max_param_tensor_bytes for b in blocks), default=0)
        self.opt_temp = 2 * max_tensor  # AdamW's per-tensor temporaries (sqrt, divide)
        names = [b.name for b in blocks]
        self.owner_of = [
            [names.index(o) for o in b.shared_with if o in names] for b in blocks
        ]
        bw = profile.disk or _DEFAULT_DISK
        self.read_s = 1.0 / bw.read_bytes_per_s
        self.write_s = 1.0 / bw.write_bytes_per_s

    def options(self, k: int) -> tuple[str, ...]:
        if self.c > 1 and k == self.n - 1:
            return (RECOMPUTE, STREAM)  # the chunked head always reruns per chunk
        return OPTIONS

    def held_boundary(self, i: int, prev: str, cur: str) -> int:
        """Bytes of block i's input kept from its forward to the backward."""
        if i == 0:
            return 0  # the batch, in base
        a, b = self.costs[i - 1], self.costs[i]
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
        stream = b.param_bytes if cur == STREAM else 0
        return (c.input_bytes if k > 0 else 0) + local + stream + shared

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
        acc = b.grad_bytes if self.m > 1 and cur == STREAM else 0
        if self.c > 1 and last:
            ch = self.chunk
            rerun = max(
                ch.forward_peak_bytes,
                ch.saved_bytes
                + ch.saves_output * ch.output_bytes
                + ch.backward_peak_bytes,
            )
            # the input gradient is assembled whole; the head's gradients accumulate
            local = c.input_bytes + rerun + b.grad_bytes
        elif cur == KEEP:
            local = c.backward_peak_bytes
        elif cur == OFFLOAD:
            local = c.saved_bytes + c.backward_peak_bytes
        else:
            local = max(
                c.forward_peak_bytes,
                c.saved_bytes + c.saves_output * c.output_bytes + c.backward_peak_bytes,
            )
        if cur == STREAM:
            update = b.grad_bytes + c.input_bytes + STREAM_UPDATE_BYTES
            local = b.param_bytes + max(local + acc, update)
        return grad_out + own_out + local + shared

    def resident_po(self, k: int) -> int:
        b = self.profile.blocks[k]
        return b.param_bytes + b.optimizer_state_bytes

    def resident_all(self, k: int) -> int:
        return self.resident_po(k) + self.profile.blocks[k].grad_bytes

    def disk(self, k: int, cur: str) -> int:
        b, c = self.profile.blocks[k], self.costs[k]
        if cur == OFFLOAD:
            return c.saved_bytes
        if cur == STREAM:
            grads = (
                b.grad_bytes
                if (self.m > 1 or self.profile.blocks[k].shared_param_bytes)
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
        if cur == STREAM:
            reads = 2 * m * b.param_bytes + b.optimizer_state_bytes + b.param_bytes
            writes = b.param_bytes + b.optimizer_state_bytes
            if m > 1:
                reads += (m - 1) * b.grad_bytes
                writes += (m - 1) * b.grad_bytes
            t += reads * self.read_s + writes * self.write_s
        return t


def _slack(raw: int) -> int:
    return int(math.ceil(raw * (1 + ALLOCATOR_SLACK_FRACTION))) + ALLOCATOR_SLACK_BYTES


def _unslack(budget: int) -> int:
    """The largest raw peak whose slacked figure fits ``budget``."""
    raw = int((budget - ALLOCATOR_SLACK_BYTES) / (1 + ALLOCATOR_SLACK_FRACTION))
    while raw > 0 and _slack(raw) > budget:
        raw -= 1
    while _slack(raw + 1) <= budget:
        raw += 1
    return raw


# --------------------------------------------------------------------------- predict
def _events(
    model: _Model, choices: Sequence[str]
) -> list[tuple[str, int, dict[str, int]]]:
    """Every event of the step with its raw bytes and a breakdown."""
    p = model.profile
    n = model.n
    streamed = [ch == STREAM for ch in choices]
    po_res = sum(model.resident_po(k) for k in range(n) if not streamed[k])
    g_res = sum(p.blocks[k].grad_bytes for k in range(n) if not streamed[k])
    held = [
        model.held_boundary(i, choices[i - 1] if i else KEEP, choices[i])
        for i in range(n)
    ]
    kept = [model.kept(k, choices[k]) for k in range(n)]
    events = []
    base = model.base
    for j in range(n):
        sh = model.shared_load(j, streamed)
        acts = sum(kept[:j]) + sum(held[:j])
        local = model.forward_local(j, choices[j], sh)
        # later blocks' gradients count as resident (every micro-batch after the first)
        g_later = sum(
            p.blocks[k].grad_bytes for k in range(j + 1, n) if not streamed[k]
        )
        parts = {
            "base": base,
            "resident": po_res + (g_res if model.m > 1 else g_later),
            "activations": acts,
            "local": local,
        }
        events.append((f"forward of {p.blocks[j].name}", sum(parts.values()), parts))
    for j in reversed(range(n)):
        sh = model.shared_load(j, streamed)
        g_later = sum(
            p.blocks[k].grad_bytes for k in range(j + 1, n) if not streamed[k]
        )
        acts = sum(kept[: j + 1]) + sum(held[: j + 1])
        local = model.backward_local(j, choices[j], sh)
        res = po_res + (g_res if model.m > 1 else g_later)
        parts = {"base": base, "resident": res, "activations": acts, "local": local}
        events.append((f"backward of {p.blocks[j].name}", sum(parts.values()), parts))
    parts = {
        "base": base,
        "resident": po_res + g_res,
        "activations": 0,
        "local": model.opt_temp,
    }
    events.append(("optimizer step", sum(parts.values()), parts))
    parts = {
        "base": 0,
        "resident": 0,
        "activations": 0,
        "local": p.construction_peak_bytes,
    }
    events.append(("model construction", p.construction_peak_bytes, parts))
    return events


def predict(profile: Profile, plan: MemoryPlan) -> Prediction:
    """Predicted peak, step time and disk bytes of ``plan`` (the cost model)."""
    choices = _choices_of(plan)
    model = _Model(profile, plan.num_microbatches, plan.loss_chunks)
    return _predict(model, choices)


def _predict(model: _Model, choices: Sequence[str]) -> Prediction:
    events = _events(model, choices)
    name, raw, parts = max(events, key=lambda e: e[1])
    t = sum(model.time(k, ch) for k, ch in enumerate(choices))
    disk = sum(model.disk(k, ch) for k, ch in enumerate(choices))
    return Prediction(_slack(raw), t, disk, name, parts)


def _choices_of(plan: MemoryPlan) -> list[str]:
    inv = {v: k for k, v in _AS_PLAN.items()}
    out = []
    for b in plan.blocks:
        key = (b.activations, b.state)
        if key == ("offload", "stream") or key == ("keep", "stream"):
            key = ("recompute", "stream")
        out.append(inv[key])
    return out


# --------------------------------------------------------------------------- search
@dataclass(frozen=True)
class _State:
    x: int  # max over events so far, plus the resident state added since each
    y: int  # kept activations + resident P+O (m > 1: P+G+O) so far
    z: int  # disk bytes
    t: float
    choices: tuple[str, ...]


def _prune(
    states: list[_State], use_time: bool, use_disk: bool, grid: int = 0
) -> list[_State]:
    """The Pareto-minimal states over (t, z, x, y): a dominated partial plan never
    leads to a better complete plan, since every later quantity grows monotonically in
    each of them. With ``grid`` > 0, x and y are compared rounded up to the grid: a
    quick approximate pass whose result is feasible but perhaps not optimal."""
    if grid:
        rounded = {}
        for s in states:
            key = (-(-s.x // grid), -(-s.y // grid), s.z if use_disk else 0)
            if key not in rounded or s.t < rounded[key].t:
                rounded[key] = s
        states = list(rounded.values())
    if not use_time and not use_disk:
        states.sort(key=lambda s: (s.x, s.y, s.t))
        kept: list[_State] = []
        best_y = None
        for s in states:
            if best_y is None or s.y < best_y:
                kept.append(s)
                best_y = s.y
        return kept
    states.sort(
        key=lambda s: (s.t if use_time else 0.0, s.z if use_disk else 0, s.x, s.y)
    )
    if not use_disk or not use_time:
        # one sort key plus (x, y): a staircase of (x ascending, y descending) points
        stair_x: list[int] = []
        stair_y: list[int] = []
        kept = []
        for s in states:
            i = bisect.bisect_right(stair_x, s.x)
            if i and stair_y[i - 1] <= s.y:
                continue  # some earlier state has x <= s.x and y <= s.y
            kept.append(s)
            j = i
            while j < len(stair_x) and stair_y[j] >= s.y:
                j += 1
            stair_x[i:j] = [s.x]
            stair_y[i:j] = [s.y]
        return kept
    kept = []
    for s in states:
        if not any(q.x <= s.x and q.y <= s.y and q.z <= s.z for q in kept):
            kept.append(s)
    return kept


def _search(
    model: _Model,
    fixed: dict[int, Iterable[str]],
    raw_budget: int | None,
    disk_budget: int | None,
    use_time: bool,
    time_bound: float | None = None,
    grid: int = 0,
) -> list[tuple[int, float, int, tuple[str, ...]]]:
    """Exact search over one setting; returns Pareto (raw peak, time, disk, choices).

    ``time_bound``: drop partial plans that cannot finish faster than this (the time
    of a known feasible plan): branch and bound, still exact. ``grid``: see ``_prune``.

    With ``use_time`` False only the smallest-peak plans are of interest.

    Why the state suffices: let B_k be the resident P+G+O of blocks <= k, PO_k their
    P+O, A_k the activations kept up to block k (own saved tensors and held inputs).
    With m = 1 the backward event of block j is
        base + PO_n + G_{>j} + A_j + local_j = base + (A_j + PO_j) + local_j + (B_n - B_j)
    so with Y = A + PO, ``x = max_j(Y_j + local_j + B_{(j,k]})`` grows by each later
    block's resident state and by nothing else, and the final peak is base + x. Forward
    events are modelled with the later blocks' gradients resident (true for every
    micro-batch after the first), which gives them the same form. With m > 1 the
    gradients are resident all along and Y = A + B. The optimizer step's
    ``base + B_n + temp`` is the initial x = temp.
    """
    n = model.n
    p = model.profile
    m = model.m
    streamed_flags = [STREAM in tuple(fixed.get(k, ())) for k in range(n)]
    use_disk = disk_budget is not None and disk_budget < sum(
        max(model.disk(k, o) for o in model.options(k)) for k in range(n)
    )
    # key: does the previous block keep its output (decides whether our input is held)
    frontier: dict[str, list[_State]] = {KEEP: [_State(model.opt_temp, 0, 0, 0.0, ())]}
    limit = raw_budget - model.base if raw_budget is not None else None
    allowed = [
        tuple(o for o in fixed.get(k, model.options(k)) if o in model.options(k))
        for k in range(n)
    ]
    # the fastest any rest of the chain can be: a lower bound for branch and bound
    rest_s = [0.0] * (n + 1)
    for k in reversed(range(n)):
        rest_s[k] = rest_s[k + 1] + min(model.time(k, o) for o in allowed[k])
    slop = 1e-9 * (1 + (time_bound or 0.0))
    for k in range(n):
        opts = allowed[k]
        sh = model.shared_load(k, streamed_flags)
        saves_out = model.costs[k].saves_output
        new: dict[str, list[_State]] = {}
        for prev, states in frontier.items():
            for cur in opts:
                res = cur != STREAM
                beta = model.resident_all(k) if res else 0
                grow = (beta if m > 1 else model.resident_po(k)) if res else 0
                held = model.held_boundary(k, prev, cur)
                kept = model.kept(k, cur)
                f_local = model.forward_local(k, cur, sh)
                b_local = model.backward_local(k, cur, sh)
                dz = model.disk(k, cur)
                dt = model.time(k, cur)
                key = KEEP if (cur in (KEEP, OFFLOAD) and saves_out) else RECOMPUTE
                bucket = new.setdefault(key, [])
                for s in states:
                    y = s.y + grow + held + kept
                    x = max(s.x + beta, s.y + grow + f_local, y + b_local)
                    z = s.z + dz
                    if limit is not None and x > limit:
                        continue
                    if disk_budget is not None and z > disk_budget:
                        continue
                    t = s.t + dt
                    if time_bound is not None and t + rest_s[k + 1] > time_bound + slop:
                        continue
                    bucket.append(_State(x, y, z, t, (*s.choices, cur)))
        frontier = {c: _prune(v, use_time, use_disk, grid) for c, v in new.items() if v}
        if not frontier:
            return []
    out = []
    for states in frontier.values():
        for s in states:
            raw = max(model.base + s.x, p.construction_peak_bytes)
            out.append((raw, s.t, s.z, s.choices))
    return out


# --------------------------------------------------------------------------- entry
def _settings(
    profile: Profile, microbatching: bool, max_microbatches: int, disk_ok: bool
) -> list[tuple[int, int, dict[int, tuple[str, ...]]]]:
    ms = [m for m in profile.microbatch_options if m <= max_microbatches]
    if not microbatching:
        ms = [1]
    last = profile.blocks[-1]
    owners = sorted(
        {profile.blocks.index(o) for b in profile.blocks for o in _owners(profile, b)}
    )
    resident_opts = (KEEP, RECOMPUTE, OFFLOAD) if disk_ok else (KEEP, RECOMPUTE)
    owner_opts = [resident_opts, (STREAM,)] if disk_ok else [resident_opts]
    out = []
    for m in ms:
        cs = [1] + sorted(c for (mm, c) in last.chunk_costs if mm == m)
        for c in cs:
            for combo in itertools.product(owner_opts, repeat=len(owners)):
                fixed: dict[int, tuple[str, ...]] = dict(zip(owners, combo))
                if not disk_ok:
                    for k in range(len(profile.blocks)):
                        fixed.setdefault(k, resident_opts)
                out.append((m, c, fixed))
    return out


def _owners(profile: Profile, b: BlockProfile) -> list[BlockProfile]:
    by_name = {x.name: x for x in profile.blocks}
    return [by_name[o] for o in b.shared_with if o in by_name]


def _disk_budget(disk_budget_bytes: int | None, offload_dir: str | None) -> int:
    if disk_budget_bytes is not None:
        if disk_budget_bytes < 0:
            raise MemoryPlanError(
                f"disk budget must be >= 0 bytes, got {disk_budget_bytes}"
            )
        return int(disk_budget_bytes)
    directory = offload_dir or tempfile.gettempdir()
    probe = directory
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip(os.sep)) or os.sep
    try:
        free = shutil.disk_usage(probe or os.sep).free
    except OSError:
        return 0
    return int(free * DEFAULT_DISK_SHARE)


def _check_inputs(profile: Profile, budget_bytes: int | None, batch_size: int) -> None:
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool)
        or not isinstance(budget_bytes, int)
        or budget_bytes <= 0
    ):
        raise MemoryPlanError(
            f"memory budget must be a positive number of bytes, got {budget_bytes!r}"
        )
    if batch_size != profile.batch_size:
        raise MemoryPlanError(
            f"the profile was taken at batch size {profile.batch_size} but the plan is "
            f"for {batch_size}; profile the workload at the batch size it will train"
        )


def _best(
    profile: Profile,
    raw_budget: int | None,
    disk_budget: int,
    microbatching: bool,
    max_microbatches: int,
    use_time: bool,
) -> tuple[_Model, tuple[str, ...], int, float] | None:
    """The fastest plan under ``raw_budget`` (or the smallest-peak plan)."""
    best = None
    best_key: tuple[float, float] | None = None
    for m, c, fixed in _settings(
        profile, microbatching, max_microbatches, disk_budget > 0
    ):
        model = _Model(profile, m, c)
        for raw, t, _z, choices in _search(
            model, fixed, raw_budget, disk_budget, use_time
        ):
            if raw_budget is not None and raw > raw_budget:
                continue
            key = (t, raw) if use_time else (raw, t)
            if best_key is None or key < best_key:
                best, best_key = (model, choices, raw, t), key
    return best


def _as_memory_plan(
    model: _Model, choices: Sequence[str], budget: int | None, disk_budget: int
) -> MemoryPlan:
    pred = _predict(model, choices)
    blocks = tuple(
        BlockPlan(b.name, *_AS_PLAN[ch]) for b, ch in zip(model.profile.blocks, choices)
    )
    notes = [f"peak at {pred.peak_event}"]
    if model.profile.disk is None and any(ch in (OFFLOAD, STREAM) for ch in choices):
        notes.append("disk bandwidth not measured: assumed 200 MB/s")
    return MemoryPlan(
        blocks=blocks,
        num_microbatches=model.m,
        loss_chunks=model.c,
        budget_bytes=budget,
        disk_budget_bytes=disk_budget,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_step_s=pred.step_s,
        predicted_disk_bytes=pred.disk_bytes,
        notes=tuple(notes),
    )


def _microbatching(profile: Profile, allow: bool | None, batch_dependent: bool) -> bool:
    dependent = batch_dependent or profile.batch_dependent
    return (not dependent) if allow is None else allow


def _with_bandwidth(
    profile: Profile, disk_budget: int, offload_dir: str | None
) -> Profile:
    if profile.disk is not None or disk_budget == 0:
        return profile
    from memory.profile import measure_disk_bandwidth

    try:
        return profile.with_disk(measure_disk_bandwidth(offload_dir))
    except OSError as e:
        logger.warning("could not measure disk bandwidth in %s (%s)", offload_dir, e)
        return profile


def min_budget_bytes(
    profile: Profile,
    *,
    disk_budget_bytes: int | None = None,
    offload_dir: str | None = None,
    allow_microbatching: bool | None = None,
    batch_dependent: bool = False,
    max_microbatches: int = 16,
) -> int:
    """The smallest memory budget any plan fits, under the disk budget."""
    disk = _disk_budget(disk_budget_bytes, offload_dir)
    mb = _microbatching(profile, allow_microbatching, batch_dependent)
    best = _best(profile, None, disk, mb, max_microbatches, use_time=False)
    assert best is not None
    return _slack(best[2])


def plan_memory(
    profile: Profile,
    budget_bytes: int | None,
    *,
    disk_budget_bytes: int | None = None,
    offload_dir: str | None = None,
    allow_microbatching: bool | None = None,
    batch_size: int,
    batch_dependent: bool = False,
    max_microbatches: int = 16,
) -> MemoryPlan:
    """The fastest plan whose predicted peak fits ``budget_bytes``.

    Args:
        profile: the workload's ``Profile``.
        budget_bytes: the memory budget (peak above the import baseline); None asks
            for the plan with the smallest peak.
        disk_budget_bytes: bytes the plan may keep in ``offload_dir``; 0 forbids
            offload and streaming; None: ``DEFAULT_DISK_SHARE`` of its free space.
        offload_dir: where offloaded activations and streamed state go (default: the
            system's temporary directory); its bandwidth is measured if the profile
            has none.
        allow_microbatching: None: micro-batch unless the model is batch dependent.
        batch_size: the batch the plan trains (must be the profiled one).
        batch_dependent: the model has batch-dependent layers (also read from the
            profile).
        max_microbatches: the most micro-batches to consider.

    Raises:
        MemoryPlanError: a bad budget or batch size.
        BudgetError: no plan fits; it states the smallest budget that would and what
            dominates it.
    """
    _check_inputs(profile, budget_bytes, batch_size)
    disk = _disk_budget(disk_budget_bytes, offload_dir)
    profile = _with_bandwidth(profile, disk, offload_dir)
    mb = _microbatching(profile, allow_microbatching, batch_dependent)
    if budget_bytes is None:
        smallest = _best(profile, None, disk, mb, max_microbatches, use_time=False)
        assert smallest is not None
        raw = smallest[2]
    else:
        raw = _unslack(budget_bytes)
    best = _best(profile, raw, disk, mb, max_microbatches, use_time=True)
    if best is None:
        assert budget_bytes is not None
        raise _budget_error(profile, budget_bytes, disk, mb, max_microbatches)
    model, choices, _raw, _t = best
    return _as_memory_plan(model, choices, budget_bytes, disk)


def _budget_error(
    profile: Profile, budget: int, disk: int, mb: bool, max_microbatches: int
) -> BudgetError:
    smallest = _best(profile, None, disk, mb, max_microbatches, use_time=False)
    assert smallest is not None
    model, choices, raw, _t = smallest
    need = _slack(raw)
    pred = _predict(model, choices)
    dominant = _dominant(model, choices, pred)
    where = (
        "with no disk (disk budget 0)"
        if disk == 0
        else f"with a disk budget of {format_bytes(disk)}"
    )
    return BudgetError(
        f"no plan fits a memory budget of {format_bytes(budget)} ({budget} bytes) {where}: "
        f"the smallest budget that fits is {format_bytes(need)} ({need} bytes), its peak "
        f"at the {pred.peak_event} dominated by {dominant}; raise the budget"
        + ("" if disk else ", allow disk for offload and streaming")
        + " or train a smaller batch or model",
        budget_bytes=budget,
        min_budget_bytes=need,
        dominant=dominant,
    )


def _dominant(model: _Model, choices: Sequence[str], pred: Prediction) -> str:
    parts = pred.breakdown
    what = max(parts, key=lambda k: parts[k])
    size = format_bytes(parts[what])
    names = [b.name for b in model.profile.blocks]
    if pred.peak_event == "model construction":
        return f"building the model ({size}: its parameters and buffers)"
    if what == "resident":
        res = [n for n, ch in zip(names, choices) if ch != STREAM]
        shown = ", ".join(res[:6]) + (", ..." if len(res) > 6 else "")
        return f"resident parameters, gradients and optimizer state of blocks {shown} ({size})"
    if what == "activations":
        return f"activations kept for backward ({size})"
    if what == "base":
        return f"the batch and buffers ({size})"
    block = pred.peak_event.split(" of ", 1)[-1]
    if block == names[-1]:
        return (
            f"the last block's own working memory, the head's logits and loss ({size})"
        )
    return f"block {block}'s own working memory ({size})"
