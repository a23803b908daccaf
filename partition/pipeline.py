"""Pipeline schedules as data: per-rank stage actions for GPipe, 1F1B, Interleaved1F1B
and a zero-bubble schedule, in ``partition.schedule``'s representation.

``build_schedule(name, num_ranks, num_microbatches, stages_per_rank)`` returns a
``Schedule`` whose ``ranks[r]`` lists rank r's actions (``0F0 0F1 0B0 ... STEP``);
``validate`` checks it without processes. Stages are placed in loops: stage s runs on
rank ``s % num_ranks`` (``Interleaved1F1B``: each rank holds ``stages_per_rank``
stages), which is how torch.distributed.pipelining places them.

Example:
    >>> s = build_schedule("1F1B", num_ranks=2, num_microbatches=3)
    >>> " ".join(str(a) for a in s.ranks[0])
    '0F0 0F1 0B0 0F2 0B1 0B2 STEP'
"""

from __future__ import annotations

from partition.schedule import Action, Schedule, action_deps, action_key

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
"""Schedule names, as torch.distributed.pipelining's ``get_schedule_class`` spells them.
``InterleavedZeroBubble`` splits each backward into ``I`` (input gradient) and ``W``
(weight gradient) and fills bubbles with ``W``."""


def check_schedule_args(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> None:
    """Raise ``ValueError`` naming the value when a schedule cannot take these sizes."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or num_microbatches < 1 or stages_per_rank < 1:
        raise ValueError(
            f"ranks ({num_ranks}), micro-batches ({num_microbatches}) and stages per "
            f"rank ({stages_per_rank}) must all be at least 1"
        )
    if name in ("GPipe", "1F1B") and stages_per_rank != 1:
        raise ValueError(f"{name} runs one stage per rank, got {stages_per_rank}")
    if name == "1F1B" and num_microbatches < num_ranks:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: {num_microbatches} "
            f"< {num_ranks}"
        )
    if name.startswith("Interleaved") and num_microbatches % num_ranks:
        raise ValueError(
            f"{name} needs micro-batches divisible by the ranks: {num_microbatches} "
            f"is not a multiple of {num_ranks}"
        )


def _interleaved_orders(
    r: int, p: int, v: int, m: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """Rank r's forward and backward (stage, micro-batch) orders and its warm-up count
    (Megatron-LM's interleaved schedule; v = 1 is 1F1B)."""
    fwd, bwd = [], []
    for i in range(m * v):
        group, within = divmod(i, p * v)
        chunk, lane = divmod(within, p)
        mb = group * p + lane
        fwd.append((chunk * p + r, mb))
        bwd.append(((v - 1 - chunk) * p + r, mb))
    if v == 1:
        warm = min(p - 1 - r, m)
    else:
        warm = min((p - r - 1) * 2 + (v - 1) * p, m * v)
    return fwd, bwd, warm


def _one_f_one_b(r: int, p: int, v: int, m: int, bkind: str = "B") -> list[Action]:
    fwd, bwd, warm = _interleaved_orders(r, p, v, m)
    acts = [Action("F", None, k, s) for s, k in fwd[:warm]]
    for j in range(m * v - warm):
        s, k = fwd[warm + j]
        acts.append(Action("F", None, k, s))
        s, k = bwd[j]
        acts.append(Action(bkind, None, k, s))
    for s, k in bwd[m * v - warm :]:
        acts.append(Action(bkind, None, k, s))
    return acts


def _zero_bubble(p: int, v: int, m: int) -> list[list[Action]]:
    """Interleaved 1F1B with each backward split into I and W, the W's moved into the
    bubbles: a list schedule with unit-time actions where a rank that would wait runs
    its oldest pending W instead (ZB-H1's idea, Qi et al. 2024)."""
    orders = [_one_f_one_b(r, p, v, m, "I") for r in range(p)]
    num_stages = p * v
    probe = Schedule(
        [[] for _ in range(p)],
        num_blocks=num_stages,
        num_microbatches=m,
        num_stages=num_stages,
        stage_ranks=tuple(s % p for s in range(num_stages)),
    )
    finish: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    pending: list[list[Action]] = [[] for _ in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    total = sum(len(o) for o in orders) + m * num_stages
    done = 0
    while done < total:
        best: tuple[float, int, Action, bool] | None = None
        for r in range(p):
            cand: tuple[float, Action, bool] | None = None
            if pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = action_deps(probe, a, False)
                if all(d in finish for d in deps):
                    start = max([free[r]] + [finish[d] for d in deps])
                    cand = (start, a, False)
            if pending[r] and (cand is None or cand[0] > free[r]):
                cand = (free[r], pending[r][0], True)
            if cand is not None and (best is None or cand[0] < best[0]):
                best = (cand[0], r, cand[1], cand[2])
        assert best is not None, "zero-bubble construction stalled"
        start, r, a, is_w = best
        if is_w:
            pending[r].pop(0)
        else:
            pos[r] += 1
            if a.kind == "I":
                pending[r].append(Action("W", None, a.microbatch, a.stage))
        free[r] = start + 1.0
        for key in action_key(a):
            finish[key] = free[r]
        out[r].append(a)
        done += 1
    return out


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    *,
    stage_blocks: tuple[tuple[int, ...], ...] = (),
    names: tuple[str, ...] = (),
) -> Schedule:
    """The per-rank actions of schedule ``name``, ``STEP`` closing each rank.

    Args:
        name: one of ``SCHEDULES``.
        num_ranks: pipeline ranks (devices in one pipeline).
        num_microbatches: micro-batches per step.
        stages_per_rank: stages each rank holds (interleaved schedules).
        stage_blocks: each stage's block indices, for printing.
        names: block names, for printing.

    Raises:
        ValueError: sizes the schedule cannot take (see ``check_schedule_args``).
    """
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    check_schedule_args(name, p, m, v)
    if name == "GPipe":
        ranks = [
            [Action("F", None, k, r) for k in range(m)]
            + [Action("B", None, k, r) for k in range(m)]
            for r in range(p)
        ]
    elif name in ("1F1B", "Interleaved1F1B"):
        ranks = [_one_f_one_b(r, p, v, m) for r in range(p)]
    else:
        ranks = _zero_bubble(p, v, m)
    for acts in ranks:
        acts.append(Action("STEP"))
    num_stages = p * v
    num_blocks = (
        sum(len(b) for b in stage_blocks) if stage_blocks else max(len(names), 1)
    )
    return Schedule(
        ranks=ranks,
        num_blocks=num_blocks,
        num_microbatches=m,
        names=names,
        num_stages=num_stages,
        stage_ranks=tuple(s % p for s in range(num_stages)),
        stage_blocks=stage_blocks,
        schedule_name=name,
    )
