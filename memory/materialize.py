"""Build a model without its weights, then read them from a file unit by unit.

A factory that builds a model in memory holds every parameter at once before a plan
can move the streamed units to disk: for GPT-2 small that is 474.7 MiB of parameters
(685 MiB measured while building), more than the smallest plan's step. Built under
``params_on_meta()`` instead, the same factory gives the same module tree with every
parameter on the ``meta`` device (no memory), buffers real (a rotary embedding's
``inv_freq`` or a causal mask are computed in ``__init__`` and kept by no file), and
tied parameters still tied. ``materialize`` then gives each parameter its value from a
state file (``memory.tensorfile.TensorFile``: plain reads, no mapping), one tensor at
a time: resident parameters in place, streamed ones as placeholders whose values the
store reads unit by unit (``memory.streaming.ParamStreamer``'s ``values``), so the
whole model never exists in memory at once. The chain executor of built-in workloads
does the same through ``partition.local.LocalExecutor(init_state=...)``.

The weights come from a file (a pretrained checkpoint, the global model a federation
sends, or ``save_state`` of a model built once in memory): a random initialisation
done per unit would not equal the factory's own, and plain training must start from
the same weights for the plan's results to equal it.

Example:
    >>> with params_on_meta():  # doctest: +SKIP
    ...     model = GPT2LMHeadModel(config)
    >>> with TensorFile("gpt2.safetensors") as f:  # doctest: +SKIP
    ...     materialize(model, f)  # everything resident
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
from torch import nn

from memory.blocks import Block
from memory.errors import MemoryPlanError

T = TypeVar("T")


class StateSource(Protocol):
    """Where initial values come from: a safetensors file's names and tensors."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside put every parameter on the ``meta`` device.

    ``nn.Module.register_parameter`` (which ``module.weight = Parameter(...)`` calls)
    moves each new parameter to ``meta`` as it is registered; a parameter already on
    ``meta`` is kept as it is, so assigning one module's parameter to another (tied
    weights) keeps them one object. Initialisation that runs after registration
    (``reset_parameters``, transformers' ``_init_weights``) runs on ``meta`` and
    costs nothing; a tensor made before registration (``Parameter(torch.empty(n))``)
    is allocated but never touched, so it holds no resident memory. Buffers stay on
    the CPU.
    """
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = type(p)(
                p.detach().to("meta"), requires_grad=p.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_without_weights(build: Callable[[], T]) -> tuple[T, bool]:
    """``(build(), True)`` with ``build`` run under ``params_on_meta``; a factory
    that reads a parameter's values while it builds (a parametrization that checks
    its value at registration, ``nn.utils.parametrizations.orthogonal``; an
    initialisation with a data-dependent branch) cannot run there, and is built for
    real instead: ``(build(), False)``, its weights then in memory (and in whatever
    is measured), from the same random state. A factory that fails for real raises
    its own error."""
    state = torch.random.get_rng_state()
    try:
        with params_on_meta():
            return build(), True
    except Exception:  # noqa: BLE001 - any failure on meta: the real build decides
        torch.random.set_rng_state(state)
    return build(), False


def load_state_into(model: nn.Module, path: str) -> None:
    """Copy the tensors of a safetensors file into ``model``'s state, one at a time
    (plain reads: a mapped file would stay resident until closed).

    Raises:
        MemoryPlanError: the file names a tensor the model does not have.
    """
    from memory.tensorfile import TensorFile

    own = model.state_dict(keep_vars=True)
    with TensorFile(path) as f, torch.no_grad():
        for key in f.keys():
            if key not in own:
                raise MemoryPlanError(
                    f"the state file {path} has {key!r}, which "
                    f"{type(model).__name__} does not; save it from this model"
                )
            own[key].copy_(f.get_tensor(key))


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the ``meta`` device."""
    return any(p.is_meta for p in model.parameters())


