"""Training steps of any model under a memory plan, with the settings users expect.

``PlannedTrainer`` applies the plan to the model's units (``memory.apply``) and runs
AdamW steps: the batch is cut into the plan's micro-batches (``memory.batch``), each
micro-batch's loss weighted by its share of the items that count, gradients
accumulated; then, optionally, global gradient-norm clipping, a learning-rate
schedule and accumulation over several calls before the update.

With every unit resident the whole gradient exists before the update, so the global
norm is exact (``torch.nn.utils.clip_grad_norm_``). Results equal plain training
(``loss.backward(); AdamW.step()``): bit for bit when only data moves (recompute,
offload), within float tolerance when micro-batching changes the order of sums.

Example:
    >>> trainer = PlannedTrainer(model, plan, inputs, settings=TrainSettings(lr=3e-4))
    >>> loss = trainer.step(inputs)  # doctest: +SKIP
    >>> trainer.close()  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memory.apply import AppliedPlan
from memory.batch import (
    batch_dependent_layer,
    batch_layout,
    batch_size_of,
    first_items,
    loss_count,
    loss_of,
    short_batch_microbatches,
    split_batch,
)
from memory.blocks import Block
from memory.declared_loss import LogitsCrossEntropy
from memory.errors import MemoryPlanError
from memory.guard import MemoryGuard
from memory.head import ChunkedHead, declared_head
from memory.materialize import (
    StateSource,
    build_without_weights,
    has_meta_parameters,
    load_state_into,
    materialize,
    streamed_parameter_ids,
)
from memory.proximal import ProximalTerm
from memory.spec import MemoryPlan
from memory.units import call_model, find_units, no_kv_cache


@dataclass(frozen=True)
class TrainSettings:
    """AdamW and the step's extras.

    Attributes:
        lr: learning rate (before the schedule).
        betas, eps, weight_decay: AdamW's.
        clip_norm: clip the global gradient norm to this (None: no clipping).
        accumulate_steps: calls of ``step`` whose gradients add up before one update
            (each call's loss weighted 1 / accumulate_steps).
        lr_schedule: ``lr_schedule(update_index) -> factor`` on ``lr`` (None: 1).
        proximal_mu: FedProx's ``mu / 2 * ||w - w0||^2`` towards the weights the
            trainer starts from (``memory.proximal``); 0: none.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    clip_norm: float | None = None
    accumulate_steps: int = 1
    lr_schedule: Callable[[int], float] | None = None
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm={self.clip_norm} must be positive or None")
        if self.accumulate_steps < 1:
            raise ValueError(
                f"accumulate_steps={self.accumulate_steps} must be at least 1"
            )


def make_optimizer(
    model: nn.Module, settings: TrainSettings, exclude: set[int] | None = None
) -> torch.optim.AdamW | None:
    """AdamW over the trainable parameters (each tied parameter once), less those
    whose ``id`` is in ``exclude`` (streamed: the store updates them)."""
    skip = exclude or set()
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    if not params:
        return None  # everything is streamed
    return torch.optim.AdamW(
        params,
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


class PlannedTrainer:
    """Trains ``model`` under ``plan``.

    Args:
        model: any module; called as ``memory.units.call_model`` describes.
        plan: the memory plan; its blocks name the model's units.
        inputs: an example batch's inputs, to find the units (unless ``units`` given).
        loss_fn: ``loss_fn(output, targets)``; None uses the model's ``output.loss``.
            A plan with loss chunks takes None or a declared
            ``memory.LogitsCrossEntropy`` (its head found on ``inputs`` unless it
            names it), whose micro-batches are weighted by its counted targets.
        settings: AdamW and the step's extras.
        units: the units (default: ``find_units(model, inputs)``).
        offload_dir: where offloaded tensors go (default: a temporary directory).
        device: where the model runs.
        count_fn: ``count_fn(inputs, targets) -> int``, the items a micro-batch's mean
            loss averages over (default: ``memory.batch.count_items``).
        memory_budget_bytes: stop a step whose resident memory above
            ``baseline_bytes`` crosses this (``memory.guard.MemoryGuard``, checked at
            every unit's forward and after the step): ``BudgetExceededError`` names
            the bytes, the budget and the unit, instead of the kernel's OOM kill.
        baseline_bytes: the process's resident bytes after its imports (default:
            when each step starts).
        init_state: for a model built under ``memory.materialize.params_on_meta``:
            the state file its parameters are read from (``TensorFile``), resident
            units now and streamed units straight into the store, one unit at a
            time; ``units`` must then be given (the model cannot run to find them).
    """

    def __init__(
        self,
        model: nn.Module,
        plan: MemoryPlan,
        inputs: Any = None,
        *,
        loss_fn: Callable | None = None,
        settings: TrainSettings | None = None,
        units: Sequence[Block] | None = None,
        offload_dir: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        count_fn: Callable[[Any, Any], int] | None = None,
        memory_budget_bytes: int | None = None,
        baseline_bytes: int | None = None,
        init_state: StateSource | None = None,
    ) -> None:
        self.layout = batch_layout(model)  # what of a batch may be cut
        if self.layout == () and plan.num_microbatches > 1:
            raise MemoryPlanError(
                f"{type(model).__name__}'s batch must not be cut (batch_inputs = ()), "
                f"but the plan has {plan.num_microbatches} micro-batches; plan with "
                "num_microbatches=1"
            )
        self._refuse_batch_dependent(model, plan, plan.num_microbatches)
        ProximalTerm.refuse(  # before any file is opened
            (settings or TrainSettings()).proximal_mu,
            (b.name for b in plan.blocks if b.state == "stream"),
            "PlannedTrainer",
        )
        values = None
        if has_meta_parameters(model):
            if init_state is None or units is None:
                raise MemoryPlanError(
                    f"{type(model).__name__} has parameters on the meta device; give "
                    "init_state (the file to read them from) and its units"
                )
            values = _materialize(model, plan, units, init_state)
        self.head: ChunkedHead | None = None
        declared = isinstance(loss_fn, LogitsCrossEntropy)
        if plan.loss_chunks > 1:
            if loss_fn is not None and not declared:
                raise MemoryPlanError(
                    "a plan with loss chunks computes the loss in the model's head: "
                    "its own loss, or a declared memory.LogitsCrossEntropy, not "
                    "another loss_fn; plan with loss_chunks=1"
                )
            if isinstance(loss_fn, LogitsCrossEntropy) and loss_fn.head is None:
                if inputs is None:
                    raise MemoryPlanError(
                        "a plan with loss chunks needs LogitsCrossEntropy's head: give "
                        "example inputs or LogitsCrossEntropy(head=...)"
                    )
                found, why = declared_head(model, inputs, loss_fn)
                if found is None:
                    raise MemoryPlanError(f"{why}; plan with loss_chunks=1")
                loss_fn = loss_fn.with_head(found)
            self.head = ChunkedHead.for_loss(model, plan.loss_chunks, loss_fn)
            if self.head is None:
                raise MemoryPlanError(
                    f"{type(model).__name__} has no linear output layer to chunk its "
                    "loss over; plan with loss_chunks=1"
                )
            self.head.install()  # before the plan's wrappers, which wrap it
        if units is None:
            if inputs is None:
                raise MemoryPlanError("PlannedTrainer needs example inputs or units")
            units = find_units(model, inputs)
        self.model = model
        self.plan = plan
        self.loss_fn = loss_fn
        self.settings = settings or TrainSettings()
        self.count_fn = count_fn or (lambda x, y: loss_count(model, loss_fn, x, y))
        self._use_cache = no_kv_cache(model)
        self.num_updates = 0
        self._calls = 0
        self._last_part = True
        self._coupling_checked = False
        self.last_grad_norm: float | None = None
        self.applied = AppliedPlan(
            units,
            plan,
            offload_dir=offload_dir,
            device=device,
            hparams=self._hparams,
            defer=self._defer,
            values=values,
        )
        if self.head is not None and self.applied.streamer is not None:
            # a streamed head reads its weight and writes its gradient by blocks
            self.head.weight_rows = self.applied.streamer.weight_rows
        streamed = self.applied.streamer.stream_ids if self.applied.streamer else set()
        self.optimizer = make_optimizer(model, self.settings, exclude=streamed)
        self.proximal = ProximalTerm(
            self.optimizer.param_groups[0]["params"] if self.optimizer else [],
            self.settings.proximal_mu,
        )
        # the run-time guard: each unit's forward (and rerun) checks the resident set
        self.guard = (
            MemoryGuard(memory_budget_bytes, baseline_bytes=baseline_bytes)
            if memory_budget_bytes is not None
            else MemoryGuard.disabled()
        )
        self._guard_hooks = []
        if memory_budget_bytes is not None:
            for u in units:

                def check(_m: nn.Module, _a: object, _name: str = u.name) -> None:
                    self.guard.unit = _name
                    self.guard.check()

                self._guard_hooks.append(u.module.register_forward_pre_hook(check))

    def step(
        self, inputs: Any, targets: Any = None, *, num_microbatches: int | None = None
    ) -> float:
        """One call: forward and backward of the batch; an update every
        ``accumulate_steps`` calls. Returns the batch's loss. ``num_microbatches``
        overrides the plan's for this batch (a short batch that does not divide into
        the plan's micro-batches: give at least as many, no larger ones)."""
        with self.guard:
            loss = self.backward(inputs, targets, num_microbatches=num_microbatches)
            self._calls += 1
            if self._calls % self.settings.accumulate_steps == 0:
                self.guard.unit = "optimizer step"
                self._update()
            self.guard.check()
        return loss

    def update(self) -> None:
        """The update ``step`` makes after its ``backward``: for a caller that reads
        ``gradients()`` between the two (as the architecture zoo compares them before
        the optimizer step). Streamed units' gradients wait for it only where their
        update is deferred (under clipping or accumulation); otherwise ``backward``
        has applied them already."""
        with self.guard:
            self._calls += 1
            self.guard.unit = "optimizer step"
            self._update()
            self.guard.check()

    def train(
        self, batches: Iterable[Any], *, planned_size: int | None = None
    ) -> list[float]:
        """One ``step`` per ``(inputs, targets)`` batch; returns their losses.

        A batch shorter than ``planned_size`` (the largest batch of the run; default:
        the plan's batch, taken as the first batch's size) that does not divide into
        the plan's micro-batches gets ``short_batch_microbatches``'s count: equal
        micro-batches no larger than the plan's, so its memory bound holds."""
        losses: list[float] = []
        m = self.plan.num_microbatches
        for inputs, targets in batches:
            k = m
            if m > 1:
                actual = batch_size_of(inputs, self.layout)
                if planned_size is None:
                    planned_size = actual
                k = short_batch_microbatches(m, planned=planned_size, actual=actual)
            losses.append(self.step(inputs, targets, num_microbatches=k))
        return losses

    def backward(
        self, inputs: Any, targets: Any = None, *, num_microbatches: int | None = None
    ) -> float:
        """Forward and backward of one batch under the plan, gradients added to
        ``.grad`` (scaled by 1 / accumulate_steps); no update. Returns its loss."""
        m = num_microbatches or self.plan.num_microbatches
        if m > 1:
            self._refuse_batch_dependent(self.model, self.plan, m)
            self._refuse_coupled(inputs, targets, m)
        parts = split_batch(inputs, targets, m, self.layout)
        if m > 1:
            counts = [self.count_fn(x, y) for x, y in parts]
            total = sum(counts)
            if total <= 0:
                raise MemoryPlanError(
                    "the batch has no item that counts (every label is -100)"
                )
            weights = [c / total for c in counts]
        else:
            weights = [1.0]
        scale = 1.0 / self.settings.accumulate_steps
        loss_value = 0.0
        streamer = self.applied.streamer
        try:
            for j, ((x, y), w) in enumerate(zip(parts, weights)):
                self._last_part = j == len(parts) - 1
                if self.head is not None:
                    loss = self.head.loss_of(self.model, x, y)
                else:
                    out = call_model(self.model, x)
                    loss = loss_of(out, y, self.loss_fn)
                    del out
                part = loss if (w == 1.0 and scale == 1.0) else loss * (w * scale)
                part.backward()
                if self.head is not None:
                    self.head.clear()
                if streamer is not None:
                    streamer.end_backward()
                loss_value += float(loss.detach()) * w
                del loss, part
        finally:
            self.applied.end_step()
        return loss_value

    def _refuse_coupled(self, inputs: Any, targets: Any, m: int) -> None:
        """Once, before the first step with micro-batches: a model whose items are
        coupled by what it computes (a router's load-balancing loss over the batch's
        routing; ``memory.real_profile.batch_coupling``, on the batch's first two
        items) is refused micro-batches unless the plan was made knowing it, as a
        batch-dependent layer is: the planner never gives it any, a plan built by
        hand might."""
        if self._coupling_checked or self.plan.batch_dependent_microbatches:
            return
        self._coupling_checked = True
        if has_meta_parameters(self.model):
            return  # nothing to run yet: the planner's own check stands
        from memory.real_profile import batch_coupling

        why = batch_coupling(
            self.model,
            inputs,
            targets,
            self.loss_fn,
            self.layout,
            batch_size_of(inputs, self.layout),
        )
        if why is not None:
            raise MemoryPlanError(
                f"{why}, but the step would cut the batch into {m} micro-batches; "
                "plan with num_microbatches=1 (what plan_training chooses for such "
                "a model), or plan with allow_microbatching=True to accept the "
                "difference"
            )

    @staticmethod
    def _refuse_batch_dependent(model: nn.Module, plan: MemoryPlan, m: int) -> None:
        """Micro-batches change what a batch-dependent layer in training mode
        computes (``memory.batch.batch_dependent_layer``): refused unless the plan
        was made knowing it (``batch_dependent_microbatches``)."""
        if m <= 1 or plan.batch_dependent_microbatches:
            return
        layer = batch_dependent_layer(model, training_only=True)
        if layer is not None:
            raise MemoryPlanError(
                f"{layer}, but the step would cut the batch into {m} micro-batches, "
                "each with statistics of its own: a different model than plain "
                "training's; plan with num_microbatches=1 (what plan_training chooses "
                "for such a model), or plan with allow_microbatching=True to accept "
                "the difference"
            )

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated so far, by parameter name (copies for streamed
        parameters, whose gradients wait in the store only while an update is deferred:
        under clipping or accumulation). A tied parameter appears once, under the
        first name ``named_parameters`` gives it, as in plain training: a streamed
        unit's tied parameter, which a borrowing unit holds as a leaf of its own, is
        reported under the first of its names, with the owner's gradient."""
        streamer = self.applied.streamer
        out = {}
        seen: set[int] = set()
        for n, p in self.model.named_parameters():
            owner = streamer.owner(p) if streamer is not None else p
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            if streamer is not None and id(owner) in streamer.stream_ids:
                g = streamer.stored_grad(owner)
            else:
                g = owner.grad
            if g is not None:
                out[n] = g
        return out

    def save(
        self, path: str | os.PathLike, keys: Collection[str] | None = None
    ) -> None:
        """Write the model's state to a safetensors file without leaving the plan's
        memory: one tensor at a time (``memory.tensorfile.write_tensors``), streamed
        parameters read from their files. A tied parameter is written once, under its
        first name; the metadata's ``aliases`` maps the other names to it (JSON).
        ``keys``: only these state-dict names (default: all)."""
        import json

        from memory.tensorfile import write_tensors

        streamer = self.applied.streamer
        entries = []
        aliases: dict[str, str] = {}
        seen: dict[int, str] = {}
        wanted = None if keys is None else set(keys)
        for name, t in self.model.state_dict(keep_vars=True).items():
            if wanted is not None and name not in wanted:
                continue
            owner = streamer.owner(t) if streamer is not None else t
            if id(owner) in seen:
                aliases[name] = seen[id(owner)]
                continue
            seen[id(owner)] = name
            if streamer is not None and id(owner) in streamer.stream_ids:

                def fetch(p: torch.Tensor = owner) -> torch.Tensor:
                    assert streamer is not None
                    return streamer.read(p)

            else:

                def fetch(p: torch.Tensor = owner) -> torch.Tensor:
                    return p.detach()

            entries.append((name, owner.dtype, list(owner.shape), fetch))
        meta = {"aliases": json.dumps(aliases, sort_keys=True)} if aliases else None
        write_tensors(path, entries, meta)

    def _hparams(self) -> dict:
        s = self.settings
        lr = s.lr
        if s.lr_schedule is not None:
            lr = s.lr * float(s.lr_schedule(self.num_updates))
        return {
            "lr": lr,
            "betas": s.betas,
            "eps": s.eps,
            "weight_decay": s.weight_decay,
        }

    def _defer(self) -> bool:
        """True while a streamed unit's update must wait for more gradients."""
        s = self.settings
        last_call = (self._calls + 1) % s.accumulate_steps == 0
        return not (self._last_part and last_call and s.clip_norm is None)

    def _update(self) -> None:
        s = self.settings
        streamer = self.applied.streamer
        coef = None
        self.proximal.add_to_grads()  # part of the loss: before clipping
        if s.clip_norm is not None:
            coef = self._clip(s.clip_norm)
        if self.optimizer is not None:
            for g in self.optimizer.param_groups:
                g["lr"] = self._hparams()["lr"]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if streamer is not None and self._deferred():
            streamer.update(coef)
        self.num_updates += 1

    def _deferred(self) -> bool:
        """Streamed units wait for ``update`` only under clipping (see ``_defer``)."""
        return self.settings.clip_norm is not None

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Global gradient-norm clipping as ``torch.nn.utils.clip_grad_norm_`` does
        it (per-tensor norms in parameter order, then their norm), over resident and
        stored gradients alike; returns the coefficient applied."""
        streamer = self.applied.streamer
        stored = streamer.stored_norms() if streamer is not None else {}
        norms, grads = [], []
        for p in self.model.parameters():
            if id(p) in stored:
                norms.append(stored[id(p)])
            elif p.grad is not None:
                norms.append(torch.linalg.vector_norm(p.grad, 2.0))
                grads.append(p.grad)
        if not norms:
            return torch.tensor(1.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self.last_grad_norm = float(total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return coef

    def close(self, *, restore: bool = True) -> None:
        """Remove the plan's wrappers and files. With ``restore`` the model gets its
        trained state back (streamed parameters are read into memory: the whole
        model); without, streamed parameters stay placeholders (after ``save``)."""
        for h in self._guard_hooks:
            h.remove()
        self._guard_hooks = []
        self.applied.remove(restore=restore)
        if self.head is not None:
            self.head.remove()
        for cfg in self._use_cache:
            cfg.use_cache = True
        self._use_cache = []

    def __enter__(self) -> PlannedTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _materialize(
    model: nn.Module, plan: MemoryPlan, units: Sequence[Block], source: StateSource
) -> Callable[[nn.Parameter], torch.Tensor]:
    """Read a meta-built model's resident parameters from ``source``; returns where
    the streamer reads the streamed ones (see ``memory.materialize``)."""
    streamed = [b.name for b in plan.blocks if b.state == "stream"]
    ids = streamed_parameter_ids(units, streamed)
    return materialize(model, source, streamed_ids=ids)


def units_by_name(model: nn.Module, names: Sequence[str]) -> list[Block]:
    """The units named (a plan's blocks, in its execution order), without running
    the model: for a model whose weights are not there yet."""
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = [n for n in names if n not in modules]
    if missing:
        raise MemoryPlanError(
            f"the plan names units {missing[:3]} that {type(model).__name__} does "
            "not have; make the plan for this model"
        )
    return [Block(n, modules[n]) for n in names]


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"``.

    Raises:
        ValueError: a malformed name, a module that does not import, or no such
            function (one line naming the value and the fix).
    """
    import importlib

    if spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(
            f"model factory {spec!r} is not 'package.module:function'; name a "
            "function importable from the current directory or PYTHONPATH"
        )
    mod_name, fn_name = spec.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"model factory {spec!r}: cannot import {mod_name} ({e})"
        ) from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(
            f"model factory {spec!r}: {mod_name} has no function {fn_name}"
        )
    return fn


def warm_up(factory: str, factory_kwargs: dict[str, Any]) -> None:
    """Build the factory's model on the ``meta`` device and drop it: the library code
    its construction imports lazily (transformers loads attention and masking modules
    on first use) is then loaded before a measuring child's baseline, as torch's own
    lazy imports are (``memory.overhead.preload_runtime``). A factory that cannot run
    on ``meta`` is skipped; the figures then include those imports."""
    import logging

    try:
        with torch.device("meta"):
            load_factory(factory)(**factory_kwargs)
    except Exception as e:  # only a warm-up
        logging.getLogger(__name__).info("warm-up of %s skipped: %s", factory, e)


def whole_model_trainer(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable | None,
    plan: MemoryPlan | None,
    *,
    lr: float,
    offload_dir: str | None = None,
    init_state: StateSource | None = None,
    guard: bool = True,
    baseline_bytes: int = 0,
) -> PlannedTrainer:
    """A ``PlannedTrainer`` of the whole model under ``plan`` (None: plain units).

    With ``init_state`` the model was built under ``params_on_meta``: a plain run reads
    every weight now (``materialize``); a plan's units are found by the names it gives
    (``units_by_name``: no forward before the weights exist) and read within the plan.
    With ``guard`` a plan made for a budget runs under ``MemoryGuard`` at that budget,
    above ``baseline_bytes``. The caller closes ``init_state`` once this returns."""
    if plan is None:
        if init_state is not None:
            materialize(model, init_state)  # plain: every weight resident
        units = find_units(model, inputs)
        plan = MemoryPlan.plain([u.name for u in units])
    elif init_state is not None:
        units = units_by_name(model, [b.name for b in plan.blocks])
    else:
        units = find_units(model, inputs)
    return PlannedTrainer(
        model,
        plan,
        inputs,  # a declared loss's head is found on them
        units=units,
        loss_fn=loss_fn,
        settings=TrainSettings(lr=lr),
        offload_dir=offload_dir,
        memory_budget_bytes=plan.budget_bytes if guard else None,
        baseline_bytes=baseline_bytes,
        init_state=init_state,
    )


def train_measured(
    factory: str,
    factory_kwargs: dict[str, Any],
    plan: dict | None,
    *,
    steps: int,
    lr: float = 1e-3,
    seed: int = 0,
    offload_dir: str | None = None,
    save: str | None = None,
    guard: bool = True,
    init_state: str | None = None,
) -> dict[str, Any]:
    """Build a model with ``factory(**factory_kwargs)``, which returns
    ``(model, (inputs, targets))`` or ``(model, (inputs, targets), loss_fn)`` (a
    ``module:function`` workload; ``loss_fn`` None: the model's own loss), and train
    ``steps`` steps on that batch under ``plan`` (None: plain training), returning
    the losses, each step's seconds and the median after the first; then, with
    ``save``, write the trained state there (``PlannedTrainer.save``: within the
    plan's memory). With ``guard`` a plan made for a budget runs under
    ``MemoryGuard`` at that budget.

    The target of ``memory.measure.measure_in_child``: everything it does, building
    the model included, counts in the measured peak. Returns the losses and the
    seconds of each step.

    With ``init_state`` (a safetensors file of the model's state, e.g.
    ``memory.materialize.save_state``'s) the model is built without its weights
    (``params_on_meta``) and read from the file, one tensor at a time: streamed units
    go straight into the store, so the whole model never exists in memory; plain
    training (``plan`` None) reads every weight, as ``load_state_dict`` would.
    """
    import statistics
    import time

    from memory.measure import rss_bytes
    from memory.tensorfile import TensorFile

    baseline = rss_bytes()  # the measuring child's baseline, just taken
    torch.manual_seed(seed)
    hollow = False
    if init_state:
        built, hollow = build_without_weights(
            lambda: load_factory(factory)(**factory_kwargs)
        )
    else:
        built = load_factory(factory)(**factory_kwargs)
    model, (inputs, targets) = built[0], built[1]
    loss_fn = built[2] if len(built) > 2 else None
    if init_state and not hollow:  # a factory that reads its weights: built whole
        load_state_into(model, init_state)
    source = TensorFile(init_state) if hollow and init_state else None
    try:
        tr = whole_model_trainer(
            model,
            inputs,
            loss_fn,
            None if plan is None else MemoryPlan.from_dict(plan),
            lr=lr,
            offload_dir=offload_dir,
            init_state=source,
            guard=guard,
            baseline_bytes=baseline,
        )
    finally:
        if source is not None:
            source.close()  # every weight is in the model or the store now
    times: list[float] = []

    def timed() -> Iterator[tuple[Any, Any]]:  # each step seeded and timed
        for s in range(steps):
            torch.manual_seed(seed + 1 + s)
            t0 = time.perf_counter()
            yield inputs, targets
            times.append(time.perf_counter() - t0)

    try:
        losses = tr.train(timed())
        if save:
            tr.save(save)
    finally:
        tr.close(restore=False)  # the state is saved: nothing to bring back
    later = times[1:] or times
    return {
        "losses": losses,
        "step_times_s": times,
        "step_s": statistics.median(later),
    }


def runtime_probe(
    factory: str, factory_kwargs: dict[str, Any], offload_dir: str | None = None
) -> dict[str, Any]:
    """The target of ``memory.overhead.workload_runtime_bytes``'s measuring child: the
    library code a training step of this workload pages in (``RssFile`` growth: the
    kernels' code, which a plan's tensors do not show).

    Builds the workload's model and trains it on the first two examples of its batch,
    once plainly and once under a plan that uses every mechanism (each unit recomputed
    from inputs kept on disk, its state streamed, two micro-batches, the loss in two
    chunks where the model has a head to chunk): the kernels a plan's step runs, at
    shapes near a micro-batch's. Returns ``{"file_bytes": ...}``, the growth once the
    model and its files are gone (library code stays mapped; data files do not)."""
    import gc
    import tempfile

    from memory.measure import _status_bytes
    from memory.spec import BlockPlan

    f0 = _status_bytes("RssFile")

    def build() -> tuple[nn.Module, Any, Any, Any]:
        torch.manual_seed(0)
        built = load_factory(factory)(**factory_kwargs)
        model, (inputs, targets) = built[0], built[1]
        x, y = first_items(inputs, targets, 2, batch_layout(model))
        return model, x, y, built[2] if len(built) > 2 else None

    model, x, y, loss_fn = build()
    names = [u.name for u in find_units(model, x)]
    k = batch_size_of(x, batch_layout(model))
    every = tuple(BlockPlan(n, "recompute", "stream", True) for n in names)
    mechanisms = [
        MemoryPlan(every, num_microbatches=k, loss_chunks=c)
        for c in (
            (2, 1)
            if loss_fn is None or isinstance(loss_fn, LogitsCrossEntropy)
            else (1,)
        )
    ]
    with tempfile.TemporaryDirectory(dir=offload_dir) as tmp:
        for plan in [MemoryPlan.plain(names)] + mechanisms:
            model, x, y, loss_fn = build()
            try:
                tr = PlannedTrainer(model, plan, x, loss_fn=loss_fn, offload_dir=tmp)
            except MemoryPlanError:
                continue  # no linear head to chunk the loss over: the next plan
            try:
                tr.step(x, y)
            except MemoryPlanError:
                if plan.loss_chunks == 1:
                    raise
                continue  # its loss is not the head's (memory.head): the next plan
            finally:
                tr.close(restore=False)
            del tr, model
            gc.collect()
            if not plan.is_plain:
                break  # one plan with every mechanism is enough
    return {"file_bytes": _status_bytes("RssFile") - f0}
