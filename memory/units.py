"""The units of any model: the modules a memory plan decides about, in execution order.

A plan is applied per *unit* (``memory.apply``), so the model's own ``forward`` runs
unchanged. ``find_units`` picks the units from the module tree:

- the *layers*: the modules of a transformers model's ``_no_split_modules`` classes,
  and otherwise the children of every ``nn.ModuleList`` / ``nn.Sequential`` that holds
  at least two modules of one class (``model.layers``, ``encoder.block``, ...);
- *the rest*: every module outside the layers whose subtree holds no layer and owns
  parameters (embeddings, a final norm, a head), taken whole. A module that holds layers
  is not a unit itself: its children are looked at instead.

A module reached under two names (T5's ``shared`` is also ``encoder.embed_tokens``) is
one unit, named by its first path. A candidate the forward never calls but that holds
parameters is a container the forward unpacks (``for res, attn, down in self.downs``
over a ``ModuleList`` of ``ModuleList`` s): it is opened and its children become the
candidates, to any depth. Parameters that still belong to no unit (registered directly
on a module that holds layers, or used only by the model's own code) stay resident,
and the profile prices them, with their gradients and optimizer state, as held
through the whole step (``outside_parameters``).

The order is the order in which the model's forward first calls each unit, found by
running it under forward pre-hooks (``trace_units``; on a fake copy, so no activation is
allocated). Users override the choice with ``names=[...]`` (module paths).

Example:
    >>> units = find_units(model)  # doctest: +SKIP
    >>> [u.name for u in units][:3]  # doctest: +SKIP
    ['transformer.wte', 'transformer.wpe', 'transformer.h.0']
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from memory.blocks import Block
from memory.errors import MemoryPlanError


def _layer_classes(model: nn.Module) -> set[str]:
    names = getattr(model, "_no_split_modules", None) or ()
    return {str(n) for n in names}


def _is_layer_list(mod: nn.Module) -> bool:
    if not isinstance(mod, nn.ModuleList | nn.Sequential):
        return False
    kids = list(mod.children())
    return len(kids) >= 2 and len({type(k) for k in kids}) == 1


def _outermost(model: nn.Module, found: set[int]) -> set[int]:
    """``found`` less the modules inside another found module."""
    inner = {
        id(sub)
        for mod in model.modules()
        if id(mod) in found
        for sub in mod.modules()
        if sub is not mod and id(sub) in found
    }
    return found - inner


def _layers(model: nn.Module) -> set[int]:
    """ids of the layer modules (see the module docstring)."""
    classes = _layer_classes(model)
    found: set[int] = set()
    if classes:
        for mod in model.modules():
            if type(mod).__name__ in classes and mod is not model:
                found.add(id(mod))
        found = _outermost(model, found)  # a layer class nested in another (rare)
    if not found:
        for mod in model.modules():
            if _is_layer_list(mod) and mod is not model:
                for kid in mod.children():
                    found.add(id(kid))
        found = _outermost(model, found)
    return found


def _holds(mod: nn.Module, ids: set[int]) -> bool:
    return any(id(sub) in ids for sub in mod.modules())


def _candidates(model: nn.Module) -> list[Block]:
    layers = _layers(model)
    out: list[Block] = []
    seen: set[int] = set()

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            path = f"{prefix}{name}"
            if id(child) in seen:
                continue
            if id(child) in layers:
                seen.add(id(child))
                out.append(Block(path, child))
            elif _holds(child, layers):
                walk(path + ".", child)
            elif any(True for _ in child.parameters()):
                seen.add(id(child))
                out.append(Block(path, child))

    if layers:
        walk("", model)
    else:  # no repeated layers: the top-level children that own parameters
        for name, child in model.named_children():
            if any(True for _ in child.parameters()) and id(child) not in seen:
                seen.add(id(child))
                out.append(Block(name, child))
    return out


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple or list,
    ``model(inputs)`` otherwise: the workload contract's three forms."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def trace_units(
    model: nn.Module, candidates: Sequence[Block], inputs: Any
) -> tuple[list[Block], dict[str, int]]:
    """The candidates the forward calls, in first-call order, and their call counts.

    The forward runs on a fake copy of ``model`` (``FakeTensorMode``; no activation
    memory) when the model and inputs allow it, else on the model itself under
    ``no_grad``.
    """
    units, calls, _ = _trace(model, candidates, inputs)
    return units, calls


def _trace(
    model: nn.Module, candidates: Sequence[Block], inputs: Any
) -> tuple[list[Block], dict[str, int], list[str]]:
    """``trace_units``, and the modules (paths) whose own code cannot run on fake
    tensors where that is not inside a candidate: found, when the fake forward
    fails, on the real forward that replaces it, as the innermost module running
    each op whose output shape or value depends on the data (the ops fake tensors
    refuse: ``nonzero``, ``.item()``)."""
    order: list[str] = []
    calls: dict[str, int] = {}
    failing: list[str] = []

    def run(mod: nn.Module, cands: Sequence[Block], x: Any) -> None:
        hooks = []
        for b in cands:

            def pre(_m: nn.Module, _a: object, _name: str = b.name) -> None:
                if _name not in calls:
                    order.append(_name)
                    calls[_name] = 0
                calls[_name] += 1

            hooks.append(b.module.register_forward_pre_hook(pre))
        try:
            with torch.no_grad():
                call_model(mod, x)
        finally:
            for h in hooks:
                h.remove()

    try:
        from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        if any(p.is_meta for p in model.parameters()):
            fake = _fake_of_meta(model, mode)
        else:
            with FakeCopyMode(mode):
                fake = copy.deepcopy(model)
        by_name = dict(fake.named_modules(remove_duplicate=False))
        fake_cands = [Block(b.name, by_name[b.name]) for b in candidates]
        with mode, quiet_fake_errors():
            fx = _map_tensors(inputs, mode.from_tensor)
            run(fake, fake_cands, fx)
    except Exception:  # a model that will not run on fake tensors: run it for real
        order.clear()
        calls.clear()
        was = model.training
        model.eval()
        try:
            with _DataDependent(model) as found:
                run(model, candidates, inputs)
            failing = found.names
        finally:
            model.train(was)
    by = {b.name: b for b in candidates}
    glue = [
        f
        for f in failing
        if not any(f == n or f.startswith(n + ".") for n in by)  # not in a unit
    ]
    return [by[n] for n in order], calls, glue


class _DataDependent(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, during a real forward, the innermost module running each op that
    fake tensors cannot run (an output whose shape or value depends on the data)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.paths = {id(m): n for n, m in model.named_modules()}
        self.running: list[nn.Module] = []
        self.names: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> _DataDependent:
        def leave(m: nn.Module, _a: object, _o: object) -> None:
            if self.running and self.running[-1] is m:
                self.running.pop()

        self._hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(
                lambda m, _a: self.running.append(m)
            ),
            torch.nn.modules.module.register_module_forward_hook(leave),
        ]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for h in self._hooks:
            h.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        tags = getattr(func, "tags", ())
        if (
            torch.Tag.dynamic_output_shape in tags
            or torch.Tag.data_dependent_output in tags
        ) and self.running:
            name = self.paths.get(id(self.running[-1]))
            if name is not None and name not in self.names:
                self.names.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def quiet_fake_errors() -> Iterator[None]:
    """torch logs a fake kernel's failure with its traceback before raising it; a
    caller that catches it and runs the model another way (``trace_units``,
    ``memory.real_profile``) makes the log noise."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(was)