def _hollow(p: torch.Tensor) -> nn.Parameter:
    """A CPU placeholder of ``p``'s shape and dtype holding one element."""
    value = torch.zeros((), dtype=p.dtype).expand(p.shape)
    return nn.Parameter(value, requires_grad=p.requires_grad)


def _read(
    source: StateSource, keys: set[str], names: Sequence[str], like: torch.Tensor
) -> torch.Tensor:
    """The value of the tensor known by ``names`` (tied: several), from ``source``."""
    name = next((n for n in names if n in keys), None)
    if name is None:
        raise MemoryPlanError(
            f"the state file has no tensor {names[0]!r}"
            + (f" (nor {list(names[1:])})" if len(names) > 1 else "")
            + "; save it from this model (its state_dict names)"
        )
    value = source.get_tensor(name)
    if value.shape != like.shape or value.dtype != like.dtype:
        raise MemoryPlanError(
            f"the state file has {name} as {value.dtype}{list(value.shape)}, but the "
            f"model has {like.dtype}{list(like.shape)}; save it from this model"
        )
    return value


def streamed_parameter_ids(units: Sequence[Block], streamed: Sequence[str]) -> set[int]:
    """Parameters owned by a streamed unit (``memory.streaming.parameter_owners``)."""
    from memory.streaming import parameter_owners

    names = set(streamed)
    wanted = {k for k, u in enumerate(units) if u.name in names}
    return {pid for pid, k in parameter_owners(units).items() if k in wanted}


@torch.no_grad()
def materialize(
    model: nn.Module,
    source: StateSource,
    *,
    streamed_ids: set[int] | frozenset[int] = frozenset(),
) -> Callable[[nn.Parameter], torch.Tensor]:
    """Give ``model``'s ``meta`` parameters their values from ``source``.

    Parameters whose ``id`` is in ``streamed_ids`` become CPU placeholders (their
    values stay in the file until the store reads them, see the module docstring);
    every other parameter is read now, one tensor at a time. Buffers named in the file
    are overwritten by its values (a trained BatchNorm's statistics), as
    ``load_state_dict`` would. Tied parameters stay tied.

    Args:
        model: a model built under ``params_on_meta()``.
        source: the state file (``memory.tensorfile.TensorFile``).
        streamed_ids: ``id``s of the (meta) parameters that are streamed.

    Returns:
        ``values(p)``: placeholder ``p``'s value, read from ``source`` when asked
        (``memory.streaming.ParamStreamer``'s ``values``).

    Raises:
        MemoryPlanError: the file lacks a tensor, or holds it with another shape or
            dtype.
    """
    keys = set(source.keys())
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    replaced: dict[int, nn.Parameter] = {}
    placeholders: dict[int, list[str]] = {}
    for module in model.modules():
        for key, cur in list(module._parameters.items()):
            if cur is None or not cur.is_meta:
                continue
            p = cur
            if id(p) not in replaced:
                if id(p) in streamed_ids:
                    new = _hollow(p)
                    placeholders[id(new)] = names[id(p)]
                else:
                    value = _read(source, keys, names[id(p)], p)
                    new = nn.Parameter(value, requires_grad=p.requires_grad)
                replaced[id(p)] = new
            module._parameters[key] = replaced[id(p)]
    for name, b in model.named_buffers():
        if name in keys:
            b.copy_(_read(source, keys, [name], b))

    def values(p: nn.Parameter) -> torch.Tensor:
        return _read(source, keys, placeholders[id(p)], p)

    return values


def save_state(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``model``'s parameters and persistent buffers to a safetensors file that
    ``materialize`` reads: one tensor at a time, each tied parameter once under its
    first name (``memory.tensorfile.write_tensors``)."""
    from memory.tensorfile import write_tensors

    entries = []
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))

        def fetch(v: torch.Tensor = t) -> torch.Tensor:
            return v.detach()

        entries.append((name, t.dtype, list(t.shape), fetch))
    write_tensors(path, entries, None)
