"""Per-unit costs of any model's training step, from its real forward under hooks.

``profile_units`` runs the model's own forward and backward once per micro-batch count
on a fake copy (``FakeTensorMode``: shapes, no storage, so a model larger than memory
can be profiled) and attributes what happens to the units (``memory.units``):

- forward: module pre/post hooks mark each unit's call; a dispatch mode follows every
  storage created (live bytes, peak) and counts FLOPs; saved-tensor hooks record what
  each unit saves for backward. Work between units (the model's own code: adding
  position embeddings, building masks, the loss after the head) is *glue*, charged to
  the unit before it; a unit followed by glue that saves tensors keeps its activations
  (the plan's wrappers act inside units only, so they could not move the glue's).
- backward: the autograd nodes created in each unit's forward (and its glue) get
  pre-hooks, so the dispatch mode knows which unit's backward runs.
- inputs that several units take (attention masks, rotary tables, an encoder's output
  read by every decoder layer) live the whole step: they count once, with the batch.

- a module fake tensors cannot run (a mixture of experts' data-dependent routing) or
  price (oneDNN's recurrent kernels: ``memory.real_profile.MISPRICED_OPS``) is a
  stand-in in the trace and profiled on real tensors on a slice of the batch
  (``memory.real_profile.RealUnits``), its experts for the worst routing.

The result is a ``memory.profile.Profile`` whose blocks are the units, so the one
planner (``memory.plan``) plans any model. Times are FLOPs over the measured matmul
rate (not calibrated against a measured step).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import mmap
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from memory.batch import (
    batch_dependent_layer,
    batch_layout,
    batch_size_of,
    loss_of,
    map_tensors,
    split_batch,
    tensors_of,
)
from memory.blocks import Block
from memory.chain_costs import (
    ADAMW_STATE_FACTOR,
    LiveBytes,
    block_state,
    is_batch_dependent,
    storage_key,
    storage_nbytes,
)
from memory.errors import MemoryPlanError
from memory.head import ChunkedHead, vocab_block_bytes
from memory.probes import measure_flops_per_s
from memory.profile import BlockCosts, BlockProfile, Profile
from memory.real_profile import (
    MISPRICED_OPS,
    RealCosts,
    RealUnits,
    batch_coupling,
    op_flops,
)
from memory.streaming import parameter_owners, row_lookups
from memory.units import call_model, find_units, no_kv_cache, quiet_fake_errors

logger = logging.getLogger(__name__)

GLUE = -1  # owner index of work before the first unit

PAGE_BYTES = mmap.PAGESIZE
"""A looked-up row of a mapped table touches its pages: at most a row and a page."""


class _Tracker(LiveBytes):
    """``memory.chain_costs.LiveBytes`` (live bytes, their peak), plus FLOPs per owner (the unit whose
    forward or backward runs)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.owner = GLUE
        self.flops = [0] * n
        self.mispriced: set[tuple[int, int]] = set()  # (unit, innermost module id)
        self.stack: list[nn.Module] = []  # modules whose forward runs, innermost last
        # parameters read in a forward outside every unit that holds them (glue
        # reading a unit's parameter: a streamed unit's would be its placeholder)
        self.holders: dict[int, set[int]] = {}  # id(parameter) -> units holding it
        self.where: Callable[[], int | None] = lambda: None  # forward: unit or GLUE
        self.read_outside: set[int] = set()  # units whose parameters glue reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.holders:
            where = self.where()
            if where is not None:
                for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                    hs = (
                        self.holders.get(id(a)) if isinstance(a, torch.Tensor) else None
                    )
                    if hs and where not in hs:
                        self.read_outside.add(min(hs))  # its owner: the first
        out = func(*args, **kwargs)
        if self.owner >= 0:
            self.flops[self.owner] += op_flops(func, args, kwargs, out)
            if func in MISPRICED_OPS:
                inner = id(self.stack[-1]) if self.stack else 0
                self.mispriced.add((self.owner, inner))
        self.track_outputs(out)
        return out


