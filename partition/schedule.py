"""A training step as plain data: per-rank lists of actions, checkable without running.

One device is one rank (``Schedule.ranks`` has one list). A pipeline across devices is
the same structure with one list per rank and stage-level actions (below); a plan for
one device is the one-stage case.

Actions and their compact forms (block ``i``, micro-batch ``k``):

========  =========  =================================================================
form      kind       meaning
========  =========  =================================================================
``F3.0``  F          forward of block 3 on micro-batch 0 (the last block's forward
                     includes the loss)
``R3.0``  R          recompute: rerun block 3's forward with autograd for micro-batch
                     0 (streamed blocks, whose forward ran without autograd)
``B3.0``  B          backward of block 3 on micro-batch 0 (a ``recompute`` block
                     reruns its forward inside it, via ``torch.utils.checkpoint``)
``LOAD3`` LOAD       bring block 3's streamed parameters in from the store
``OFFLOAD3`` OFFLOAD release block 3's parameters, unchanged, back to the store
``WRITE3`` WRITE     write what block 3 changed (its gradient between micro-batches;
                     parameters and optimizer state after an update) and release it
``UPDATE3`` UPDATE   AdamW update of block 3, after its last backward of the step
``STEP``  STEP       AdamW update of every resident parameter
========  =========  =================================================================

Pipeline actions name a stage instead of a block, in torch.distributed.pipelining's
compact form ``{stage}{kind}{microbatch}``: ``2F0`` (forward of stage 2 on micro-batch
0, the last stage's including the loss), ``1B3`` (full backward), ``1I3`` / ``1W3``
(zero-bubble split: input gradient, then weight gradient), ``1SEND_F0``,
``2RECV_F0``, ``1SEND_B0``, ``0RECV_B0`` (optional explicit communication). ``STEP``
ends each rank. ``Schedule.stage_ranks`` says which rank holds each stage.

``compile_plan(plan)`` turns a ``memory.spec.MemoryPlan`` into a schedule,
``validate(schedule)`` checks it (raising ``ScheduleError`` with a step-by-rank table
that marks the failing step) and ``format(schedule)`` prints it.

Example:
    >>> from memory.spec import BlockPlan, MemoryPlan
    >>> plan = MemoryPlan((BlockPlan("a"), BlockPlan("b", "recompute", "stream")))
    >>> print(" ".join(str(a) for a in compile_plan(plan).ranks[0]))
    F0.0 LOAD1 F1.0 B1.0 UPDATE1 WRITE1 B0.0 STEP
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memory.spec import MemoryPlan

KINDS = ("F", "R", "B", "LOAD", "OFFLOAD", "WRITE", "UPDATE", "STEP")
STAGE_KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_PER_MICROBATCH = ("F", "R", "B")
_FORM = re.compile(r"^(F|R|B)(\d+)\.(\d+)$|^(LOAD|OFFLOAD|WRITE|UPDATE)(\d+)$|^STEP$")
_STAGE_FORM = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class ScheduleError(ValueError):
    """An invalid schedule; the message holds the table with the failing step marked."""


@dataclass(frozen=True)
class Action:
    """One action of a schedule.

    Attributes:
        kind: one of ``KINDS`` (block actions) or ``STAGE_KINDS`` (pipeline actions).
        block: the block index (None for ``STEP`` and pipeline actions).
        microbatch: the micro-batch (``F``, ``R``, ``B`` and pipeline actions).
        stage: the pipeline stage (pipeline actions only).
    """

    kind: str
    block: int | None = None
    microbatch: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.stage is not None:
            if self.kind not in STAGE_KINDS:
                raise ValueError(
                    f"unknown stage action kind {self.kind!r}; one of {STAGE_KINDS}"
                )
            if self.block is not None or self.microbatch is None or self.stage < 0:
                raise ValueError(f"malformed stage action: {self!r}")
            return
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; one of {KINDS}")
        if self.kind == "STEP":
            ok = self.block is None and self.microbatch is None
        elif self.kind in _PER_MICROBATCH:
            ok = self.block is not None and self.microbatch is not None
        else:
            ok = self.block is not None and self.microbatch is None
        if not ok:
            raise ValueError(f"malformed {self.kind} action: {self!r}")

    def __str__(self) -> str:
        if self.stage is not None:
            return f"{self.stage}{self.kind}{self.microbatch}"
        if self.kind == "STEP":
            return "STEP"
        if self.kind in _PER_MICROBATCH:
            return f"{self.kind}{self.block}.{self.microbatch}"
        return f"{self.kind}{self.block}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action written as ``text`` (``"F3.0"``, ``"LOAD3"``, ``"STEP"``, or a
        pipeline action such as ``"2F0"``, ``"1W3"``, ``"0SEND_F1"``)."""
        sm = _STAGE_FORM.match(text.strip())
        if sm:
            return cls(sm.group(2), None, int(sm.group(3)), int(sm.group(1)))
        m = _FORM.match(text.strip())
        if not m:
            raise ValueError(
                f"cannot parse action {text!r}: expected e.g. F3.0, LOAD3, STEP, 2F0"
            )
        if m.group(1):
            return cls(m.group(1), int(m.group(2)), int(m.group(3)))
        if m.group(4):
            return cls(m.group(4), int(m.group(5)))
        return cls("STEP")


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus what is needed to check them.

    Attributes:
        ranks: the actions of each rank, in order (one rank on one device).
        num_blocks: blocks of the model.
        num_microbatches: micro-batches per step.
        streamed: indices of blocks whose state is streamed from disk.
        names: block names, for printing.
        activations: each block's activation mode, for printing.
        loss_chunks: chunks of the loss head.
        num_stages: pipeline stages (1: a one-device schedule of block actions).
        stage_ranks: the rank holding each stage (pipeline schedules).
        stage_blocks: the block indices of each stage (pipeline schedules).
        schedule_name: the pipeline schedule (``GPipe``, ``1F1B``, ...), if any.
    """

    ranks: list[list[Action]]
    num_blocks: int
    num_microbatches: int = 1
    streamed: frozenset[int] = field(default_factory=frozenset)
    names: tuple[str, ...] = ()
    activations: tuple[str, ...] = ()
    loss_chunks: int = 1
    num_stages: int = 1
    stage_ranks: tuple[int, ...] = ()
    stage_blocks: tuple[tuple[int, ...], ...] = ()
    schedule_name: str = ""

    @property
    def is_pipeline(self) -> bool:
        return any(a.stage is not None for acts in self.ranks for a in acts)


def compile_plan(plan: MemoryPlan) -> Schedule:
    """The one-device schedule that runs ``plan``.

    Per micro-batch: forward block by block (a streamed block is loaded for its
    forward and released after it), then backward from the last block to the first (a
    streamed block is loaded again, recomputed, backpropagated, then written back: its
    gradient between micro-batches, its update after the last one). The resident
    AdamW ``STEP`` runs after the last micro-batch. A streamed last block stays loaded
    from its forward to its backward, and its forward keeps autograd, so it needs no
    recompute.
    """
    n, m = len(plan.blocks), plan.num_microbatches
    if n == 0:
        raise ValueError("a plan needs at least one block")
    if m < 1 or plan.loss_chunks < 1:
        raise ValueError("num_microbatches and loss_chunks must be at least 1")
    streamed = frozenset(i for i, b in enumerate(plan.blocks) if b.state == "stream")
    last = n - 1
    acts: list[Action] = []
    for k in range(m):
        for i in range(n):
            if i in streamed:
                acts.append(Action("LOAD", i))
            acts.append(Action("F", i, k))
            if i in streamed and i != last:
                acts.append(Action("OFFLOAD", i))
        for i in reversed(range(n)):
            if i in streamed and i != last:
                acts += [Action("LOAD", i), Action("R", i, k)]
            acts.append(Action("B", i, k))
            if i in streamed:
                if k == m - 1:
                    acts.append(Action("UPDATE", i))
                acts.append(Action("WRITE", i))
    if len(streamed) < n:
        acts.append(Action("STEP"))
    return Schedule(
        ranks=[acts],
        num_blocks=n,
        num_microbatches=m,
        streamed=streamed,
        names=tuple(b.name for b in plan.blocks),
        activations=tuple(b.activations for b in plan.blocks),
        loss_chunks=plan.loss_chunks,
    )


def _check_rank(s: Schedule, actions: list[Action]) -> tuple[int, str] | None:
    """(index of the failing action, why), or None. Index len(actions): at the end."""
    n, m = s.num_blocks, s.num_microbatches
    done: set[tuple[str, int, int]] = set()
    loaded: set[int] = set()
    unwritten: set[int] = set()  # backward ran since the block was loaded
    updated: set[int] = set()
    stepped = False
    for t, a in enumerate(actions):
        i, k = a.block, a.microbatch
        if a.kind != "STEP":
            assert i is not None
            if not 0 <= i < n:
                return t, f"block {i} does not exist (blocks 0..{n - 1})"
        if a.kind in _PER_MICROBATCH:
            assert i is not None and k is not None
            if not 0 <= k < m:
                return t, f"micro-batch {k} does not exist (0..{m - 1})"
            if (a.kind, i, k) in done:
                return t, f"{a} runs twice"
            if i in s.streamed and i not in loaded:
                return t, f"{a} uses block {i}'s parameters, which are not loaded"
            if a.kind == "F" and i > 0 and ("F", i - 1, k) not in done:
                return t, f"{a} before the forward of block {i - 1} that feeds it"
            if a.kind in ("R", "B") and ("F", i, k) not in done:
                return t, f"{a} before its forward F{i}.{k}"
            if a.kind == "R" and ("B", i, k) in done:
                return t, f"{a} after its backward"
            if a.kind == "B":
                if i < n - 1 and ("B", i + 1, k) not in done:
                    return (
                        t,
                        f"{a} before B{i + 1}.{k}, which gives its output gradient",
                    )
                if i in s.streamed and i != n - 1 and ("R", i, k) not in done:
                    return t, f"{a} of a streamed block without its recompute R{i}.{k}"
                if i in updated or (stepped and i not in s.streamed):
                    return t, f"{a} after block {i}'s optimizer update"
                unwritten.add(i)
            done.add((a.kind, i, k))
        elif a.kind == "LOAD":
            if i not in s.streamed:
                return t, f"{a}: block {i} is resident, there is nothing to load"
            if i in loaded:
                return t, f"{a}: block {i} is already loaded"
            loaded.add(i)
        elif a.kind in ("OFFLOAD", "WRITE"):
            if i not in loaded:
                return t, f"{a}: block {i} is not loaded"
            if a.kind == "OFFLOAD" and i in unwritten:
                return t, f"{a} would drop block {i}'s gradients: WRITE it instead"
            all_b = all(("B", i, kk) in done for kk in range(m))
            if a.kind == "WRITE" and all_b and i in unwritten and i not in updated:
                return t, f"{a} after block {i}'s last backward but before UPDATE{i}"
            loaded.discard(i)
            unwritten.discard(i)
        elif a.kind == "UPDATE":
            if i not in s.streamed:
                return t, f"{a}: block {i} is resident; STEP updates it"
            if i not in loaded:
                return t, f"{a}: block {i} is not loaded"
            if i in updated:
                return t, f"{a} runs twice"
            missing = [f"B{i}.{kk}" for kk in range(m) if ("B", i, kk) not in done]
            if missing:
                return t, f"{a} before the backward {missing[0]}"
            updated.add(i)
        else:  # STEP
            if stepped:
                return t, "STEP runs twice"
            missing = [
                f"B{j}.{kk}"
                for j in range(n)
                if j not in s.streamed
                for kk in range(m)
                if ("B", j, kk) not in done
            ]
            if missing:
                return t, f"STEP before the backward {missing[0]} of a resident block"
            stepped = True
    end = len(actions)
    for j in range(n):
        for kk in range(m):
            for kind in ("F", "B"):
                if (kind, j, kk) not in done:
                    return end, f"{kind}{j}.{kk} never runs"
    for j in sorted(s.streamed - updated):
        return end, f"streamed block {j} is never updated (UPDATE{j})"
    if loaded:
        return (
            end,
            f"block {min(loaded)} is still loaded at the end (WRITE or OFFLOAD it)",
        )
    if not stepped and len(s.streamed) < n:
        return end, "the resident parameters are never updated (STEP)"
    return None


# --------------------------------------------------------------------------- pipelines
Key = tuple[str, int, int]
"""A completed pipeline event: ``(kind, stage, microbatch)``; kind ``G`` means the
stage's input gradient exists (after its ``B`` or ``I``)."""


