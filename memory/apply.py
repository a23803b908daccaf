"""A memory plan applied to a model as it is: per unit, through torch's own mechanisms.

``apply_plan(units, plan)`` replaces each planned unit's ``forward`` with a wrapper (the
way ``checkpoint_wrapper`` does) and leaves the model's own ``forward`` untouched, so any
arguments, keyword arguments, dict or tuple inputs and outputs, ``ModelOutput``s, tied
parameters and buffers work. Per unit, by its ``BlockPlan``:

- ``keep``: nothing changes.
- ``recompute``: non-reentrant ``torch.utils.checkpoint`` around the unit's forward:
  only its inputs are kept, the forward reruns in backward with the RNG state of the
  first run (dropout masks agree) and on throw-away copies of its buffers (BatchNorm
  statistics are updated once).
- ``offload``: the tensors the unit's forward saves for backward go through
  saved-tensor hooks to a file (``memory.offload``) and come back in backward.
- ``recompute`` with ``offload_inputs``: recompute, and the inputs the recompute keeps
  go to a file too (checkpoint saves them with ``save_for_backward`` outside its own
  hooks, so the offload hooks around it take them).

Every tensor argument, keyword arguments included, is handed to the checkpoint as a
positional input, so all of them can be offloaded. Without autograd (evaluation, a
``no_grad`` forward) the wrappers call the unit directly.

Example:
    >>> applied = apply_plan(find_units(model, inputs), plan, offload_dir=tmp)  # +SKIP
    >>> model(**inputs).loss.backward(); applied.end_step()  # doctest: +SKIP
    >>> applied.remove()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from memory.blocks import Block
from memory.errors import MemoryPlanError
from memory.offload import ActivationOffload, OffloadedActivations
from memory.recompute import BufferSnapshot, frozen_buffers, has_buffers
from memory.spec import BlockPlan, MemoryPlan
from memory.streaming import ParamStreamer


class AppliedPlan:
    """The wrappers a plan installed; ``end_step()`` after each backward, ``remove()``.

    Attributes:
        units: the units, in execution order.
        plan: the plan applied.
        offload: where offloaded tensors go (None when nothing is offloaded).
    """

    def __init__(
        self,
        units: Sequence[Block],
        plan: MemoryPlan,
        *,
        offload_dir: str | os.PathLike | None = None,
        device: torch.device | str = "cpu",
        hparams: Callable[[], dict] | None = None,
        defer: Callable[[], bool] | None = None,
        values: Callable[[nn.Parameter], torch.Tensor] | None = None,
    ) -> None:
        names = [u.name for u in units]
        planned = {b.name: b for b in plan.blocks}
        unknown = [n for n in planned if n not in names]
        if unknown:
            raise MemoryPlanError(
                f"the plan names units {unknown[:3]} that the model does not have (its "
                f"units: {names[:6]}...); make the plan for this model"
            )
        streamed = [b.name for b in plan.blocks if b.state == "stream"]
        self.units = list(units)
        self.plan = plan
        self.device = torch.device(device)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.offload: ActivationOffload | None = None
        self.streamer: ParamStreamer | None = None
        disk = streamed or any(
            b.activations == "offload" or b.offload_inputs for b in plan.blocks
        )
        if disk:
            if offload_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="fleetfit-offload-")
                offload_dir = self._tmp.name
            Path(offload_dir).mkdir(parents=True, exist_ok=True)
            self.offload = ActivationOffload(offload_dir)
        if streamed:
            assert offload_dir is not None
            self.streamer = ParamStreamer(
                self.units,
                streamed,
                offload_dir,
                hparams=hparams or (lambda: {"lr": 1e-3}),
                defer=defer or (lambda: False),
                values=values,
            )
        self._live: list[OffloadedActivations] = []
        self._counter = itertools.count()
        self._restore: list[tuple[torch.nn.Module, Any]] = []
        for k, u in enumerate(self.units):
            bp = planned.get(u.name)
            if bp is None or (
                bp.activations == "keep"
                and not bp.offload_inputs
                and bp.state == "resident"
            ):
                continue
            self._wrap(k, u, bp)

    # ------------------------------------------------------------------ wrapping
    def _wrap(self, k: int, unit: Block, bp: BlockPlan) -> None:
        mod = unit.module
        had = "forward" in mod.__dict__
        self._restore.append((mod, mod.__dict__.get("forward") if had else None))
        inner = mod.forward
        if bp.state == "stream":
            fwd = self._streamed(k, unit.name, mod, inner, bp.offload_inputs)
        elif bp.activations == "recompute":
            fwd = self._recompute(unit.name, mod, inner, bp.offload_inputs)
        elif bp.activations == "offload":
            fwd = self._offloaded(unit.name, mod, inner)
        else:
            raise MemoryPlanError(
                f"unit {unit.name}: offload_inputs needs activations='recompute'"
            )
        mod.forward = fwd  # type: ignore[method-assign]

    def _acts(self, name: str, keep: list[torch.Tensor]) -> OffloadedActivations:
        assert self.offload is not None
        key = f"{name}-{next(self._counter)}"
        acts = self.offload.activations(key, keep, device=self.device)
        self._live.append(acts)
        return acts

    def _streamed(
        self,
        k: int,
        name: str,
        mod: torch.nn.Module,
        inner: Callable,
        offload_inputs: bool,
    ) -> Callable:
        """Recompute, with the parameters loaded for each run and unloaded after the
        first (the rerun's stay until the unit's gradients are complete)."""
        streamer = self.streamer
        assert streamer is not None

        def loaded(*args: Any, **kwargs: Any) -> Any:
            streamer.load(k)
            return inner(*args, **kwargs)

        wrapped = self._recompute(name, mod, loaded, offload_inputs)

        def forward(*args: Any, **kwargs: Any) -> Any:
            in_backward = torch._C._current_graph_task_id() != -1
            watch = torch.is_grad_enabled() and not in_backward
            called: set[int] = {id(mod)}  # the unit itself: its own parameters
            hook = (
                torch.nn.modules.module.register_module_forward_pre_hook(
                    lambda m, _a: called.add(id(m))
                )
                if watch
                else None
            )
            try:
                out = wrapped(*args, **kwargs)
            finally:
                if hook is not None:
                    hook.remove()
                if not in_backward:
                    streamer.unload(k)
            if watch:  # the gradients its backward brings: of what this run used
                streamer.expect(k, out, (args, kwargs), called)
            return out

        return forward

    def _recompute(
        self, name: str, mod: torch.nn.Module, inner: Callable, offload_inputs: bool
    ) -> Callable:
        buffered = has_buffers(mod)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            # the rerun starts from the buffers this run found (an EMA it updates)
            snap = BufferSnapshot(mod) if buffered else None

            def context_fn() -> tuple[Any, Any]:
                return contextlib.nullcontext(), frozen_buffers(mod, snap)

            flat, spec = tree_flatten((args, kwargs))
            where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            tensors = [flat[i] for i in where]

            def run(*ts: torch.Tensor) -> Any:
                vals = list(flat)
                for i, t in zip(where, ts):
                    vals[i] = t
                a, k = tree_unflatten(vals, spec)
                return inner(*a, **k)

            extra: dict[str, Any] = {}
            if snap is not None:
                extra["context_fn"] = context_fn
            if not offload_inputs:
                out = checkpoint(run, *tensors, use_reentrant=False, **extra)
            else:
                acts = self._acts(name, list(mod.parameters()))
                with acts.hooks():
                    out = checkpoint(run, *tensors, use_reentrant=False, **extra)
                acts.commit()
            if snap is not None:
                snap.settle()
            return out

        return forward

    def _offloaded(self, name: str, mod: torch.nn.Module, inner: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            acts = self._acts(name, list(mod.parameters()))
            with acts.hooks():
                out = inner(*args, **kwargs)
            acts.commit()
            return out

        return forward

    # ------------------------------------------------------------------ lifetime
    def end_step(self) -> None:
        """Remove this step's offload files (after its backward)."""
        for acts in self._live:
            acts.release()
        self._live = []

    @property
    def offloaded_bytes(self) -> int:
        """Bytes written to disk by the step so far."""
        return sum(a.bytes_offloaded for a in self._live)

    def remove(self, *, restore: bool = True) -> None:
        """Put every unit's own ``forward`` back, the streamed parameters back into
        the model (``restore``; else they stay placeholders), and remove the files
        (idempotent)."""
        self.end_step()
        if self.streamer is not None:
            if restore:
                self.streamer.restore()
            else:
                self.streamer.close()
            self.streamer = None
        for mod, fwd in self._restore:
            if fwd is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = fwd  # type: ignore[method-assign]
        self._restore = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_plan(
    units: Sequence[Block],
    plan: MemoryPlan,
    *,
    offload_dir: str | os.PathLike | None = None,
    device: torch.device | str = "cpu",
    hparams: Callable[[], dict] | None = None,
    defer: Callable[[], bool] | None = None,
) -> AppliedPlan:
    """Install ``plan`` on the units (see the module docstring; ``hparams`` and
    ``defer`` as ``memory.streaming.ParamStreamer`` takes them)."""
    return AppliedPlan(
        units,
        plan,
        offload_dir=offload_dir,
        device=device,
        hparams=hparams,
        defer=defer,
    )
