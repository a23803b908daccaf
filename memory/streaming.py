"""Parameter, gradient and AdamW-state streaming for any model, by hooks.

A streamed unit's parameters live in the on-disk ``BlockStore`` (with their gradient
accumulator and AdamW state); in the model each is a placeholder of the right shape
and dtype holding one element (``torch.zeros(1).expand(shape)``), so code that reads
shapes and dtypes keeps working. ``memory.apply`` runs a streamed unit under
non-reentrant recompute and calls ``load`` before each run of its forward (the first
and the rerun in backward) and ``unload`` after the first.

When the unit's backward has produced every gradient of its parameters (torch's
post-accumulate-grad hooks; a tied parameter's hook fires once both uses are summed),
the unit's AdamW update runs right away on the mapped parameters, a chunk of state at
a time, and the unit is unloaded: the optimizer-in-backward pattern. Where the update
must wait (more micro-batches to come, gradient accumulation over calls, or global
gradient-norm clipping, which needs every gradient first), the gradients go to the
store's accumulator instead and ``update`` applies them after the backward, scaled by
the clipping coefficient. The global norm is computed the way
``torch.nn.utils.clip_grad_norm_`` does it (the norm of the per-tensor norms, in
parameter order), from the resident gradients and the stored ones, so clipping is
exact.

Tied parameters belong to the first unit that uses them; every other unit using one
must be streamed too (``MemoryPlanError`` otherwise). Such a unit gets its own leaf
tensor for the parameter, loaded from the owner's file, and when its backward has
produced that leaf's gradient the gradient goes to the owner's accumulator on disk:
a tied head's gradient does not stay in memory until the embedding's backward, as it
would in autograd's buffer for one shared leaf. The owner's update adds it (float
addition commutes, so the sum equals autograd's).

Two kinds of parameter are never loaded or given a gradient whole (*row-streamed*):

- an embedding table (``nn.Embedding``, or an ``nn.EmbeddingBag`` summing or averaging
  its bags, whose weight the unit owns, ``row_lookups``)
  is looked up in its mapped file, which touches only the rows of the batch's tokens,
  and its backward is made sparse (``sparse=True`` while the plan is applied): the
  store sums the looked-up rows (in the order the dense backward sums them, so the
  result is the same bit for bit) and adds each to the accumulator on disk.
- a chunked loss head's weight (``memory.head``), own or tied, is read a vocabulary
  block at a time from its file and its gradient written there a block at a time
  (``weight_rows``): a tied head's gradient goes straight into the owner's
  accumulator, where the embedding's rows are added to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memory.blocks import Block
from memory.chunked_loss import WeightRows
from memory.errors import MemoryPlanError
from memory.store import BlockStore


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """One element of ``p``'s dtype seen with ``p``'s shape (no storage to speak of)."""
    return torch.zeros(1, dtype=p.dtype, device=p.device).expand(p.shape)


def parameter_owners(units: Sequence[Block]) -> dict[int, int]:
    """The owning unit of each parameter, by ``id``: the first unit, in execution
    order, that holds it (a tied parameter belongs to its first user)."""
    owner: dict[int, int] = {}
    for k, u in enumerate(units):
        for p in u.module.parameters():
            owner.setdefault(id(p), k)
    return owner


Lookup = nn.Embedding | nn.EmbeddingBag
"""A table looked up by rows: an embedding, or a bag of them (sum or mean)."""


def _row_lookup(mod: nn.Module) -> bool:
    if isinstance(mod, nn.EmbeddingBag):
        return mod.mode != "max"  # a max bag has no sparse gradient
    return isinstance(mod, nn.Embedding)


def row_lookups(units: Sequence[Block]) -> dict[int, list[Lookup]]:
    """Per unit index, the embedding tables whose lookups a streamed unit makes
    sparse: ``nn.Embedding`` and ``nn.EmbeddingBag`` (sum or mean) modules inside
    the unit (and no other unit) whose trainable weight the unit owns, without
    ``max_norm`` (which renormalises rows in place)."""
    owner = parameter_owners(units)
    seen: dict[int, set[int]] = {}
    for k, u in enumerate(units):
        for mod in u.module.modules():
            seen.setdefault(id(mod), set()).add(k)
    out: dict[int, list[Lookup]] = {}
    for k, u in enumerate(units):
        for mod in u.module.modules():
            if (
                _row_lookup(mod)
                and seen[id(mod)] == {k}
                and owner.get(id(mod.weight)) == k
                and mod.weight.requires_grad
                and mod.max_norm is None
                and mod not in out.get(k, [])
            ):
                out.setdefault(k, []).append(mod)
    return out


class _StoredRows:
    """``WeightRows`` over one parameter in the store (``memory.chunked_loss``)."""

    def __init__(
        self, store: BlockStore, key: int, index: int, done: Callable[[], None]
    ) -> None:
        self.store, self.key, self.index, self._done = store, key, index, done
        self._first: bool | None = None

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.store.load_rows(self.key, self.index, start, stop)

    def add_grad(self, start: int, stop: int, grad: torch.Tensor) -> None:
        if self._first is None:  # nothing accumulated before this backward
            self._first = not self.store.has_grad(self.key, self.index)
        self.store.accumulate_rows(
            self.key, self.index, start, stop, grad, first=self._first
        )

    def done(self) -> None:
        self.store.rows_done(self.key, self.index)
        self._first = None
        self._done()


class ParamStreamer:
    """The streamed units' state on disk and the hooks that move it.

    Args:
        units: all units, in execution order.
        streamed: names of the streamed units.
        directory: where the store's files go.
        hparams: ``hparams() -> dict(lr=..., betas=..., eps=..., weight_decay=...)``,
            read at each update (a learning-rate schedule changes ``lr``).
        defer: ``defer() -> bool``: True while the update must wait (see the module
            docstring).
        values: ``values(p)``, the initial value of streamed parameter ``p`` (default:
            ``p`` itself); for a model built without its weights, whose streamed
            parameters are placeholders read from a file into the store one unit at
            a time (``memory.materialize``).
    """

    def __init__(
        self,
        units: Sequence[Block],
        streamed: Sequence[str],
        directory: str | os.PathLike,
        *,
        hparams: Callable[[], dict],
        defer: Callable[[], bool],
        values: Callable[[nn.Parameter], torch.Tensor] | None = None,
    ) -> None:
        self.units = list(units)
        self.index = {u.name: k for k, u in enumerate(self.units)}
        self.streamed = {self.index[n] for n in streamed}
        self.hparams = hparams
        self.defer = defer
        owner = parameter_owners(self.units)
        self.own: dict[int, list[nn.Parameter]] = {}
        self.borrowed: dict[int, list[tuple[int, int, nn.Parameter]]] = {}
        for k, u in enumerate(self.units):
            ps = list(u.module.parameters())
            if k in self.streamed:
                self.own[k] = [p for p in ps if owner[id(p)] == k]
            for p in ps:
                a = owner[id(p)]
                if a == k or a not in self.streamed:
                    continue
                if k not in self.streamed:
                    raise MemoryPlanError(
                        f"unit {u.name!r} is resident but shares a parameter with "
                        f"streamed unit {self.units[a].name!r}, which owns it (tied "
                        f"weights); stream both or keep {self.units[a].name!r} "
                        "resident"
                    )
                j = next(i for i, q in enumerate(self.own[a]) if q is p)
                self.borrowed.setdefault(k, []).append((a, j, p))
        self.store = BlockStore(directory)
        self._loaded: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, set[int]] = {}
        self._hooks = []
        self.stream_ids = {id(p) for ps in self.own.values() for p in ps}
        # a borrower's own leaf for each borrowed parameter, in the modules' places
        self._leaves: dict[int, list[tuple[int, int, nn.Parameter]]] = {}
        self._swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        for k, borrowed in self.borrowed.items():
            leaves = []
            for a, j, p in borrowed:
                q = nn.Parameter(placeholder(p), requires_grad=p.requires_grad)
                for mod in self.units[k].module.modules():
                    for name, cur in list(mod._parameters.items()):
                        if cur is p:
                            mod._parameters[name] = q
                            self._swapped.append((mod, name, p))
                leaves.append((a, j, q))
                if q.requires_grad:
                    self._hooks.append(
                        q.register_post_accumulate_grad_hook(self._lent(k, a, j))
                    )
            self._leaves[k] = leaves
        try:
            for k, ps in self.own.items():
                initial = [p.detach() if values is None else values(p) for p in ps]
                self.store.add(k, initial, with_grads=True)
                del initial  # one unit's values in memory at a time
                for i, p in enumerate(ps):
                    p.data = placeholder(p)
                    if p.requires_grad:
                        self._hooks.append(
                            p.register_post_accumulate_grad_hook(self._ready(k, i))
                        )
        except BaseException:
            self.store.close()
            raise
        self._reset_pending()
        self._sparse: list[Lookup] = []
        for k, mods in row_lookups(self.units).items():
            if k in self.streamed:
                for mod in mods:
                    if not mod.sparse:
                        mod.sparse = True
                        self._sparse.append(mod)

    def _reset_pending(self) -> None:
        self._pending = {
            k: {i for i, p in enumerate(ps) if p.requires_grad}
            for k, ps in self.own.items()
        }
        self._used: dict[int, set[int]] = {}

    def expect(self, k: int, out: Any, inputs: Any, called: set[int]) -> None:
        """After a forward of unit ``k`` with autograd (``out`` from ``inputs``, the
        modules ``called`` by ``id``): the gradients its backward waits for are
        those of the parameters that forward used. A parameter held only by modules
        the forward did not call and not reached from ``out``'s graph (an expert no
        token was routed to) gets no gradient this backward, so the unit finishes
        (unmapped, updated) when the others have theirs, not at the end of the
        backward with every such unit's gradients still in memory."""
        if k not in self._pending:
            return
        ps = self.own[k]
        holders: dict[int, set[int]] = {}
        for mod in self.units[k].module.modules():
            for p in mod._parameters.values():
                if p is not None:
                    holders.setdefault(id(p), set()).add(id(mod))
        reached: set[int] = set()
        stop = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
        stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in stop:
                continue
            seen.add(node)
            var = getattr(node, "variable", None)
            if var is not None:
                reached.add(id(var))
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)
        used = self._used.setdefault(k, set())
        for i, p in enumerate(ps):
            if p.requires_grad and (
                id(p) in reached or not holders.get(id(p), set()).isdisjoint(called)
            ):
                used.add(i)
        self._pending[k] = set(used)  # no gradient has come yet: backward follows

    # ------------------------------------------------------------------ moving
    def load(self, k: int) -> None:
        """Point unit ``k``'s parameters (own and borrowed) at their mapped files."""
        if k in self._loaded:
            return
        views = self.store.load(k) if k in self.own else []
        for p, v in zip(self.own.get(k, []), views, strict=True):
            p.data = v
        keep = list(views)
        for a, j, q in self._leaves.get(k, []):
            v = self.store.load(a, [j])[0]
            q.data = v
            keep.append(v)
        self._loaded[k] = keep

    def unload(self, k: int) -> None:
        """Placeholders again; the mappings go with the last view."""
        if self._loaded.pop(k, None) is None:
            return
        for p in self.own.get(k, []):
            p.data = placeholder(p)
        for _a, _j, q in self._leaves.get(k, []):
            q.data = placeholder(q)

    # ------------------------------------------------------------------ updates
    def _ready(self, k: int, i: int) -> Callable[..., None]:
        """Parameter ``i`` of unit ``k`` has its gradient (a hook; also called with
        no argument once its rows are all in the store)."""

        def hook(_p: torch.Tensor | None = None) -> None:
            pending = self._pending.get(k)
            if pending is None:
                return
            pending.discard(i)
            if not pending:
                self._finish(k)

        return hook

    def _lent(self, k: int, a: int, j: int) -> Callable[[torch.Tensor], None]:
        """A borrower's gradient for owner ``a``'s parameter ``j``: to the store."""

        def hook(q: torch.Tensor) -> None:
            g = q.grad
            q.grad = None
            if all(
                leaf.grad is None for _, _, leaf in self._leaves[k]
            ) and not self._pending.get(k):
                self.unload(k)  # its weight unmapped before its gradient is written
            if g is not None:
                self.store.accumulate_grads_chunked(a, {j: g})
            del g

        return hook

    def _finish(self, k: int) -> None:
        """Unit ``k``'s gradients are complete for this backward: unmap its
        parameters, then update them from the file (or store the gradients), a chunk
        at a time."""
        self._pending.pop(k, None)
        ps = self.own[k]
        grads = [p.grad for p in ps]
        for p in ps:
            p.grad = None
        self.unload(k)
        if self.defer():
            self.store.accumulate_grads_chunked(
                k, {i: g for i, g in enumerate(grads) if g is not None}
            )
        else:
            self.store.adamw_step_mapped(k, grads, **self.hparams())
        del grads

    def end_backward(self) -> None:
        """After a backward: units whose hooks did not all fire (a parameter without
        a gradient) are finished now; every unit is unloaded."""
        for k in list(self._pending):
            if self._pending[k] != {
                i for i, p in enumerate(self.own[k]) if p.requires_grad
            } or any(p.grad is not None for p in self.own[k]):
                self._finish(k)
        self._reset_pending()
        for k in list(self._loaded):
            self.unload(k)

    def weight_rows(self, t: torch.Tensor) -> WeightRows | None:
        """Rows of streamed parameter ``t`` (own or a borrower's leaf) from and to
        the store, for the chunked head; None for a parameter in memory."""
        for k, ps in self.own.items():
            for i, p in enumerate(ps):
                if p is t:
                    return _StoredRows(self.store, k, i, self._ready(k, i))
        for leaves in self._leaves.values():
            for a, j, q in leaves:
                if q is t:
                    return _StoredRows(self.store, a, j, lambda: None)
        return None

    def stored_norms(self) -> dict[int, torch.Tensor]:
        """Per-parameter norms of the stored gradients, by ``id`` of the parameter."""
        out = {}
        for k, ps in self.own.items():
            for i, p in enumerate(ps):
                g = self.store.stored_grad(k, i)
                if g is not None:
                    out[id(p)] = torch.linalg.vector_norm(g, 2.0)
                del g
        return out

    def owner(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter a borrower's own leaf stands for (``t`` itself otherwise)."""
        for leaves in self._leaves.values():
            for a, j, q in leaves:
                if q is t:
                    return self.own[a][j]
        return t

    def read(self, p: torch.Tensor) -> torch.Tensor:
        """Streamed parameter ``p``'s current value, mapped from its file (drop it to
        unmap)."""
        for k, ps in self.own.items():
            for i, q in enumerate(ps):
                if q is p:
                    return self.store.load(k, [i])[0]
        raise KeyError("not a streamed parameter")

    def stored_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """A copy of streamed parameter ``p``'s gradient in the store, or None."""
        for k, ps in self.own.items():
            for i, q in enumerate(ps):
                if q is p:
                    g = self.store.stored_grad(k, i)
                    return None if g is None else g.clone()
        return None

    def update(self, coef: torch.Tensor | None = None) -> None:
        """The deferred updates: stored gradients times ``coef``, then AdamW."""
        for k, ps in self.own.items():
            self.store.adamw_step_mapped(
                k, [None] * len(ps), scale=coef, **self.hparams()
            )

    # ------------------------------------------------------------------ state
    def restore(self) -> None:
        """Put the trained parameters back into the model (copies) and close."""
        for k, ps in self.own.items():
            for p, v in zip(ps, self.store.read(k), strict=True):
                p.data = v
        self.close()

    def close(self) -> None:
        for emb in self._sparse:
            emb.sparse = False
        self._sparse = []
        for mod, name, p in self._swapped:  # the tied parameters as they were
            mod._parameters[name] = p
        self._swapped = []
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._loaded = {}
        self.store.close()


def _tensors(x: Any) -> list[torch.Tensor]:
    return [
        t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)
    ]