def action_key(a: Action) -> list[Key]:
    """What finishing stage action ``a`` makes true."""
    assert a.stage is not None and a.microbatch is not None
    keys: list[Key] = [(a.kind, a.stage, a.microbatch)]
    if a.kind in ("B", "I"):
        keys.append(("G", a.stage, a.microbatch))
    if a.kind == "B":
        keys.append(("W", a.stage, a.microbatch))
    return keys


def action_deps(s: Schedule, a: Action, explicit_comm: bool) -> list[Key]:
    """The events stage action ``a`` waits for.

    Without explicit SEND/RECV actions a forward waits for the previous stage's forward
    and a backward for the next stage's input gradient (the runtime moves the tensors);
    with them, a cross-rank edge goes SEND on one rank, RECV on the other.
    """
    assert a.stage is not None and a.microbatch is not None
    st, k, last = a.stage, a.microbatch, s.num_stages - 1

    def cross(x: int, y: int) -> bool:
        return explicit_comm and s.stage_ranks[x] != s.stage_ranks[y]

    if a.kind == "F":
        if st == 0:
            return []
        return [("RECV_F", st, k)] if cross(st - 1, st) else [("F", st - 1, k)]
    if a.kind in ("B", "I"):
        deps: list[Key] = [("F", st, k)]
        if st < last:
            deps.append(("RECV_B", st, k) if cross(st + 1, st) else ("G", st + 1, k))
        return deps
    if a.kind == "W":
        return [("G", st, k)]
    if a.kind == "SEND_F":
        return [("F", st, k)]
    if a.kind == "RECV_F":
        return [("SEND_F", st - 1, k)]
    if a.kind == "SEND_B":
        return [("G", st, k)]
    return [("SEND_B", st + 1, k)]  # RECV_B