class _UnitFailed(Exception):
    """The fake trace failed in unit ``unit`` (GLUE: outside every unit), in its
    module ``inner`` (``id``; 0: not known, as in backward)."""

    def __init__(self, unit: int, inner: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.unit = unit
        self.inner = inner
        self.error = error


class _Trace:
    """One forward and backward of the fake model, attributed to units."""

    def __init__(self, units: Sequence[Block], exclude: set[int]) -> None:
        self.units = list(units)
        n = len(units)
        self.n = n
        self.exclude = exclude  # parameter, buffer and batch storages
        self.tracker = _Tracker(n)
        self.tracker.ignore = exclude
        for k, u in enumerate(self.units):
            for p in u.module.parameters():
                self.tracker.holders.setdefault(id(p), set()).add(k)
        self.tracker.where = lambda: (
            None if self.in_backward else (self.current if self.inside else GLUE)
        )
        self.level = [0] * n  # live bytes at the unit's first forward entry
        self.fwd_peak = [0] * n
        self.bwd_level = [-1] * n
        self.bwd_peak = [0] * n
        self.inputs: list[dict[int, int]] = [{} for _ in range(n)]
        self.outputs: list[dict[int, int]] = [{} for _ in range(n)]
        self.saved: list[dict[int, int]] = [{} for _ in range(n)]
        self.glue_saved: list[dict[int, int]] = [{} for _ in range(n)]
        self.fwd_flops = [0] * n
        self.current = GLUE  # unit whose forward (or glue) runs
        self.inside = False
        self.claimed: set[Any] = set()
        self.node_owner: dict[Any, int] = {}
        self.no_grad_peak = [0] * n
        self.in_backward = False

    def failing_unit(self) -> int:
        """The unit whose forward or backward runs now (GLUE: none)."""
        if self.in_backward:
            return self.tracker.owner
        return self.current if self.inside else GLUE

    # ---------------------------------------------------------------- forward
    def _claim(self, tensors: list[torch.Tensor], owner: int) -> None:
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in self.claimed:
                continue
            self.claimed.add(node)
            if owner >= 0:
                self.node_owner[node] = owner
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)

    def _close_segment(self) -> None:
        k = self.current
        if k >= 0:
            self.fwd_peak[k] = max(self.fwd_peak[k], self.tracker.peak - self.level[k])

    def pre(self, k: int, args: tuple, kwargs: dict) -> None:
        ins = tensors_of((args, kwargs))
        # the glue before belongs to the last unit (also where the unit runs without
        # autograd inside its own node, a reentrant checkpoint's: the node is glue)
        self._claim(ins, self.current)
        self._close_segment()
        self.current = k
        self.inside = True
        self.tracker.owner = k
        self.tracker.peak = self.tracker.live
        if not self.level[k]:
            self.level[k] = self.tracker.live
        for t in ins:
            if storage_key(t) not in self.exclude:
                self.inputs[k][storage_key(t)] = storage_nbytes(t)

    def post(self, k: int, out: Any) -> None:
        outs = tensors_of(out)
        if torch.is_grad_enabled():
            self._claim(outs, k)
        for t in outs:
            key = storage_key(t)
            if key not in self.exclude and key not in self.inputs[k]:
                self.outputs[k][key] = storage_nbytes(t)
        self.inside = False  # glue from here on, charged to k

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        k = self.current
        key = storage_key(t)
        if k >= 0 and key not in self.exclude:
            target = self.saved[k] if self.inside else self.glue_saved[k]
            target[key] = storage_nbytes(t)
        return t

    # ---------------------------------------------------------------- backward
    def node_pre(self, node: Any) -> None:
        k = self.node_owner.get(node, GLUE)
        if k < 0 or k == self.tracker.owner:
            return
        prev = self.tracker.owner
        if prev >= 0 and self.bwd_level[prev] >= 0:
            self.bwd_peak[prev] = max(
                self.bwd_peak[prev], self.tracker.peak - self.bwd_level[prev]
            )
        self.tracker.owner = k
        self.tracker.peak = self.tracker.live
        if self.bwd_level[k] < 0:
            self.bwd_level[k] = self.tracker.live

    def finish_backward(self) -> None:
        k = self.tracker.owner
        if k >= 0 and self.bwd_level[k] >= 0:
            self.bwd_peak[k] = max(
                self.bwd_peak[k], self.tracker.peak - self.bwd_level[k]
            )


