"""The single-device planner: the fastest plan whose predicted peak fits a budget.

Per block the plan chooses what happens to the activations its forward saves (``keep``,
``recompute``, ``offload``) and to its parameters, gradients and AdamW state
(``resident`` or ``stream`` from disk; streaming implies recompute), plus the number of
micro-batches and of loss chunks. ``predict`` is the cost model: the peak of the events
of a step as ``partition.local`` runs it (see docs/memory.md), the step time (compute,
recompute and disk I/O at the measured bandwidth) and the bytes on disk.

The search is exact for the cost model. For each micro-batch count and state of the
owners of shared parameters (loss chunk counts are options of the last block), a
dynamic programme walks the chain of blocks keeping, per class of the previous block,
the Pareto set of partial plans over (exact time, disk bytes and two memory quantities
that determine every later event: see ``_Step`` and ``_bounds``). A dominated partial
plan cannot lead to a better complete plan, so the optimum is kept; branch and bound
with a lower bound on the rest of the chain (tabulated backwards) and a cut from a
quick dive keeps the sets small. Tests check it against brute force.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from memory.cost import (
    AS_PLAN,
    CHAIN_OPTIONS,
    INPUTS_TO_DISK,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    STREAM,
    CostModel,
    Prediction,
    predict_choices,
    slack,
    unslack,
)
from memory.errors import BudgetError, MemoryPlanError
from memory.profile import BlockProfile, Profile
from memory.sizes import format_bytes
from memory.spec import BlockPlan, MemoryPlan

logger = logging.getLogger(__name__)

DEFAULT_DISK_SHARE = 0.5
"""Default disk budget: this share of the free space in the offload directory."""

# --------------------------------------------------------------------------- search
_CLASSES = (KEEP, RECOMPUTE)
"""Search keys, as the next block sees a block: it holds its output for the backward
(keeps or offloads and saves it) or not."""

_NO_EVENT = -(2**62)  # the empty rest of the chain adds no event
_TIME_SLOP = 1e-12  # relative: float sums of the same times in another order


@dataclass(frozen=True)
class _Step:
    """One option of one block, as the search sees it.

    A partial plan is summed up by (x, y): this option turns it into
    (max(x + beta, y + c[prev]), y + a[prev]), where ``prev`` indexes ``_CLASSES`` for
    the previous block, and adds ``dz`` bytes on disk and ``dt`` seconds.

    Why (x, y) suffices: let B_k be the resident P+G+O of blocks <= k, PO_k their
    P+O, A_k the activations kept up to block k (own saved tensors and held inputs).
    With m = 1 the backward event of block j is
        base + PO_n + G_{>j} + A_j + local_j = base + (A_j + PO_j) + local_j + (B_n - B_j)
    so with y = A + PO, x = max_j(y_j + local_j + B_{(j,k]}) grows by each later
    block's resident state (beta) and by nothing else, and the final peak is base + x.
    Forward events are modelled with the later blocks' gradients resident (true for
    every micro-batch after the first), which gives them the same form. With m > 1
    the gradients are resident all along and y = A + B. The optimizer step's
    base + B_n + temp is the initial x = temp.
    """

    cur: str
    out: int  # this block's index in _CLASSES, for the next block
    beta: int
    a: tuple[int, int]
    c: tuple[int, int]
    dz: int
    dt: float
    chunks: int  # the loss chunks of the setting this step belongs to (last block)


def _steps(
    model: CostModel, fixed: dict[int, tuple[str, ...]], cache: dict[tuple, list[_Step]]
) -> list[list[_Step]]:
    """Every allowed option of every block as a ``_Step``; rows shared by settings
    (a block's row depends on the setting only through these keys) come from
    ``cache``."""
    streamed = [STREAM in fixed.get(k, ()) for k in range(model.n)]
    table = []
    for k in range(model.n):
        opts = tuple(o for o in fixed.get(k, model.options(k)) if o in model.options(k))
        sh = model.shared_load(k, streamed)
        key = (model.m, model.c if k == model.n - 1 else 0, k, opts, sh)
        if key in cache:
            table.append(cache[key])
            continue
        saves_out = model.costs[k].saves_output
        row = []
        for cur in opts:
            res = cur != STREAM
            if res:
                beta = model.resident_all(k)
                grow = beta if model.m > 1 else model.resident_po(k)
            else:  # a tied gradient for a resident owner stays in memory
                beta = 0 if sh else model.tied_grad(k)
                grow = beta if model.m > 1 else 0
            kept = model.kept(k, cur)
            f = grow + model.forward_local(k, cur, sh)
            b = model.backward_local(k, cur, sh)
            a0, a1 = (grow + model.held_boundary(k, p, cur) + kept for p in _CLASSES)
            out = 0 if (cur in (KEEP, OFFLOAD) and saves_out) else 1
            row.append(
                _Step(
                    cur,
                    out,
                    beta,
                    (a0, a1),
                    (max(f, a0 + b), max(f, a1 + b)),
                    model.disk(k, cur),
                    model.time(k, cur),
                    model.c if k == model.n - 1 else 1,
                )
            )
        cache[key] = row
        table.append(row)
    return table


class _Chain(NamedTuple):
    """What a search over one setting's chain found."""

    raw_bytes: int  # _smallest: the raw peak; _fastest: x, the peak less the base
    time: float | int  # _smallest: seconds; _fastest: the exact time in ticks
    steps: tuple[_Step, ...]  # one per block


class _Found(NamedTuple):
    """The plan ``_best`` chose."""

    model: CostModel
    choices: tuple[str, ...]
    raw_bytes: int  # its raw peak (no slack)
    step_s: float


class _Group(NamedTuple):
    """Settings searched as one chain (they differ only in loss chunks)."""

    fixed: dict[int, tuple[str, ...]]  # blocks whose options the setting fixes
    models: list[CostModel]  # one per loss chunk count
    steps: list[list[_Step]]


# Search states are plain tuples, for speed; their fields by position:
# _smallest: (x, y, z, t, choices); _fastest: (exact time, x, y, z, t, t + bound,
# choices), where choices is a linked list (step, rest) read by ``_unlink``.
_X, _Y, _Z, _T = 0, 1, 2, 3  # in _smallest's states
_TE, _FX, _FY, _FZ, _FT, _FB = 0, 1, 2, 3, 4, 5  # in _fastest's states


def _unlink(linked: tuple | None) -> tuple[_Step, ...]:
    out = []
    while linked is not None:
        out.append(linked[0])
        linked = linked[1]
    return tuple(reversed(out))


def _smallest(
    model: CostModel, steps: list[list[_Step]], disk_budget: int | None
) -> _Chain | None:
    """The plan with the smallest raw peak, or None.

    Pareto sets over (z, x, y) only: time does not matter here."""
    use_disk = _disk_binds(steps, disk_budget)
    # state: (x, y, z, t, choices as a linked list)
    frontier: dict[int, list[tuple]] = {0: [(model.opt_temp, 0, 0, 0.0, None)]}
    for row in steps:
        new: dict[int, list[tuple]] = {}
        for prev, states in frontier.items():
            for st in row:
                a, c, beta, dz, dt = st.a[prev], st.c[prev], st.beta, st.dz, st.dt
                bucket = new.setdefault(st.out, [])
                for x, y, z, t, ch in states:
                    if use_disk and z + dz > disk_budget:
                        continue
                    x2 = x + beta if x + beta > y + c else y + c
                    bucket.append((x2, y + a, z + dz, t + dt, (st, ch)))
        frontier = {}
        for key, states in new.items():
            if use_disk:
                states.sort(key=lambda s: (s[_Z], s[_X], s[_Y]))
                kept = _staircase(states, _X, _Y)
            else:
                states.sort(key=lambda s: (s[_X], s[_Y], s[_T]))
                kept, best_y = [], None
                for s in states:
                    if best_y is None or s[_Y] < best_y:
                        kept.append(s)
                        best_y = s[_Y]
            if kept:
                frontier[key] = kept
        if not frontier:
            return None
    x, _y, _z, t, ch = min(
        (s for states in frontier.values() for s in states),
        key=lambda s: (s[_X], s[_T]),
    )
    raw = max(model.base + x, model.profile.construction_peak_bytes)
    return _Chain(raw, t, _unlink(ch))


def _staircase(states: list[tuple], ix: int, iy: int) -> list[tuple]:
    """States, in an order where no state is dominated by a later one, less those
    that an earlier state dominates in (s[ix], s[iy])."""
    stair_x: list[int] = []
    stair_y: list[int] = []
    kept = []
    for s in states:
        sx, sy = s[ix], s[iy]
        i = bisect.bisect_right(stair_x, sx)
        if i and stair_y[i - 1] <= sy:
            continue  # an earlier state has x <= sx and y <= sy
        kept.append(s)
        j = i
        while j < len(stair_x) and stair_y[j] >= sy:
            j += 1
        stair_x[i:j] = [sx]
        stair_y[i:j] = [sy]
    return kept


def _disk_binds(steps: list[list[_Step]], disk_budget: int | None) -> bool:
    return disk_budget is not None and disk_budget < sum(
        max(st.dz for st in row) for row in steps
    )


def _stair_np(
    q: np.ndarray, t: np.ndarray, limit: int
) -> tuple[np.ndarray, np.ndarray]:
    """The points (q, t) with q <= limit that no other point beats in both q and t, by
    q. The input is a few runs each sorted by q (a stable sort merges them)."""
    inside = q <= limit
    q, t = q[inside], t[inside]
    if not len(q):
        return q, t
    order = np.argsort(q, kind="stable")
    q, t = q[order], t[order]
    keep = np.empty(len(q), dtype=bool)
    keep[0] = True
    np.less(t[1:], np.minimum.accumulate(t)[:-1], out=keep[1:])
    q, t = q[keep], t[keep]
    last = np.empty(len(q), dtype=bool)  # of equal q, the last has the smallest t
    last[-1] = True
    np.not_equal(q[1:], q[:-1], out=last[:-1])
    return q[last], t[last]


_Stair = tuple[list[int], list[float]]


_WEIGHTS = ((1, 0), (0, 1))
"""The relaxations ``_bounds`` tabulates, as weights (of Q, of P). A surrogate such as
(3, 1) raises the first lower bound by 1-2% at generous budgets but prunes no more
partial plans on the 128-block profile, so it is not worth its table."""

_Bounds = list[list[list[_Stair]]]


def _bounds(steps: list[list[_Step]], limit: int) -> _Bounds:
    """Lower bounds on the time of the rest of the chain, from relaxations.

    A rest of the chain from block k on turns a partial plan (x, y) into a final
    x = max(x + P, y + Q), where P is the resident state it adds and Q (as small as
    ``_NO_EVENT`` when empty) follows Q' = max(c + P, a + Q) block by block from the
    end, P' = beta + P. A rest within ``limit`` has u Q + v P <= u (limit - y) +
    v (limit - x) for any weights u, v >= 0, and r = u Q + v P follows
    r' >= max(u c + v beta, u a + v beta + r) (as P >= 0): a chain of one number, so
    the fastest rest for each r is a staircase. (1, 0) keeps the activations and
    events, (0, 1) the resident state (a knapsack). ``table[k][w][cls]`` (by the class of block k-1, for
    the classes it can have) is the staircase (r ascending, fastest time descending)
    for the weights ``_WEIGHTS[w]``, with r up to (u + v) ``limit``; the largest
    time read from the tables is a lower bound.
    """
    n = len(steps)
    # times as whole ticks, each rounded down (a lower bound stays one): equal sums of
    # equal times then tie exactly instead of differing in the last bits
    most = sum(max(st.dt for st in row) for row in steps)
    tick = 2.0 ** (math.frexp(most)[1] - 52) if most > 0 else 1.0
    dt = [[math.floor(st.dt / tick) for st in row] for row in steps]
    # the empty rest: Q = _NO_EVENT, P = 0
    ends = [_NO_EVENT if u else 0 for u, _v in _WEIGHTS]
    empty: _Stair = ([], [])
    table: _Bounds = [[[([e], [0.0])] * 2 for e in ends] for _k in range(n + 1)]
    nxt = [
        [(np.array([e], dtype=np.int64), np.zeros(1, dtype=np.int64))] * 2 for e in ends
    ]
    for k in reversed(range(n)):
        row = steps[k]
        classes = {st.out for st in steps[k - 1]} if k else {0}
        here = []
        for w, (u, v) in enumerate(_WEIGHTS):
            cur = list(nxt[w])
            table[k][w] = [empty, empty]
            for prev in classes:
                rs = [
                    np.maximum(
                        u * st.c[prev] + v * st.beta,
                        u * st.a[prev] + v * st.beta + nxt[w][st.out][0],
                    )
                    for st in row
                ]
                ts = [nxt[w][st.out][1] + d for st, d in zip(row, dt[k])]
                r, t = _stair_np(
                    np.concatenate(rs), np.concatenate(ts), (u + v) * limit
                )
                cur[prev] = (r, t)
                table[k][w][prev] = (r.tolist(), (t * tick).tolist())
            here.append(cur)
        nxt = here
    return table


def _lower_bound(
    tables: list[list[_Stair]], cls: int, x: int, y: int, limit: int
) -> float:
    """The fastest any rest (tables of one block) can finish (x, y) within ``limit``."""
    h = 0.0
    for (u, v), by_cls in zip(_WEIGHTS, tables):
        rs, ts = by_cls[cls]
        i = bisect.bisect_right(rs, u * (limit - y) + v * (limit - x))
        if not i:
            return math.inf
        h = max(h, ts[i - 1])
    return h


def _fastest(
    model: CostModel,
    steps: list[list[_Step]],
    exact_dt: list[list[int]],
    bounds: _Bounds,
    limit: int,
    disk_budget: int | None,
    cut_s: float,
    beam: int = 0,
    max_states: int = 0,
) -> _Chain | None:
    """The fastest plan within ``limit`` (raw peak less base) that can beat ``cut_s``
    (``raw_bytes`` is its x, ``time`` its exact time), or None.

    Branch and bound: a partial plan is dropped when its time plus the lower bound on
    any rest (``_bounds``) exceeds ``cut_s``, or when another is at least as good in
    exact time, x, y (and disk bytes, where the disk budget can bind). With ``beam``,
    only that many partial plans with the smallest such sums go on per key: a quick
    dive for a good feasible plan, not an exact search. With ``max_states``, an
    exact search whose partial plans outgrow it raises ``_TooLarge``."""
    use_disk = _disk_binds(steps, disk_budget)
    cut = cut_s * (1 + _TIME_SLOP)
    assert _WEIGHTS == ((1, 0), (0, 1))  # the loop below reads Q's table, then P's
    # state: (exact time, x, y, z, time, time + bound, choices as a linked list)
    start = (0, model.opt_temp, 0, 0, 0.0, 0.0, None)
    frontier: dict[int, list[tuple]] = {0: [start]}
    for k, row in enumerate(steps):
        new: dict[int, list[tuple]] = {}
        tq, tp = bounds[k + 1]
        for prev, states in frontier.items():
            for st, dte in zip(row, exact_dt[k]):
                a, c, beta, dz, dt = st.a[prev], st.c[prev], st.beta, st.dz, st.dt
                (qr, qt), (pr, pt) = tq[st.out], tp[st.out]
                bucket = new.setdefault(st.out, [])
                for te, x, y, z, t, _f, ch in states:
                    x2 = x + beta if x + beta > y + c else y + c
                    j = bisect.bisect_right(pr, limit - x2)
                    if not j:
                        continue
                    y2 = y + a
                    i = bisect.bisect_right(qr, limit - y2)
                    if not i:
                        continue
                    t2 = t + dt
                    h = qt[i - 1]
                    if pt[j - 1] > h:
                        h = pt[j - 1]
                    if t2 + h > cut:
                        continue
                    if use_disk and z + dz > disk_budget:
                        continue
                    bucket.append((te + dte, x2, y2, z + dz, t2, t2 + h, (st, ch)))
        frontier = {}
        for key, states in new.items():
            if use_disk:
                states.sort(key=lambda s: (s[_TE], s[_FZ], s[_FX], s[_FY]))
                kept: list[tuple] = []
                for s in states:
                    if not any(
                        q[_FZ] <= s[_FZ] and q[_FX] <= s[_FX] and q[_FY] <= s[_FY]
                        for q in kept
                    ):
                        kept.append(s)
            else:
                states.sort(key=lambda s: (s[_TE], s[_FX], s[_FY]))
                kept = _staircase(states, _FX, _FY)
            if beam and len(kept) > beam:
                kept = sorted(kept, key=lambda s: s[_FB])[:beam]
            if kept:
                frontier[key] = kept
        if not frontier:
            return None
        if max_states and sum(len(v) for v in frontier.values()) > max_states:
            raise _TooLarge
    te, x, _y, _z, _t, _f, ch = min(
        (s for states in frontier.values() for s in states),
        key=lambda s: (s[_TE], s[_FX]),
    )
    return _Chain(x, te, _unlink(ch))


class _TooLarge(Exception):
    """An exact search's partial plans outgrew ``MAX_EXACT_STATES``."""


MAX_EXACT_STATES = 200_000
"""Partial plans an exact search may hold after a unit; beyond, the plan comes from
a wider beam (``WIDE_BEAM``): within the budget as exactly, perhaps not the fastest
(many small units of near-equal times: a ResNet's 54)."""

WIDE_BEAM = 512

_DIVE_CLOSE = 0.05
"""Where the dive's plan is within this (relative) of the lower bound, its time is the
cut of the exact search; otherwise the cuts ``_GAPS`` below it come first."""

_GAPS = (0.01, 0.03, 0.1, 0.3)
"""Time cuts above a setting's lower bound (relative), tried in turn."""


def _exact_times(tables: list[list[list[_Step]]]) -> list[list[list[int]]]:
    """Every step's time as an integer multiple of one power of two: sums of these are
    exact, so plans that differ only in the order of the same times tie exactly."""
    ratios = [[[st.dt.as_integer_ratio() for st in row] for row in t] for t in tables]
    den = max(d for t in ratios for row in t for _n, d in row)
    return [[[num * (den // d) for num, d in row] for row in t] for t in ratios]


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
    resident_opts = (
        (KEEP, RECOMPUTE, OFFLOAD, INPUTS_TO_DISK) if disk_ok else (KEEP, RECOMPUTE)
    )
    owner_opts = [resident_opts, (STREAM,)] if disk_ok else [resident_opts]
    out = []
    for m in ms:
        # loss chunks cut the last block's rows like micro-batches: not for a model
        # whose results depend on the whole batch (BatchNorm) unless allowed
        cs = [1]
        if microbatching:
            cs += sorted(c for (mm, c) in last.chunk_costs if mm == m)
        for c in cs:
            for combo in itertools.product(owner_opts, repeat=len(owners)):
                fixed: dict[int, tuple[str, ...]] = dict(zip(owners, combo))
                # The executor streams a tied parameter only with every block using
                # it (docs/executor.md): a streamed owner's borrowers stream too.
                for k, b in enumerate(profile.blocks):
                    lenders = [profile.blocks.index(o) for o in _owners(profile, b)]
                    if any(fixed.get(o) == (STREAM,) for o in lenders):
                        fixed[k] = (STREAM,)
                if not disk_ok:
                    for k in range(len(profile.blocks)):
                        fixed.setdefault(k, resident_opts)
                if any(
                    not set(opts) & set(profile.blocks[k].options or CHAIN_OPTIONS)
                    for k, opts in fixed.items()
                ):
                    continue  # a block made to do what it does not allow
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
) -> _Found | None:
    """The fastest plan under ``raw_budget`` (or the smallest-peak plan), or None."""
    groups = _groups(profile, microbatching, max_microbatches, disk_budget > 0)
    models = {(m.m, m.c): m for g in groups for m in g.models}

    def plan_of(
        m: int, chosen: tuple[_Step, ...]
    ) -> tuple[CostModel, tuple[str, ...], float]:
        model = models[(m, chosen[-1].chunks)]
        choices = tuple(st.cur for st in chosen)
        return model, choices, _time_of(model, choices)

    if not use_time:
        best = None
        for g in groups:
            m0 = g.models[0]
            found = _smallest(m0, g.steps, disk_budget)
            if found and (
                best is None
                or (found.raw_bytes, found.time) < (best.raw_bytes, best.step_s)
            ):
                model, choices, _t = plan_of(m0.m, found.steps)
                best = _Found(model, choices, found.raw_bytes, found.time)
        return best
    assert raw_budget is not None
    if profile.construction_peak_bytes > raw_budget:
        return None
    exact = _exact_times([g.steps for g in groups])
    # settings by the fastest they could be with no budget, a bound that costs nothing;
    # the bound from ``_bounds`` is computed only for those that could beat the best
    free = [sum(min(st.dt for st in row) for row in g.steps) for g in groups]
    best = None
    best_key: tuple[int, int] | None = None  # (exact time, raw)
    best_s = math.inf
    for i in sorted(range(len(groups)), key=lambda i: free[i]):
        if free[i] > best_s * (1 + _TIME_SLOP):
            break
        m0, steps = groups[i].models[0], groups[i].steps
        limit = raw_budget - m0.base
        bounds = _bounds(steps, limit)
        lb = _lower_bound(bounds[0], 0, m0.opt_temp, 0, limit)
        if lb > best_s * (1 + _TIME_SLOP):
            continue
        # a quick dive for a feasible plan, then exact searches under cuts: the first
        # that finds a plan has found this setting's best. Tight cuts keep the Pareto
        # sets small, so cuts grow from the lower bound unless the dive is close to it
        dive = _fastest(m0, steps, exact[i], bounds, limit, disk_budget, best_s, 16)
        top = best_s if dive is None else min(best_s, plan_of(m0.m, dive.steps)[2])
        if top <= lb * (1 + _DIVE_CLOSE):
            cuts = [top]
        else:
            cuts = [lb * (1 + gap) for gap in _GAPS if lb * (1 + gap) < top]
            cuts.append(top)
        found = None
        try:
            for cut in cuts:
                found = _fastest(
                    m0,
                    steps,
                    exact[i],
                    bounds,
                    limit,
                    disk_budget,
                    cut,
                    max_states=MAX_EXACT_STATES,
                )
                if found is not None:
                    break
        except _TooLarge:
            logger.info("plan search too large: a beam of %d instead", WIDE_BEAM)
            found = _fastest(
                m0, steps, exact[i], bounds, limit, disk_budget, top, WIDE_BEAM
            )
            if found is None:
                found = dive
        if found is None:
            continue
        te = int(found.time)
        raw = max(m0.base + found.raw_bytes, profile.construction_peak_bytes)
        if best_key is None or (te, raw) < best_key:
            model, choices, best_s = plan_of(m0.m, found.steps)
            best, best_key = _Found(model, choices, raw, best_s), (te, raw)
    return best


def _time_of(model: CostModel, choices: Sequence[str]) -> float:
    return sum(model.time(k, ch) for k, ch in enumerate(choices))


def _groups(
    profile: Profile, microbatching: bool, max_microbatches: int, disk_ok: bool
) -> list[_Group]:
    """The settings, with those that differ only in loss chunks merged into one search:
    the chunk count changes only the last block, so its options for every count
    become options of one chain (each ``_Step`` knows its count)."""
    cache: dict[tuple, list[_Step]] = {}
    by_key: dict[tuple, _Group] = {}
    for m, c, fixed in _settings(profile, microbatching, max_microbatches, disk_ok):
        model = CostModel(profile, m, c)
        # the search starts from the optimizer step's temporaries: an upper bound,
        # the blocks whose streaming is not fixed counted as resident
        model.opt_temp = model.optimizer_temp(
            [fixed.get(k) == (STREAM,) for k in range(model.n)]
        )
        steps = _steps(model, fixed, cache)
        key = (m, tuple(sorted(fixed.items())))
        if key not in by_key:
            by_key[key] = _Group(fixed, [model], steps[:-1] + [list(steps[-1])])
        else:
            by_key[key].models.append(model)
            by_key[key].steps[-1].extend(steps[-1])
    return list(by_key.values())


BATCH_DEPENDENT_NOTE = (
    "micro-batches on a model with batch-dependent layers (allowed by "
    "allow_microbatching=True): BatchNorm statistics are taken per micro-batch, "
    "running statistics and a spectral_norm's power iteration move once per "
    "micro-batch, so the model trains differently from whole batches"
)
"""The note of a plan that micro-batches a batch-dependent model (``memory.batch``'s
``batch_dependent_layer``)."""


def _as_memory_plan(
    model: CostModel,
    choices: Sequence[str],
    budget: int | None,
    disk_budget: int,
    batch_dependent: bool = False,
) -> MemoryPlan:
    pred = predict_choices(model, choices)
    blocks = tuple(
        BlockPlan(b.name, *AS_PLAN[ch]) for b, ch in zip(model.profile.blocks, choices)
    )
    notes = [f"peak at {pred.peak_event}"]
    if model.profile.disk is None and any(
        ch in (OFFLOAD, STREAM, INPUTS_TO_DISK) for ch in choices
    ):
        notes.append("disk bandwidth not measured: assumed 200 MB/s")
    if model.profile.loss_chunk_refusal:
        notes.append(f"no loss chunks: {model.profile.loss_chunk_refusal}")
    dependent = (batch_dependent or model.profile.batch_dependent) and model.m > 1
    if dependent:
        notes.append(BATCH_DEPENDENT_NOTE)
    return MemoryPlan(
        blocks=blocks,
        num_microbatches=model.m,
        loss_chunks=model.c if model.c > 1 else model.profile.loss_chunk_setting,
        budget_bytes=budget,
        disk_budget_bytes=disk_budget,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_step_s=pred.step_s,
        predicted_disk_bytes=pred.disk_bytes,
        notes=tuple(notes),
        batch_dependent_microbatches=dependent,
    )


def _microbatching(profile: Profile, allow: bool | None, batch_dependent: bool) -> bool:
    dependent = batch_dependent or profile.batch_dependent
    return (not dependent) if allow is None else allow


def _with_bandwidth(
    profile: Profile, disk_budget: int, offload_dir: str | None
) -> Profile:
    if profile.disk is not None or disk_budget == 0:
        return profile
    from memory.probes import measure_disk_bandwidth

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
    return slack(best.raw_bytes)


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
        raw = smallest.raw_bytes
    else:
        raw = unslack(budget_bytes)
    best = _best(profile, raw, disk, mb, max_microbatches, use_time=True)
    if best is None:
        assert budget_bytes is not None
        raise _budget_error(profile, budget_bytes, disk, mb, max_microbatches)
    model, choices, _raw, _t = best
    return _as_memory_plan(model, choices, budget_bytes, disk, batch_dependent)


def _budget_error(
    profile: Profile, budget: int, disk: int, mb: bool, max_microbatches: int
) -> BudgetError:
    smallest = _best(profile, None, disk, mb, max_microbatches, use_time=False)
    assert smallest is not None
    model, choices, raw, _t = smallest
    need = slack(raw)
    pred = predict_choices(model, choices)
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


def _dominant(model: CostModel, choices: Sequence[str], pred: Prediction) -> str:
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
        return f"the batch, buffers and torch's fixed runtime cost ({size})"
    block = pred.peak_event.split(" of ", 1)[-1]
    if block == names[-1]:
        return (
            f"the last block's own working memory, the head's logits and loss ({size})"
        )
    return f"block {block}'s own working memory ({size})"