def check_pipeline(s: Schedule) -> tuple[int, int, str] | None:
    """(rank, step, why) of the first problem in a pipeline schedule, or None.

    Checks that every action belongs to a stage its rank holds, that each stage runs
    every micro-batch's forward and backward (``B``, or ``I`` then ``W``) exactly once,
    that the ranks, each running its list in order and waiting for what it needs from
    the others, finish without deadlock, and that each rank's ``STEP`` comes after all
    its gradients.
    """
    p, m = s.num_stages, s.num_microbatches
    if len(s.stage_ranks) != p:
        return 0, 0, f"stage_ranks names {len(s.stage_ranks)} ranks for {p} stages"
    explicit = any(a.kind.startswith(("SEND", "RECV")) for r in s.ranks for a in r)
    seen: set[tuple[str, int, int]] = set()
    for r, acts in enumerate(s.ranks):
        for t, a in enumerate(acts):
            if a.stage is None:
                if a.kind != "STEP":
                    return r, t, f"{a} is a block action in a pipeline schedule"
                continue
            assert a.microbatch is not None
            if not 0 <= a.stage < p:
                return r, t, f"{a}: stage {a.stage} does not exist (0..{p - 1})"
            if s.stage_ranks[a.stage] != r:
                return r, t, f"{a}: stage {a.stage} is on rank {s.stage_ranks[a.stage]}"
            if not 0 <= a.microbatch < m:
                return r, t, f"{a}: micro-batch {a.microbatch} does not exist"
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                return r, t, f"{a} runs twice"
            seen.add(key)
            both = ("B" if a.kind == "I" else "I", a.stage, a.microbatch)
            if a.kind in ("B", "I") and both in seen:
                return r, t, f"{a}: stage {a.stage} already has a backward for it"
            if a.kind == "W" and ("B", a.stage, a.microbatch) in seen:
                return r, t, f"{a}: {a.stage}B{a.microbatch} already took the weights"
    done: set[Key] = set()
    pos = [0] * len(s.ranks)
    stepped = [False] * len(s.ranks)
    while True:
        progress = False
        for r, acts in enumerate(s.ranks):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.stage is None:  # STEP
                    mine = [st for st in range(p) if s.stage_ranks[st] == r]
                    need = [
                        f"{st}{'W' if ('G', st, k) in done else 'B'}{k}"
                        for st in mine
                        for k in range(m)
                        if ("W", st, k) not in done
                    ]
                    if need:
                        return r, pos[r], f"STEP before the gradient of {need[0]}"
                    if stepped[r]:
                        return r, pos[r], "STEP runs twice"
                    stepped[r] = True
                elif all(d in done for d in action_deps(s, a, explicit)):
                    done.update(action_key(a))
                else:
                    break
                pos[r] += 1
                progress = True
        if not progress:
            break
    stuck = []
    for r, acts in enumerate(s.ranks):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            missing = [d for d in action_deps(s, a, explicit) if d not in done]
            # a rank waiting on its own later action is the cause; report it first
            own = any(s.stage_ranks[st] == r for _k, st, _m in missing)
            what = ", ".join(
                f"{st}{'B' if kind == 'G' else kind}{k}" for kind, st, k in missing
            )
            stuck.append(
                (not own, r, pos[r], f"{a} waits forever for {what} (deadlock)")
            )
    if stuck:
        _own, r, step, why = min(stuck)
        return r, step, why
    for st in range(p):
        r = s.stage_ranks[st]
        for k in range(m):
            for kind in ("F", "G", "W"):
                if (kind, st, k) not in done:
                    want = {"F": "F", "G": "B", "W": "W"}[kind]
                    return r, len(s.ranks[r]), f"{st}{want}{k} never runs"
    for r in range(len(s.ranks)):
        if not stepped[r] and any(x == r for x in s.stage_ranks):
            return r, len(s.ranks[r]), "the rank never updates its parameters (STEP)"
    return None