def _run_trace(
    model: nn.Module,
    units: Sequence[Block],
    inputs: Any,
    targets: Any,
    loss_fn: Callable | None,
    exclude: set[int],
    head: ChunkedHead | None = None,
) -> _Trace:
    tr = _Trace(units, exclude)
    index = {id(u.module): k for k, u in enumerate(units)}
    hooks = []
    for u in units:
        k = index[id(u.module)]

        # A unit called inside the backward is a rerun (the model's own reentrant
        # ``checkpoint(unit, x, use_reentrant=True)``): its forward and backward are
        # the backward of the unit whose node runs it, not a new forward.
        def pre(_m: nn.Module, a: tuple, kw: dict, _k: int = k) -> None:
            if torch._C._current_graph_task_id() == -1:
                tr.pre(_k, a, kw)

        def post(_m: nn.Module, a: tuple, kw: dict, out: Any, _k: int = k) -> None:
            if torch._C._current_graph_task_id() == -1:
                tr.post(_k, out)

        hooks.append(u.module.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(u.module.register_forward_hook(post, with_kwargs=True))
    stack = tr.tracker.stack

    def enter(m: nn.Module, _a: Any) -> None:
        stack.append(m)

    def leave(m: nn.Module, _a: Any, _o: Any) -> None:
        if stack and stack[-1] is m:
            stack.pop()

    hooks.append(nn.modules.module.register_module_forward_pre_hook(enter))
    hooks.append(nn.modules.module.register_module_forward_hook(leave))
    try:
        with tr.tracker, quiet_fake_errors():
            # without autograd first: the forward peak of a recomputed or streamed unit
            with torch.no_grad():
                _loss(model, inputs, targets, loss_fn, head)
            tr._close_segment()
            ng = list(tr.fwd_peak)
            tr.fwd_peak = [0] * tr.n
            tr.level = [0] * tr.n
            tr.inputs = [{} for _ in range(tr.n)]
            tr.outputs = [{} for _ in range(tr.n)]
            tr.current, tr.inside = GLUE, False
            tr.tracker.owner = GLUE
            tr.tracker.flops = [0] * tr.n
            tr.tracker.peak = tr.tracker.live
            with torch.autograd.graph.saved_tensors_hooks(tr.pack, lambda t: t):
                loss = _loss(model, inputs, targets, loss_fn, head)
            tr._claim([loss], tr.current)
            tr._close_segment()
            tr.no_grad_peak = ng
            tr.fwd_flops = list(tr.tracker.flops)
            tr.tracker.flops = [0] * tr.n
            handles = [n.register_prehook(_prehook(tr, n)) for n in tr.node_owner]
            tr.tracker.owner = GLUE
            tr.in_backward = True
            loss.backward()
            tr.in_backward = False
            if head is not None:
                head.clear()
            tr.finish_backward()
            for h in handles:
                h.remove()
            del loss
    except MemoryPlanError:
        raise
    except Exception as e:  # fake tensors cannot run it: which unit, which module?
        stack = tr.tracker.stack
        inner = 0 if tr.in_backward or not stack else id(stack[-1])
        raise _UnitFailed(tr.failing_unit(), inner, e) from e
    finally:
        for h in hooks:
            h.remove()
    return tr


def _loss(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable | None,
    head: ChunkedHead | None,
) -> torch.Tensor:
    if head is not None:
        loss = head.loss_of(model, inputs, targets)
        if not torch.is_grad_enabled():
            head.clear()
        return loss
    out = call_model(model, inputs)
    loss = loss_of(out, targets, loss_fn)
    del out
    return loss


def _prehook(tr: _Trace, node: Any) -> Callable:
    def hook(grad_outputs: Any) -> None:
        tr.node_pre(node)

    return hook


def glue_kept_inputs(tr: _Trace) -> list[set[int]]:
    """Per unit, its inputs that glue saves for backward: the unit's own glue (a
    reentrant ``checkpoint(unit, x)`` in the model's forward saves ``x`` once the
    unit has run) or the glue before it (a non-reentrant one saves ``x`` before it
    calls the unit). They stay in memory until the backward whatever the plan does
    with the unit: its input is kept, never on disk (no ``D`` option), and they are no
    activations a wrapper could have moved (``moved_glue_bytes``)."""
    out = []
    for k in range(tr.n):
        glue = set(tr.glue_saved[k]) | (set(tr.glue_saved[k - 1]) if k else set())
        out.append({s for s in tr.inputs[k] if s in glue})
    return out


def moved_glue_bytes(tr: _Trace, kept_inputs: list[set[int]]) -> list[int]:
    """Per unit, the bytes its glue saves that are neither its own input nor the
    next unit's (``glue_kept_inputs``): activations the unit's wrappers cannot move,
    which make it keep-only when large."""
    out = []
    for k in range(tr.n):
        kept = kept_inputs[k] | (kept_inputs[k + 1] if k + 1 < tr.n else set())
        out.append(sum(b for s, b in tr.glue_saved[k].items() if s not in kept))
    return out


def _costs(tr: _Trace, shared: set[int]) -> list[BlockCosts]:
    out = []
    kept_inputs = glue_kept_inputs(tr)
    for k in range(tr.n):
        ins = {s: b for s, b in tr.inputs[k].items() if s not in shared}
        outs = tr.outputs[k]
        saved = {**tr.saved[k], **tr.glue_saved[k]}
        saves_input = any(s in saved or s in kept_inputs[k] for s in ins)
        saves_output = any(s in saved for s in outs)
        other = sum(
            b
            for s, b in saved.items()
            if s not in ins and s not in outs and s not in shared
        )
        out.append(
            BlockCosts(
                input_bytes=sum(ins.values()),
                output_bytes=sum(outs.values()),
                saved_bytes=other,
                saves_input=saves_input,
                saves_output=saves_output,
                forward_peak_bytes=tr.fwd_peak[k],
                forward_no_grad_peak_bytes=tr.no_grad_peak[k],
                backward_peak_bytes=tr.bwd_peak[k],
                forward_flops=tr.fwd_flops[k],
                backward_flops=tr.tracker.flops[k],
            )
        )
    return out


class _RowParams:
    """A model's row-streamed parameters (``memory.streaming``) by unit, and what
    streaming them by rows costs for a micro-batch (``BlockCosts.row_*``)."""

    def __init__(self, units: Sequence[Block], head: ChunkedHead | None) -> None:
        n = len(units)
        owner = parameter_owners(units)
        users: dict[int, set[int]] = {}
        for k, u in enumerate(units):
            for p in u.module.parameters():
                users.setdefault(id(p), set()).add(k)
        self.own = [0] * n
        self.shared = [0] * n
        self.lookups = row_lookups(units)
        self.tables: dict[int, list[tuple[nn.Module, int, int, bool]]] = {}
        for k, mods in self.lookups.items():
            for mod in mods:
                w = mod.weight
                nbytes = w.numel() * w.element_size()
                row = nbytes // max(w.shape[0], 1)
                tied = len(users[id(w)]) > 1
                self.tables.setdefault(k, []).append((mod, nbytes, row, tied))
                self.own[k] += nbytes
        self.head_unit = -1
        self.head_block = self.head_weight = 0
        if head is not None:
            w = head.head.weight
            for k, u in enumerate(units):
                if any(m is head.head for m in u.module.modules()):
                    self.head_unit = k
            if self.head_unit >= 0 and w.requires_grad:
                self.head_block = vocab_block_bytes(w)
                self.head_weight = w.numel() * w.element_size()
                if owner.get(id(w)) == self.head_unit:
                    self.own[self.head_unit] += self.head_weight
                else:
                    self.shared[self.head_unit] += self.head_weight
        self.tokens: dict[int, int] = {}

    def hooks(self) -> list[Any]:
        """Forward hooks counting each table's looked-up rows (grad mode only)."""
        self.tokens = {}
        out = []
        for mods in self.tables.values():
            for mod, *_ in mods:

                def hook(m: nn.Module, args: tuple, out: Any) -> None:
                    if not torch.is_grad_enabled() or not args:
                        return
                    if isinstance(args[0], torch.Tensor):
                        n = args[0].numel()
                    elif isinstance(out, torch.Tensor) and out.dim() > 0:
                        # a subclass called with a shape (learned positions):
                        # the rows it returned
                        n = out.numel() // max(out.shape[-1], 1)
                    else:
                        return
                    self.tokens[id(m)] = self.tokens.get(id(m), 0) + n

                out.append(mod.register_forward_hook(hook))
        return out

    def costs(self, k: int, c: BlockCosts) -> BlockCosts:
        """Unit ``k``'s costs ``c`` with the row fields of the micro-batch just
        traced."""
        load = grad = dense = 0
        for mod, nbytes, row, tied in self.tables.get(k, []):
            n = self.tokens.get(id(mod), 0)
            touched = min(n * (row + PAGE_BYTES), nbytes)
            load += touched
            # sparse gradient (values, indices), its unique rows and inverse, the
            # rows summed, and the accumulator pages they are added to
            grad += n * (row + 8) + 16 * n + min(n, nbytes // row) * row + touched
            dense += (2 if tied else 1) * nbytes
        if k == self.head_unit and self.head_block:
            load += self.head_block
            grad += 2 * self.head_block  # the block's gradient, the rows it joins
            dense += self.head_weight
        return replace(
            c, row_load_bytes=load, row_grad_bytes=grad, row_dense_grad_bytes=dense
        )


def profile_units(
    model: nn.Module,
    inputs: Any,
    targets: Any = None,
    loss_fn: Callable | None = None,
    *,
    units: Sequence[Block] | None = None,
    max_microbatches: int = 16,
    optimizer: str = "adamw",
    loss_chunks: int = 1,
) -> Profile:
    """The per-unit ``Profile`` of one training step of ``model`` on this batch.

    Args:
        model: any module (real or already fake); it is not changed.
        inputs, targets, loss_fn: the batch and loss as ``memory.step`` takes them.
        units: the units (default: ``find_units(model, inputs)``).
        max_microbatches: profile micro-batch counts up to this (divisors of the batch).
        optimizer: ``adamw``.
        loss_chunks: > 1: the loss computed in the model's head in this many chunks
            (``memory.head.ChunkedHead``), as a plan with these loss chunks runs it.
    """
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    if units is None:
        units = find_units(model, inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with FakeCopyMode(mode):
        fake = copy.deepcopy(model)
    fake.train(model.training)
    by_name = dict(fake.named_modules(remove_duplicate=False))
    fake_units = [Block(u.name, by_name[u.name]) for u in units]
    no_kv_cache(fake)  # the copy's own configs: training runs without a KV cache
    head = None
    if loss_chunks > 1:
        head = ChunkedHead.for_loss(fake, loss_chunks, loss_fn)
        if head is None:
            raise MemoryPlanError(
                f"{type(model).__name__} has no linear output layer to chunk its loss"
                " (or its loss_fn is not a declared LogitsCrossEntropy with its head)"
            )
        head.install()
    layout = batch_layout(model)
    batch = batch_size_of(inputs, layout)
    states = block_state(fake_units, optimizer)
    rows = _RowParams(fake_units, head)
    exclude = {storage_key(t) for t in (*fake.parameters(), *fake.buffers())}
    sizes = [
        batch // d for d in range(1, min(batch, max_microbatches) + 1) if batch % d == 0
    ]
    if batch_dependent_layer(model, training_only=True) is not None:
        # statistics over the batch: a one-item micro-batch may have none to take
        # (BatchNorm over 1x1 maps raises); plans only get micro-batches of such
        # a model where asked (allow_microbatching), and then of two items or more
        sizes = [n for n in sizes if n >= 2 or n == batch]
    # modules profiled on real tensors (memory.real_profile): name -> unit index
    real: dict[str, int] = {}
    read_outside: set[int] = set()  # units whose parameters glue code reads
    real_mods = dict(model.named_modules(remove_duplicate=False))
    fake_names = {id(m): n for n, m in fake.named_modules(remove_duplicate=False)}
    for _ in range(2 * len(units) + 2):
        fallback = None
        if real:
            fallback = RealUnits(
                model,
                [Block(n, real_mods[n]) for n in real],
                inputs,
                targets,
                layout,
                batch,
                sizes,
            )
        try:
            costs_by_m, glue_of, glue_keeps_input, base_extra, mispriced = _trace_all(
                mode,
                fake,
                fake_units,
                inputs,
                targets,
                loss_fn,
                layout,
                batch,
                sizes,
                exclude,
                head,
                rows,
                fallback,
                [Block(n, by_name[n]) for n in real],
                list(real.values()),
                read_outside,
            )
        except _UnitFailed as e:
            name = _target(units, e.unit, fake_names.get(e.inner))
            if name is None or name in real:
                if name is not None and name != units[e.unit].name:
                    real[units[e.unit].name] = e.unit  # the whole unit then
                    continue
                where = (
                    "outside every unit" if e.unit < 0 else f"in {units[e.unit].name}"
                )
                text = str(e.error).strip()
                first = text.splitlines()[0][:160] if text else ""
                raise MemoryPlanError(
                    f"{type(model).__name__} cannot be profiled: "
                    f"{type(e.error).__name__} {where} on fake tensors"
                    f"{' (' + first + ')' if first else ''}"
                ) from e.error
            real = _add_target(real, name, e.unit, units)
            logger.info("profiling %s on real tensors: %s", name, e.error)
            continue
        added = False
        for k, inner in mispriced:
            name = _target(units, k, fake_names.get(inner))
            if name is not None and name not in real:
                real = _add_target(real, name, k, units)
                added = True
        if added:
            continue
        break
    else:  # cannot happen: each round adds a module or raises
        raise MemoryPlanError(f"{type(model).__name__} cannot be profiled")
    rate = measure_flops_per_s()
    blocks = []
    for k, st in enumerate(states):
        by_m = {
            m: replace(
                cs[k],
                forward_s=cs[k].forward_flops / rate,
                backward_s=cs[k].backward_flops / rate,
                time_source="flops",
            )
            for m, cs in costs_by_m.items()
        }
        # glue that saves tensors: the unit's wrappers could not move them
        # (and glue that keeps the unit's input: not on disk, D, whatever the unit does)
        if glue_of[k] > 64 * 1024:
            options: tuple[str, ...] = ("K",)
        elif glue_keeps_input[k]:
            options = ("K", "R", "O", "S")
        else:
            options = ("K", "R", "O", "S", "D")
        if k in read_outside:  # the model's own code reads its parameters: resident
            options = tuple(o for o in options if o != "S")
        blocks.append(
            BlockProfile(
                costs=by_m,
                options=options,
                row_param_bytes=rows.own[k],
                row_shared_bytes=rows.shared[k],
                **asdict(st),
            )
        )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    batch_bytes = sum(storage_nbytes(t) for t in tensors_of((inputs, targets)))
    base_extra += outside_state_bytes(model, units)
    return Profile(
        loss_chunk_setting=loss_chunks,
        update_by_chunks=True,
        blocks=tuple(blocks),
        batch_size=batch,
        batch_dependent=is_batch_dependent(model),
        batch_bytes=batch_bytes + base_extra,
        construction_peak_bytes=params + buffers,
        optimizer=optimizer,
        flops_per_s=rate,
        time_source="flops",
    )


def _trace_all(
    mode: Any,
    fake: nn.Module,
    fake_units: Sequence[Block],
    inputs: Any,
    targets: Any,
    loss_fn: Callable | None,
    layout: Any,
    batch: int,
    sizes: Sequence[int],
    exclude: set[int],
    head: ChunkedHead | None,
    rows: _RowParams,
    fallback: RealUnits | None,
    fake_targets: Sequence[Block],
    owners: Sequence[int],
    read_outside: set[int],
) -> tuple[
    dict[int, list[BlockCosts]], list[int], list[bool], int, set[tuple[int, int]]
]:
    """The fake trace at each micro-batch size: costs by micro-batch count, the
    bytes each unit's glue saves that the plan cannot move, whether that glue keeps
    the unit's input, the inputs several units share (bytes) and the
    units that ran an op fake tensors misprice. Units of ``fallback`` run as
    stand-ins, their costs measured on real tensors."""
    costs_by_m: dict[int, list[BlockCosts]] = {}
    base_extra = 0
    glue_of: list[int] = []
    glue_keeps_input: list[bool] = []
    mispriced: set[tuple[int, int]] = set()
    read_outside.clear()
    items = [batch]
    stand = (
        fallback.standing_in(fake_targets, lambda: items[0])
        if fallback is not None
        else contextlib.nullcontext()
    )
    with mode, stand:
        fx = map_tensors(inputs, mode.from_tensor)
        fy = map_tensors(targets, mode.from_tensor)
        try:
            for n in sizes:
                m = batch // n
                items[0] = n
                x, y = split_batch(fx, fy, m, layout)[0]
                batch_keys = {storage_key(t) for t in tensors_of((x, y))}
                counting = rows.hooks()
                try:
                    tr = _run_trace(
                        fake, fake_units, x, y, loss_fn, exclude | batch_keys, head
                    )
                finally:
                    for h in counting:
                        h.remove()
                mispriced |= tr.tracker.mispriced
                read_outside.update(tr.tracker.read_outside)
                seen: dict[int, int] = {}
                shared: set[int] = set()
                for k in range(tr.n):
                    for s in tr.inputs[k]:
                        if s in seen and seen[s] != k:
                            shared.add(s)
                        seen.setdefault(s, k)
                costs = _costs(tr, shared)
                if fallback is not None:
                    for j, k in enumerate(owners):
                        if j in fallback.calls:
                            whole = fake_targets[j].module is fake_units[k].module
                            costs[k] = _with_real(
                                costs[k], fallback.costs(j, n, fallback.calls[j]), whole
                            )
                costs_by_m[m] = [rows.costs(k, c) for k, c in enumerate(costs)]
                if m == 1:
                    kept_inputs = glue_kept_inputs(tr)
                    glue_of = moved_glue_bytes(tr, kept_inputs)
                    glue_keeps_input = [bool(s) for s in kept_inputs]
                    sizes_of = {
                        s: b for k in range(tr.n) for s, b in tr.inputs[k].items()
                    }
                    base_extra = sum(sizes_of[s] for s in shared)
        finally:
            for p in fake.parameters():
                p.grad = None
            if head is not None:
                head.clear()
    return costs_by_m, glue_of, glue_keeps_input, base_extra, mispriced


def _target(units: Sequence[Block], k: int, inner: str | None) -> str | None:
    """The module to profile on real tensors for a failure in unit ``k`` whose
    innermost running module is ``inner`` (a name): that module where it is inside
    the unit, else the unit; None outside every unit."""
    if k < 0:
        return None
    unit = units[k].name
    if inner is not None and (inner == unit or inner.startswith(unit + ".")):
        return inner
    return unit


def _add_target(
    real: dict[str, int], name: str, k: int, units: Sequence[Block]
) -> dict[str, int]:
    """``real`` with ``name`` (in unit ``k``): a module inside another target, or
    holding one, leaves only the outer one."""
    out = dict(real)
    for other in list(out):
        if name.startswith(other + "."):
            return out  # already inside a target
        if other.startswith(name + "."):
            del out[other]
    out[name] = k
    return out


def _with_real(c: BlockCosts, r: RealCosts, whole: bool) -> BlockCosts:
    """A unit's traced costs with what a stand-in in it (the unit itself where
    ``whole``, else a module inside it) measured on real tensors: what it saves, its
    peaks (on top of the trace's, which hold the stand-in's outputs), its FLOPs. A
    module inside the unit may save the unit's own tensors: its saved inputs and
    outputs count as saved too (a little over where the unit saves them as well)."""
    return replace(
        c,
        saved_bytes=c.saved_bytes + r.saved_bytes + (0 if whole else r.saved_io_bytes),
        saves_input=c.saves_input or (whole and r.saves_input),
        saves_output=c.saves_output or (whole and r.saves_output),
        forward_peak_bytes=c.forward_peak_bytes + r.forward_peak_bytes,
        forward_no_grad_peak_bytes=c.forward_no_grad_peak_bytes
        + r.forward_no_grad_peak_bytes,
        backward_peak_bytes=c.backward_peak_bytes + r.backward_peak_bytes,
        forward_flops=c.forward_flops + r.forward_flops,
        backward_flops=c.backward_flops + r.backward_flops,
    )


def outside_state_bytes(model: nn.Module, units: Sequence[Block]) -> int:
    """Bytes of what no unit holds and the whole step keeps: parameters outside every
    unit (``memory.units.outside_parameters``) with the gradients and AdamW state of
    the trainable ones, and buffers outside every unit. A profile adds them to
    ``batch_bytes`` (alive the whole step), as ``server.assign`` adds what a part
    holds: priced somewhere, never nowhere."""
    inside = {
        id(t) for u in units for t in (*u.module.parameters(), *u.module.buffers())
    }
    total = 0
    for p in model.parameters():
        if id(p) in inside:
            continue
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if p.requires_grad:
            total += nbytes * (1 + ADAMW_STATE_FACTOR)
    for b in model.buffers():
        if id(b) not in inside:
            total += b.numel() * b.element_size()
    return total


LOSS_CHUNK_OPTIONS = (1, 4, 16)
"""Loss chunk counts ``plan_units`` tries for a model with a chunkable head."""


def unit_profiles(
    model: nn.Module,
    inputs: Any,
    targets: Any = None,
    loss_fn: Callable | None = None,
    *,
    runtime_bytes: int = 0,
    chunk_options: Sequence[int] = LOSS_CHUNK_OPTIONS,
    units: Sequence[Block] | None = None,
) -> dict[int, Profile]:
    """One profile per loss chunk count the model's head allows (``{1: ...}`` for a
    model without a chunkable head or with a ``loss_fn`` that is not declared).

    A head is chunkable only where the chunked loss is the model's own
    (``memory.head.own_loss_refusal``, on the batch's first example): a model that
    changes its logits after the head or adds an auxiliary loss gets ``{1: ...}``, the
    reason in ``loss_chunk_refusal`` (and in its plans' notes). A ``loss_fn`` is
    chunked only where it is a ``memory.declared_loss.LogitsCrossEntropy`` whose
    logits are its head's output (``memory.head.declared_loss_refusal``); a user's
    own function is not looked into. A model with an auxiliary loss is also
    ``batch_dependent``: its plans get no micro-batches."""
    from memory.declared_loss import LogitsCrossEntropy
    from memory.head import declared_loss_refusal, own_loss_refusal

    refusal = None
    chunkable = False
    if any(c > 1 for c in chunk_options):
        if (
            loss_fn is None
            and isinstance(inputs, dict)
            and "labels" in inputs
            and ChunkedHead.find(model, 2) is not None
        ):
            refusal = own_loss_refusal(model, inputs)
            chunkable = refusal is None
        elif isinstance(loss_fn, LogitsCrossEntropy):  # a declared loss: checked
            loss_fn, refusal = declared_loss_refusal(model, inputs, targets, loss_fn)
            chunkable = refusal is None
    options = [c for c in chunk_options if c == 1 or chunkable] or [1]
    units = units if units is not None else find_units(model, inputs)
    # an auxiliary loss (a router's load balancing) is a function of the whole
    # batch: micro-batches would train another loss, so none, as for BatchNorm
    aux = refusal is not None and "auxiliary loss" in refusal
    layout = batch_layout(model)
    coupled = batch_coupling(
        model, inputs, targets, loss_fn, layout, batch_size_of(inputs, layout)
    )
    if coupled is not None:
        logger.info("no micro-batches: %s", coupled)
    out = {}
    for c in options:
        prof = profile_units(
            model, inputs, targets, loss_fn, units=units, loss_chunks=c
        )
        out[c] = replace(
            prof,
            runtime_bytes=runtime_bytes,
            loss_chunk_refusal=refusal,
            batch_dependent=prof.batch_dependent or aux or coupled is not None,
        )
    return out


def plan_units(
    profiles: dict[int, Profile],
    budget_bytes: int | None = None,
    **plan_kwargs: Any,
) -> tuple[Any, Profile]:
    """The fastest plan within ``budget_bytes`` (None: the smallest plan) over the
    ``unit_profiles`` (one per loss chunk count), and the profile it came from.

    ``plan_kwargs`` go to ``memory.plan.plan_memory`` (disk budget, offload
    directory, micro-batching).

    Raises:
        BudgetError: no plan fits; the error of the setting that comes closest.
    """
    from memory.errors import BudgetError
    from memory.plan import plan_memory

    best = None
    errors: list[BudgetError] = []
    for prof in profiles.values():
        try:
            plan = plan_memory(
                prof, budget_bytes, batch_size=prof.batch_size, **plan_kwargs
            )
        except BudgetError as e:
            errors.append(e)
            continue
        key = (
            plan.predicted_peak_bytes if budget_bytes is None else plan.predicted_step_s
        )
        if best is None or key < best[0]:
            best = (key, plan, prof)
    if best is None:
        raise min(errors, key=lambda e: e.min_budget_bytes or 0)
    return best[1], best[2]
