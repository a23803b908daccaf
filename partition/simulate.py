"""Event-driven simulation of a pipeline schedule: step time, bubble, peak memory, timeline.

Each rank runs its action list in order; an action starts when the rank is free and
everything it needs has arrived (``partition.schedule.action_deps``). A tensor that
crosses ranks arrives after the link's latency plus its bytes over the bandwidth, and
transfers between one pair of ranks take turns on that link. Memory per stage is its
static bytes (parameters, gradients, optimizer state, workspace) plus the activations
of the micro-batches whose forward has run and whose backward (``B``, or ``W`` after a
split) has not.

Example:
    >>> s = build_schedule("GPipe", 4, 8)  # doctest: +SKIP
    >>> r = simulate(s, [StageCost(1.0, 2.0)] * 4)  # doctest: +SKIP
    >>> round(r.bubble_ratio, 3)  # (p - 1) / m  # doctest: +SKIP
    0.375
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partition.schedule import Action, Schedule, action_deps, action_key


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch.

    Attributes:
        forward_s: forward seconds (the last stage's includes the loss).
        backward_s: full backward seconds (``B``); a split backward takes
            ``input_grad_share`` of it for ``I`` and the rest for ``W``.
        activation_bytes: bytes held from a micro-batch's forward to its backward.
        static_bytes: parameters, gradients, optimizer state and workspace.
        output_bytes: bytes sent to the next stage (the gradient sent back is as big).
        input_grad_share: share of the backward that computes the input gradient.
        weight_grad_bytes: of ``activation_bytes``, what is still held after ``I``
            until ``W`` (default: half).
        update_s: the optimizer update of the stage's parameters, run by its rank
            after the rank's last action (each rank steps its own optimizer).
    """

    forward_s: float
    backward_s: float
    activation_bytes: int = 0
    static_bytes: int = 0
    output_bytes: int = 0
    input_grad_share: float = 0.5
    weight_grad_bytes: int | None = None
    update_s: float = 0.0


@dataclass(frozen=True)
class CpuQuota:
    """A CPU quota on a rank's host (cgroup ``cpu.max``, a container's CPU limit).

    The rank may use ``share * period_s`` seconds of CPU in each period, at full
    speed, and waits for the next period once that is spent; what it leaves unused
    in a period is lost. A stage's seconds (``StageCost``) are at the host's
    sustained rate under the quota, so an action of ``d`` seconds needs
    ``d * share`` seconds of CPU. Periods start at time 0 on every rank.

    Attributes:
        share: cores granted per period (>= 1: a one-thread rank is never held).
        period_s: the period, seconds.
    """

    share: float
    period_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.share > 0 and self.period_s > 0):
            raise ValueError(
                f"a CPU quota needs share > 0 and period_s > 0, got {self.share!r} "
                f"and {self.period_s!r}"
            )