def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` can run: every backward after its forward and after the
    next block's backward, parameters loaded before use, updates after the block's last
    backward, nothing left loaded or un-updated.

    Raises:
        ScheduleError: with a step-by-rank table, the failing step marked.
    """
    if schedule.is_pipeline:
        bad_p = check_pipeline(schedule)
        if bad_p is not None:
            r, step, why = bad_p
            table = format(schedule, mark=(r, step, why))
            raise ScheduleError(
                f"invalid schedule: rank {r} step {step}: {why}\n{table}"
            )
        return
    for r, actions in enumerate(schedule.ranks):
        bad = _check_rank(schedule, actions)
        if bad is not None:
            step, why = bad
            table = format(schedule, mark=(r, step, why))
            raise ScheduleError(
                f"invalid schedule: rank {r} step {step}: {why}\n{table}"
            )


def format(schedule: Schedule, *, mark: tuple[int, int, str] | None = None) -> str:  # noqa: A001
    """The schedule as a step-by-rank table, with ``mark = (rank, step, why)`` flagged."""
    s = schedule
    lines = []
    blocks = ", ".join(
        f"{i}={name}:{act}{'+stream' if i in s.streamed else ''}"
        for i, (name, act) in enumerate(zip(s.names, s.activations, strict=False))
    )
    if s.is_pipeline:
        stages = "; ".join(
            f"stage {i} on rank {r}: blocks "
            + (f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0]) if b else "-")
            for i, (r, b) in enumerate(
                zip(s.stage_ranks, s.stage_blocks or [()] * s.num_stages, strict=False)
            )
        )
        lines.append(
            f"{s.schedule_name or 'pipeline'}: {s.num_stages} stages ({stages}); "
            f"micro-batches {s.num_microbatches}"
        )
    else:
        lines.append(
            f"blocks {s.num_blocks} ({blocks or '-'}); micro-batches "
            f"{s.num_microbatches}; loss chunks {s.loss_chunks}"
        )
    width = max([8] + [len(str(a)) for acts in s.ranks for a in acts])
    header = "  ".join(f"rank {r}".ljust(width) for r in range(len(s.ranks)))
    lines.append(f"step  {header}".rstrip())
    num_steps = max(len(acts) for acts in s.ranks) if s.ranks else 0
    end = num_steps
    if mark is not None and mark[1] >= num_steps:
        end = mark[1] + 1
    for t in range(end):
        cells = []
        for acts in s.ranks:
            if t < len(acts):
                cells.append(str(acts[t]).ljust(width))
            else:
                cells.append(("(end)" if t == len(acts) else "").ljust(width))
        row = f"{t:>4}  " + "  ".join(cells)
        if mark is not None and t == mark[1]:
            row = row.rstrip() + f"   <-- rank {mark[0]}: {mark[2]}"
        lines.append(row.rstrip())
    return "\n".join(lines)