def _fake_of_meta(model: nn.Module, mode: Any) -> nn.Module:
    """A copy of a model built without its weights (``memory.materialize``) whose
    parameters are fake CPU tensors: it runs on CPU inputs under ``mode`` with no
    memory (the ``meta`` parameters themselves would meet CPU inputs and fail)."""
    fake = copy.deepcopy(model)  # meta parameters copy for free; buffers are small
    convert = mode.fake_tensor_converter
    swapped: dict[int, nn.Parameter] = {}
    for mod in fake.modules():
        for key, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in swapped:
                value = convert.from_meta_and_device(
                    mode, p.detach(), torch.device("cpu")
                )
                swapped[id(p)] = nn.Parameter(value, requires_grad=p.requires_grad)
            mod._parameters[key] = swapped[id(p)]
    return fake


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)({k: _map_tensors(v, fn) for k, v in x.items()})
    if isinstance(x, tuple | list):
        return type(x)(_map_tensors(v, fn) for v in x)
    return x


def find_units(
    model: nn.Module, inputs: Any, *, names: Iterable[str] | None = None
) -> list[Block]:
    """The model's units in execution order (see the module docstring).

    Args:
        model: any ``nn.Module``.
        inputs: one batch of inputs, as the model is called (``call_model``).
        names: module paths to use as the units instead of the automatic choice.

    Raises:
        MemoryPlanError: a named module that does not exist, units that nest, or a
            model with no unit its forward calls.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    if names is not None:
        cands = []
        for n in names:
            if n not in modules:
                raise MemoryPlanError(
                    f"unit {n!r} is not a module of {type(model).__name__}; name "
                    "module paths as model.named_modules() prints them"
                )
            cands.append(Block(n, modules[n]))
        ids = {id(b.module) for b in cands}
        for b in cands:
            inner = [
                s for s in b.module.modules() if s is not b.module and id(s) in ids
            ]
            if inner:
                raise MemoryPlanError(
                    f"unit {b.name!r} contains another unit; units must not nest"
                )
    else:
        cands = _candidates(model)
    if not cands:
        raise MemoryPlanError(
            f"{type(model).__name__} has no module with parameters to plan over"
        )
    units, _, failing = _trace(model, cands, inputs)
    if names is None:
        for _ in range(_MAX_NESTING):
            opened = _open_uncalled(cands, units)
            if opened is None:
                opened = _close_failing(model, cands, failing)
            if opened is None:
                break
            cands = opened
            units, _, failing = _trace(model, cands, inputs)
    if not units:
        raise MemoryPlanError(
            f"{type(model).__name__}'s forward calls none of its units "
            f"{[b.name for b in cands][:5]}"
        )
    return units


_MAX_NESTING = 8
"""Levels of containers ``find_units`` opens (a list of lists of blocks is two)."""


def _has_parameters(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters())


def _open_uncalled(
    cands: Sequence[Block], called: Sequence[Block]
) -> list[Block] | None:
    """The candidates with each one the forward never called but that holds
    parameters replaced by its children that hold parameters: a container the
    forward unpacks (``for res, attn, down in self.downs``: a ``ModuleList`` of
    ``ModuleList`` s) is never called itself, its blocks are. None when there is
    nothing to open."""
    done = {b.name for b in called}
    out: list[Block] = []
    seen = {id(b.module) for b in cands}
    opened = False
    for b in cands:
        kids = list(b.module.named_children())
        if b.name in done or not kids or not _has_parameters(b.module):
            out.append(b)
            continue
        opened = True
        for n, kid in kids:
            if id(kid) in seen:
                continue  # reached under another name: that one stands
            if _has_parameters(kid):
                seen.add(id(kid))
                out.append(Block(f"{b.name}.{n}", kid))
    return out if opened else None


def _close_failing(
    model: nn.Module, cands: Sequence[Block], failing: Sequence[str]
) -> list[Block] | None:
    """The candidates with those inside each module of ``failing`` replaced by that
    module, one unit in the place of its first: a module whose own code, between
    the units it holds, cannot run on fake tensors (``AdaptiveLogSoftmaxWithLoss``
    selects each cluster's rows with ``nonzero``; an encoder reads its positions
    with ``.item()``) becomes a unit, which the profile measures on real tensors
    (``memory.real_profile``); a module that holds no unit (no parameters:
    sinusoidal positions) becomes a unit of its own. None when there is nothing to
    close (no such module, or only the model's own code)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    out = list(cands)
    changed = False
    # outer modules first: a failing module inside another failing one goes with it
    for name in sorted((f for f in failing if f), key=lambda f: f.count(".")):
        mod = modules.get(name)
        if mod is None or any(
            name == b.name or name.startswith(b.name + ".") for b in out
        ):
            continue
        inside = [b for b in out if b.name.startswith(name + ".")]
        if not inside:
            out.append(Block(name, mod))
        else:
            first = out.index(inside[0])
            out = [b for b in out if b not in inside]
            out.insert(first, Block(name, mod))
        changed = True
    return out if changed else None


def outside_parameters(model: nn.Module, units: Sequence[Block]) -> list[str]:
    """Names of parameters that no unit holds (they stay resident)."""
    inside = {id(p) for b in units for p in b.module.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in inside]


def no_kv_cache(model: nn.Module) -> list[Any]:
    """Switch off a transformers model's KV cache for training (a recomputed layer
    would append its keys twice). Every submodule's config counts: T5's decoder holds
    a copy of its own. Returns the configs to switch back."""
    changed = []
    seen: set[int] = set()
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        if getattr(cfg, "use_cache", False) is True:
            cfg.use_cache = False
            changed.append(cfg)
    return changed