class _Paced:
    """One rank's use of its ``CpuQuota`` as the simulation runs its actions in
    time order."""

    def __init__(self, quota: CpuQuota) -> None:
        self.share = quota.share
        self.period = quota.period_s
        self.budget = quota.share * quota.period_s
        self.k = -1  # the period whose budget ``used`` counts
        self.used = 0.0

    def finish(self, start: float, seconds: float) -> float:
        """When an action of ``seconds`` at the sustained rate, started at ``start``,
        ends under the quota."""
        if self.share >= 1.0 or seconds <= 0:
            return start + seconds
        t, work = start, seconds * self.share
        k = int(t // self.period)
        if (k + 1) * self.period <= t:  # t // period rounds down across a boundary
            k += 1
        eps = 1e-12 * (1.0 + t)
        while work > eps:
            if k != self.k:
                self.k, self.used = k, 0.0
            run = min(work, self.budget - self.used, (k + 1) * self.period - t)
            if run > eps:
                t += run
                work -= run
                self.used += run
            if work > eps:  # the quota or the period is spent: the next period
                k += 1
                t = max(t, k * self.period)
        return t


@dataclass(frozen=True)
class Event:
    """One action as it ran: rank, the action, start and end seconds."""

    rank: int
    action: str
    stage: int
    kind: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """What a simulated step gives.

    Attributes:
        step_s: time from the first action to the end of the last rank's optimizer
            update (``StageCost.update_s``), plus ``allreduce_s``.
        busy_s: per rank, seconds spent computing.
        bubble_share: idle share of rank-time: 1 - sum(busy) / (ranks x step).
        bubble_ratio: idle over busy time, (ranks x step - sum(busy)) / sum(busy): the
            (p - 1) / m of the textbooks.
        stage_peak_bytes: per stage, static bytes plus the peak of its held activations.
        rank_peak_bytes: per rank, the peak of all its stages together.
        max_in_flight: per stage, the most micro-batches whose activations it held.
        events: every action with its times.
        allreduce_s: data-parallel gradient reduction added after the pipeline.
    """

    step_s: float
    busy_s: list[float]
    bubble_share: float
    bubble_ratio: float
    stage_peak_bytes: list[int]
    rank_peak_bytes: list[int]
    max_in_flight: list[int]
    events: list[Event] = field(repr=False)
    allreduce_s: float = 0.0


SENDS = ("eager", "rendezvous")
"""How the simulator moves tensors between ranks (``simulate(sends=...)``)."""

TransferFn = Callable[[int, int, int], float]
"""``transfer(src_rank, dst_rank, nbytes)``: seconds to move a tensor between ranks."""


def _duration(a: Action, c: StageCost) -> float:
    if a.kind == "F":
        return c.forward_s
    if a.kind == "B":
        return c.backward_s
    if a.kind == "I":
        return c.backward_s * c.input_grad_share
    if a.kind == "W":
        return c.backward_s * (1 - c.input_grad_share)
    return 0.0


def simulate(
    schedule: Schedule,
    costs: list[StageCost],
    transfer: TransferFn | None = None,
    *,
    allreduce_s: float = 0.0,
    quotas: Sequence[CpuQuota | None] | None = None,
    sends: str = "eager",
) -> SimResult:
    """Run ``schedule`` in simulated time.

    Args:
        schedule: a pipeline schedule (``partition.pipeline.build_schedule``).
        costs: one ``StageCost`` per stage.
        transfer: seconds to move ``nbytes`` from one rank to another (default: free).
        allreduce_s: seconds of data-parallel gradient reduction after the last action.
        quotas: per rank, a ``CpuQuota`` that paces its computing actions and its
            optimizer update, or None (the rank computes at its sustained rate).
        sends: when a tensor crossing ranks moves (without explicit SEND/RECV
            actions). ``"eager"``: as soon as it is made. ``"rendezvous"``: once the
            receiving rank has also reached the action that needs it (gloo's TCP
            transport moves a message only after the receiver posts its receive;
            torch's schedules post a receive when the rank's previous action ends).

    Raises:
        ValueError: the schedule deadlocks or costs do not match its stages.
    """
    s = schedule
    if len(costs) != s.num_stages:
        raise ValueError(f"{len(costs)} stage costs for {s.num_stages} stages")
    if sends not in SENDS:
        raise ValueError(f"sends must be one of {SENDS}, got {sends!r}")
    if quotas is not None and len(quotas) != len(s.ranks):
        raise ValueError(f"{len(quotas)} CPU quotas for {len(s.ranks)} ranks")
    paced = [
        None if q is None else _Paced(q) for q in (quotas or [None] * len(s.ranks))
    ]
    explicit = any(a.kind.startswith(("SEND", "RECV")) for r in s.ranks for a in r)
    finish: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(s.ranks)
    link_free: dict[tuple[int, int], float] = {}
    pos = [0] * len(s.ranks)
    events: list[Event] = []
    busy = [0.0] * len(s.ranks)

    def arrival(dep: tuple[str, int, int], st: int, posted: float) -> float:
        """When what ``dep`` produced is usable on stage ``st``'s rank, whose
        receive is posted at ``posted``."""
        t = finish[dep]
        kind, src_stage, _ = dep
        if explicit or kind not in ("F", "G"):
            return t
        a, b = s.stage_ranks[src_stage], s.stage_ranks[st]
        if a == b:
            return t
        start = t if sends == "eager" else max(t, posted)
        if transfer is None:
            return start
        nbytes = costs[src_stage if kind == "F" else st].output_bytes
        start = max(start, link_free.get((a, b), 0.0))
        end = start + transfer(a, b, nbytes)
        link_free[(a, b)] = end
        return end

    arrived: dict[tuple[tuple[str, int, int], int], float] = {}
    while True:
        progress = False
        for r, acts in enumerate(s.ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.stage is None:  # STEP: local, instant here
                    pos[r] += 1
                    progress = True
                    continue
                deps = action_deps(s, a, explicit)
                if not all(d in finish for d in deps):
                    break
                ready = free[r]  # also when ``a``'s receives are posted
                for d in deps:
                    key = (d, a.stage)
                    if key not in arrived:
                        arrived[key] = arrival(d, a.stage, free[r])
                    ready = max(ready, arrived[key])
                c = costs[a.stage]
                dur = _duration(a, c)
                if a.kind.startswith("SEND") and transfer is not None:
                    peer = a.stage + (1 if a.kind == "SEND_F" else -1)
                    dur = transfer(r, s.stage_ranks[peer], c.output_bytes)
                assert a.microbatch is not None
                pr = paced[r]
                end = ready + dur
                if pr is not None and a.kind in ("F", "B", "I", "W"):
                    end = pr.finish(ready, dur)
                events.append(
                    Event(r, str(a), a.stage, a.kind, a.microbatch, ready, end)
                )
                free[r] = end
                if a.kind in ("F", "B", "I", "W"):
                    busy[r] += end - ready
                for key2 in action_key(a):
                    finish[key2] = free[r]
                pos[r] += 1
                progress = True
        if not progress:
            break
    stuck = [r for r, acts in enumerate(s.ranks) if pos[r] < len(acts)]
    if stuck:
        r = stuck[0]
        raise ValueError(
            f"the schedule deadlocks: rank {r} waits at step {pos[r]} "
            f"({s.ranks[r][pos[r]]}); check it with partition.schedule.validate"
        )
    step = max((e.end_s for e in events), default=0.0)
    # each rank updates its stages' parameters once its own last action is done
    updates = [0.0] * len(s.ranks)
    for st_i, r in enumerate(s.stage_ranks):
        updates[r] += costs[st_i].update_s
    done = [
        free[r] + updates[r]
        if paced[r] is None
        else paced[r].finish(free[r], updates[r])  # type: ignore[union-attr]
        for r in range(len(s.ranks))
    ]
    step = max([step] + [done[r] for r in range(len(s.ranks)) if updates[r]])
    ranks = len(s.ranks)
    total_busy = sum(busy)
    stage_peak, in_flight, rank_peak = _memory(s, costs, events)
    step_total = step + allreduce_s
    return SimResult(
        step_s=step_total,
        busy_s=busy,
        bubble_share=1 - total_busy / (ranks * step) if step else 0.0,
        bubble_ratio=(ranks * step - total_busy) / total_busy if total_busy else 0.0,
        stage_peak_bytes=stage_peak,
        rank_peak_bytes=rank_peak,
        max_in_flight=in_flight,
        events=events,
        allreduce_s=allreduce_s,
    )


def _memory(
    s: Schedule, costs: list[StageCost], events: list[Event]
) -> tuple[list[int], list[int], list[int]]:
    """Per-stage peak bytes, per-stage most micro-batches held, per-rank peak bytes."""
    deltas: list[tuple[float, int, int, int]] = []  # time, order, stage, bytes
    counts: list[tuple[float, int, int, int]] = []
    for e in events:
        c = costs[e.stage]
        wbytes = (
            c.weight_grad_bytes
            if c.weight_grad_bytes is not None
            else c.activation_bytes // 2
        )
        if e.kind == "F":
            # held from the start of the forward (it builds them as it runs)
            deltas.append((e.start_s, 1, e.stage, c.activation_bytes))
            counts.append((e.start_s, 1, e.stage, 1))
        elif e.kind == "B":
            deltas.append((e.end_s, 0, e.stage, -c.activation_bytes))
            counts.append((e.end_s, 0, e.stage, -1))
        elif e.kind == "I":
            deltas.append((e.end_s, 0, e.stage, -(c.activation_bytes - wbytes)))
        elif e.kind == "W":
            deltas.append((e.end_s, 0, e.stage, -wbytes))
            counts.append((e.end_s, 0, e.stage, -1))
    deltas.sort()
    counts.sort()
    n = s.num_stages
    live = [0] * n
    peak = [0] * n
    ranks = len(s.ranks)
    rank_live = [0] * ranks
    rank_peak = [0] * ranks
    for _t, _o, st, b in deltas:
        live[st] += b
        peak[st] = max(peak[st], live[st])
        r = s.stage_ranks[st]
        rank_live[r] += b
        rank_peak[r] = max(rank_peak[r], rank_live[r])
    held = [0] * n
    most = [0] * n
    for _t, _o, st, k in counts:
        held[st] += k
        most[st] = max(most[st], held[st])
    stage_peak = [costs[i].static_bytes + peak[i] for i in range(n)]
    for i in range(n):
        rank_peak[s.stage_ranks[i]] += costs[i].static_bytes
    return stage_peak, most, rank_peak


_COLOURS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#c44e52",
    "W": "#55a868",
    "SEND_F": "#8c8c8c",
    "RECV_F": "#8c8c8c",
    "SEND_B": "#b0b0b0",
    "RECV_B": "#b0b0b0",
}
ACTION_NAMES = {
    "F": "forward",
    "B": "backward (full)",
    "I": "input-gradient backward",
    "W": "weight-gradient backward",
    "SEND_F": "send activations",
    "RECV_F": "receive activations",
    "SEND_B": "send gradient",
    "RECV_B": "receive gradient",
}
"""What each action kind of the timeline is (``partition.schedule.STAGE_KINDS``)."""


def timeline_figure(result: SimResult, *, title: str = "") -> Any:
    """The Gantt chart of ``timeline_png`` (a ``matplotlib.figure.Figure``).

    One row per rank, one bar per action, labelled ``{stage}{kind}{microbatch}``
    where it is wide enough; the legend, right of the plot, names every action kind
    drawn. Communication actions take time only with a transfer cost and are drawn
    as thin grey bars.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = 1 + max((e.rank for e in result.events), default=0)
    stages: list[list[int]] = [[] for _ in range(ranks)]
    drawn: list[str] = []
    fig = Figure(figsize=(11, 0.6 * ranks + 1.6), layout="constrained")
    ax = fig.subplots()
    for e in result.events:
        if e.stage not in stages[e.rank]:
            stages[e.rank].append(e.stage)
        width = e.end_s - e.start_s
        if e.kind not in _COLOURS or width <= 0:
            continue
        if e.kind not in drawn:
            drawn.append(e.kind)
        comm = e.kind.startswith(("SEND", "RECV"))
        ax.barh(
            e.rank,
            width,
            left=e.start_s,
            height=0.3 if comm else 0.8,
            color=_COLOURS[e.kind],
            edgecolor="white",
            linewidth=0.5,
        )
        if not comm and width > result.step_s / 60:
            ax.text(
                (e.start_s + e.end_s) / 2,
                e.rank,
                f"{e.stage}{e.kind}{e.microbatch}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(ranks))
    ax.set_yticklabels(
        [
            f"rank {r}" + (f" (stage {', '.join(map(str, sorted(st)))})" if st else "")
            for r, st in enumerate(stages)
        ]
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(
        (title + "  " if title else "")
        + f"step {result.step_s:.3f} s, bubble {result.bubble_share:.1%}"
    )
    order = [k for k in _COLOURS if k in drawn]
    ax.legend(
        [Patch(color=_COLOURS[k]) for k in order],
        [f"{k}  {ACTION_NAMES[k]}" for k in order],
        title='action (a bar\'s "1F3": stage 1,\naction F, micro-batch 3)',
        title_fontsize=7,
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
    return fig


def timeline_png(result: SimResult, path: str | Path, *, title: str = "") -> Path:
    """Draw the simulated step as a Gantt chart (one row per rank) into ``path``; see
    ``timeline_figure``."""
    out = Path(path)
    timeline_figure(result, title=title).savefig(out, dpi=120)
    return out
