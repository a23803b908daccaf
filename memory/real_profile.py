"""Units profiled on real tensors, where fake tensors cannot run or cannot price them.

``memory.unit_profile`` profiles a training step on a fake copy of the model. Two
kinds of unit defeat that:

- **fake tensors cannot run it**: a mixture-of-experts layer routes tokens by their
  values (``aten.nonzero`` in an eager experts loop has a data-dependent shape), and
  torch's fake kernel for ``_grouped_mm`` (transformers' default grouped experts)
  accepts bfloat16 only;
- **fake tensors run it but price it wrong**: a recurrent layer on CPU runs oneDNN's
  ``mkldnn_rnn_layer``, whose real kernel keeps a workspace for backward that its
  fake kernel does not allocate (a 2-layer LSTM, 4 x 512 tokens of width 256: 72.1
  MiB saved for backward on real tensors, 10.0 on fake ones), and which torch's FLOP
  counter does not know (0 FLOPs).

Such a module is profiled on real tensors, alone: the real model runs without
autograd on a slice of the batch (1 and 2 items) up to the module, whose inputs are
kept; the module then runs forward (without and with autograd) and backward on them under the
same byte and FLOP accounting as the fake trace, with ``autograd.grad`` (the model's
``.grad`` and buffers, and the random state, are left as they were). Its costs at a
micro-batch of ``n`` items are the line through the 1- and 2-item measurements (a
part that does not grow with the batch, the weights' gradients, and one that does);
with an odd batch, each micro-batch size is measured. In the fake trace the unit is a
stand-in that returns fake outputs of the measured shapes (extrapolated the same
way), so the units around it are traced as before.

Experts are priced for the **worst routing**: while a module is measured, and while
its inputs are captured (a router before it decides them), every ``topk``,
``argmax`` and ``max(dim)`` returns the first ``k`` experts for all tokens but the
first few, which take one each of the others (``_worst_indices``): every expert runs
(its fixed costs) and the first ``k`` take nearly every token (the largest transient
of one expert); a router with a capacity then drops what exceeds it, as it would.
Routing decides which tokens an expert sees, not how many expert-token pairs there
are, so the saved bytes hardly change.

A fake trace that raises is retried with the innermost module that was running as
the stand-in (the experts, not their decoder layer: the router still runs on fake
tensors, and the logits transformers records for its router loss are there); a
failure in backward makes the whole unit real. ``batch_coupling`` tells whether the
model's items depend on each other (micro-batches would train another function).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry

from memory.batch import Layout, split_batch
from memory.blocks import Block
from memory.chain_costs import LiveBytes, storage_key, storage_nbytes
from memory.errors import MemoryPlanError
from memory.units import call_model, no_kv_cache

aten = torch.ops.aten


def _ops(*names: str) -> frozenset[Any]:
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


MISPRICED_OPS = _ops(
    "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_cudnn_rnn", "miopen_rnn"
)
"""Ops whose fake kernels do not allocate what their real kernels keep (a recurrent
kernel's workspace): a unit that runs one is profiled on real tensors."""


def _rnn_flops(input: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor) -> int:
    tokens = input.numel() // max(input.shape[-1], 1)
    return 2 * tokens * (w_ih.numel() + w_hh.numel())


def _mkldnn_rnn_flops(args: tuple, kwargs: dict) -> int:
    """``mkldnn_rnn_layer(input, w_ih, w_hh, b_ih, b_hh, ...)``: the input and
    recurrent matmuls of every gate at every step."""
    return _rnn_flops(args[0], args[1], args[2])


def _mkldnn_rnn_backward_flops(args: tuple, kwargs: dict) -> int:
    """Its backward: the gradients of the inputs and of the weights, twice the
    forward."""
    return 2 * _rnn_flops(args[0], args[1], args[2])


EXTRA_FLOPS: dict[Any, Callable[[tuple, dict], int]] = {}
if hasattr(aten, "mkldnn_rnn_layer"):
    EXTRA_FLOPS[aten.mkldnn_rnn_layer.default] = _mkldnn_rnn_flops
if hasattr(aten, "mkldnn_rnn_layer_backward"):
    EXTRA_FLOPS[aten.mkldnn_rnn_layer_backward.default] = _mkldnn_rnn_backward_flops


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one dispatched op: torch's FLOP formulas, and the recurrent kernels
    they lack (``EXTRA_FLOPS``); 0 for an op neither knows."""
    extra = EXTRA_FLOPS.get(func)
    if extra is not None:
        return int(extra(args, kwargs))
    packet = func._overloadpacket
    if packet in flop_registry:
        try:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these arguments
            return 0
    return 0


def _worst_indices(idx: torch.Tensor, dim: int, experts: int) -> torch.Tensor:
    """Indices of the worst routing, shaped as ``idx`` (``k`` choices per token along
    ``dim``, of ``experts``): every token's choices are the first ``k`` experts, but
    for the first tokens, which take one each of the others, so that every expert
    runs (its fixed costs) and the first ``k`` take nearly all tokens (their
    transients)."""
    moved = idx.movedim(dim, -1) if idx.dim() else idx.reshape(1)
    k = moved.shape[-1] if idx.dim() else 1
    rows = torch.arange(k, device=idx.device, dtype=idx.dtype).expand(
        *moved.shape[:-1], k
    )
    flat = rows.reshape(-1).clone()
    others = torch.arange(k, experts, device=idx.device, dtype=idx.dtype)
    n = min(others.numel(), flat.numel())
    flat[:n] = others[:n]
    out = flat.reshape(*moved.shape[:-1], k)
    return out.movedim(-1, dim).contiguous() if idx.dim() else out.reshape(())


class WorstRouting(TorchDispatchMode):
    """Every ``topk`` (and ``argmax``, ``max`` along a dimension) picks the worst
    routing (``_worst_indices``): a few tokens go to each expert beyond the first
    ``k``, all others to the first ``k``. The values are left as computed."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten.topk.default:
            values, idx = out
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            dim = dim % max(idx.dim(), 1)
            experts = args[0].shape[dim] if args[0].dim() else 1
            return values, _worst_indices(idx, dim, experts)
        if func in (aten.argmax.default, aten.max.dim):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None or args[0].dim() == 0:
                return out
            dim = dim % args[0].dim()
            experts = args[0].shape[dim]
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            idx = out if func is aten.argmax.default else out[1]
            shaped = idx if keep else idx.unsqueeze(dim)
            worst = _worst_indices(shaped, dim, experts)
            worst = worst if keep else worst.squeeze(dim)
            return worst if func is aten.argmax.default else (out[0], worst)
        return out


class _Counter(LiveBytes):
    """Live bytes, their peak and FLOPs of the real unit measured."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__(ignore)
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        self.track_outputs(out)
        return out


@dataclass(frozen=True)
class RealCosts:
    """One unit's step on ``items`` items of real tensors (bytes, FLOPs)."""

    items: int
    saved_bytes: int  # saved for backward: neither an input nor an output
    saves_input: bool
    saves_output: bool
    saved_io_bytes: int  # saved for backward: its inputs and outputs
    forward_peak_bytes: int
    forward_no_grad_peak_bytes: int
    backward_peak_bytes: int
    forward_flops: int
    backward_flops: int


_GROWING = (
    "saved_bytes",
    "saved_io_bytes",
    "forward_peak_bytes",
    "forward_no_grad_peak_bytes",
    "backward_peak_bytes",
    "forward_flops",
    "backward_flops",
)


def _line(a: int, b: int, n: int) -> int:
    """The value at ``n`` items of the line through ``a`` (1 item) and ``b`` (2
    items), never below ``a``."""
    return a + max(b - a, 0) * (n - 1)


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """The model's buffers (running statistics), its KV-cache setting and the random
    state as they were before."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    changed = no_kv_cache(model)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, was in buffers:
                b.copy_(was)
        for cfg in changed:
            cfg.use_cache = True


def _clone(tree: Any, grad_mask: Sequence[bool] | None = None) -> Any:
    leaves, spec = tree_flatten(tree)
    out = []
    j = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().clone()
            if grad_mask is not None and grad_mask[j] and t.is_floating_point():
                t.requires_grad_(True)
            j += 1
            leaf = t
        out.append(leaf)
    return tree_unflatten(out, spec)


class RealUnits:
    """Modules of one model profiled on real tensors (units, or the submodules of
    units where fake tensors failed), and their stand-ins in a fake trace.

    Args:
        model: the real model (its parameters real: not ``meta``, not fake).
        units: the modules to profile (``memory.blocks.Block``, real modules).
        inputs, targets, layout, batch: the batch as ``profile_units`` has it.
        sizes: micro-batch sizes (items) the profile will ask for.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Sequence[Block],
        inputs: Any,
        targets: Any,
        layout: Layout,
        batch: int,
        sizes: Sequence[int],
    ) -> None:
        self.model = model
        self.units = list(units)
        self.indices = set(range(len(self.units)))
        for p in model.parameters():
            if p.is_meta or type(p.data).__name__ == "FakeTensor":
                names = ", ".join(self.units[k].name for k in sorted(self.indices))
                raise MemoryPlanError(
                    f"{names} run only on real tensors (fake tensors cannot "
                    "profile them), but the model's parameters are not real; build "
                    "it with its weights to plan it"
                )
        if layout == ():
            self.slices = [1]  # the whole batch, never cut (batch_size_of is 1)
        elif batch % 2 == 0:
            self.slices = [1, 2]
        else:
            self.slices = sorted({1, *sizes})
        self.inputs: dict[int, dict[int, tuple[tuple, dict]]] = {}
        for s in self.slices:
            x, y = split_batch(inputs, targets, max(batch // s, 1), layout)[0]
            self.inputs[s] = self._capture(x)
        self._costs: dict[tuple[int, tuple[bool, ...]], RealCosts] = {}
        self._shapes: dict[tuple[int, int], tuple[Any, list]] = {}

    def _capture(self, x: Any) -> dict[int, tuple[tuple, dict]]:
        """Each fallback unit's first-call inputs, from the real model's forward
        (without autograd) on ``x``, stopped once all are captured."""
        got: dict[int, tuple[tuple, dict]] = {}

        class _Done(Exception):
            pass

        def hook(k: int) -> Callable:
            def pre(_m: nn.Module, a: tuple, kw: dict) -> None:
                if k not in got:
                    got[k] = _clone((a, kw))
                if len(got) == len(self.indices):
                    raise _Done

            return pre

        handles = [
            self.units[k].module.register_forward_pre_hook(hook(k), with_kwargs=True)
            for k in self.indices
        ]
        try:
            # routers before a module decide its inputs: route them the worst way
            with _untouched(self.model), torch.no_grad(), WorstRouting():
                call_model(self.model, x)
        except _Done:
            pass
        finally:
            for h in handles:
                h.remove()
        missing = self.indices - set(got)
        if missing:
            names = ", ".join(self.units[k].name for k in sorted(missing))
            raise MemoryPlanError(
                f"{names} are not called on one item of the batch; they cannot "
                "be profiled on real tensors"
            )
        return got

    # ------------------------------------------------------------ measurement
    def _measure(
        self, k: int, s: int, mask: tuple[bool, ...]
    ) -> tuple[RealCosts, Any, list]:
        module = self.units[k].module
        args, kwargs = _clone(self.inputs[s][k], mask)
        ins = [
            t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        ]
        params = [p for p in module.parameters() if p.requires_grad]
        ignore = {
            storage_key(t) for t in (*self.model.parameters(), *self.model.buffers())
        }
        in_keys = {storage_key(t) for t in ins}
        counter = _Counter(ignore | in_keys)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key not in ignore:
                saved[key] = storage_nbytes(t)
            return t

        with _untouched(self.model), counter, WorstRouting(), torch.enable_grad():
            level = counter.live
            with torch.no_grad():
                out = module(*args, **kwargs)
            ng_peak = counter.peak - level
            leaves, spec = tree_flatten(out)
            shapes = [
                (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
                for t in leaves
            ]
            del out, leaves
            counter.reset()
            counter.flops = 0
            level = counter.live
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = module(*args, **kwargs)
            fwd_peak = counter.peak - level
            fwd_flops = counter.flops
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            out_keys = {storage_key(t) for t in leaves}
            diff = [t for t in leaves if t.requires_grad]
            wrt = [t for t in ins if t.requires_grad] + params
            grads = [torch.ones_like(t) for t in diff]
            counter.reset()
            level = counter.live
            counter.flops = 0
            if diff and wrt:
                got = torch.autograd.grad(diff, wrt, grads, allow_unused=True)
                del got
            bwd_peak = counter.peak - level
            bwd_flops = counter.flops
            del out, leaves, diff, grads
        costs = RealCosts(
            items=s,
            saved_bytes=sum(
                b
                for key, b in saved.items()
                if key not in in_keys and key not in out_keys
            ),
            saves_input=any(key in saved for key in in_keys),
            saves_output=any(key in saved for key in out_keys),
            saved_io_bytes=sum(
                b for key, b in saved.items() if key in in_keys or key in out_keys
            ),
            forward_peak_bytes=fwd_peak,
            forward_no_grad_peak_bytes=ng_peak,
            backward_peak_bytes=bwd_peak,
            forward_flops=fwd_flops,
            backward_flops=bwd_flops,
        )
        return costs, spec, shapes

    def _at(self, k: int, s: int, mask: tuple[bool, ...]) -> RealCosts:
        key = (k, s, mask)
        if key not in self._costs:
            with _real():
                costs, spec, shapes = self._measure(k, s, mask)
            self._costs[key] = costs  # type: ignore[index]
            self._shapes[(k, s)] = (spec, shapes)
        return self._costs[key]  # type: ignore[index]

    def costs(self, k: int, n: int, mask: tuple[bool, ...]) -> RealCosts:
        """Unit ``k``'s real costs at a micro-batch of ``n`` items (``mask``: which
        tensor inputs take gradients, as the fake trace calls it)."""
        if n in self.slices:
            return self._at(k, n, mask)
        a, b = self._at(k, 1, mask), self._at(k, 2, mask)
        grown = {f: _line(getattr(a, f), getattr(b, f), n) for f in _GROWING}
        return RealCosts(
            items=n,
            saves_input=a.saves_input or b.saves_input,
            saves_output=a.saves_output or b.saves_output,
            **grown,
        )

    def _shapes_at(self, k: int, s: int, mask: tuple[bool, ...]) -> tuple[Any, list]:
        if (k, s) not in self._shapes:
            self._at(k, s, mask)
        return self._shapes[(k, s)]

    def _out_shapes(self, k: int, n: int, mask: tuple[bool, ...]) -> tuple[Any, list]:
        if n in self.slices:
            return self._shapes_at(k, n, mask)
        self._shapes_at(k, 1, mask)
        self._shapes_at(k, 2, mask)
        spec, one = self._shapes[(k, 1)]
        _, two = self._shapes[(k, 2)]
        shapes = []
        for a, b in zip(one, two):
            if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype):
                shape = tuple(_line(x, y, n) for x, y in zip(a[0], b[0]))
                shapes.append((shape, a[1]))
            else:
                shapes.append(a)
        return spec, shapes

    # ------------------------------------------------------------ stand-ins
    @contextlib.contextmanager
    def standing_in(
        self, fake_units: Sequence[Block], items: Callable[[], int]
    ) -> Iterator[None]:  # fake_units: the fake copies of ``units``
        """The fake units ``indices`` replaced by stand-ins while in the context:
        fake outputs of the real unit's shapes at ``items()`` items, connected to
        the fake inputs and parameters for autograd (their backward returns fake
        gradients), and nothing saved (``costs`` has what the unit costs)."""
        self.calls: dict[int, tuple[bool, ...]] = {}
        for k in self.indices:
            mod = fake_units[k].module
            mod.forward = self._stand_in(k, mod, items)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for k in self.indices:
                mod = fake_units[k].module
                if "forward" in mod.__dict__:
                    del mod.forward

    def _stand_in(self, k: int, mod: nn.Module, items: Callable[[], int]) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            flat = [
                t
                for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)
            ]
            mask = tuple(bool(t.requires_grad) for t in flat)
            if torch.is_grad_enabled():
                self.calls[k] = mask
            try:
                with _real():
                    spec, shapes = self._out_shapes(k, items(), mask)
            except MemoryPlanError:
                raise
            except Exception as e:
                first = (str(e).strip().splitlines() or [""])[0][:160]
                raise MemoryPlanError(
                    f"{self.units[k].name} fails on real tensors too: "
                    f"{type(e).__name__} {first}"
                ) from e
            device = flat[0].device if flat else torch.device("cpu")
            grad_in = [t for t in flat if t.requires_grad and t.is_floating_point()]
            grad_in += [p for p in mod.parameters() if p.requires_grad]
            if torch.is_grad_enabled() and grad_in:
                outs = _StandIn.apply(shapes, device, *grad_in)
            else:
                outs = _make(shapes, device)
            leaves = []
            it = iter(outs)
            for sh in shapes:
                leaves.append(next(it) if _is_shape(sh) else sh)
            return tree_unflatten(leaves, spec)

        return forward


def _is_shape(sh: Any) -> bool:
    return isinstance(sh, tuple) and len(sh) == 2 and isinstance(sh[1], torch.dtype)


def _make(shapes: list, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.empty(sh[0], dtype=sh[1], device=device) for sh in shapes if _is_shape(sh)
    )


class _StandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shapes: list, device: torch.device, *xs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.metas = [(x.shape, x.dtype, x.device) for x in xs]
        outs = _make(shapes, device)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        return (
            None,
            None,
            *[torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas],
        )


@contextlib.contextmanager
def _real() -> Iterator[None]:
    """Outside the fake mode and the trace's dispatch modes for a while (the real
    unit runs on real tensors, counted by its own)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


COUPLING_RTOL = 1e-4
"""Relative difference between an item's output alone and in a batch of two above
which the items are coupled (rounding of batched kernels is far below it)."""

LOSS_COUPLING_RTOL = 2e-6
"""The same for the loss: the pair's against its items' losses weighted by the items
they count (as micro-batches weight them). A router's load-balancing loss, weighted
1e-2 to 1e-3 against the model's loss, moves it by 1e-5 and more."""


def batch_coupling(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable | None,
    layout: Layout,
    batch: int,
) -> str | None:
    """Why ``model``'s items are not independent, or None: the first two items run
    together and each alone (without autograd, in eval mode so that dropout draws
    nothing; buffers, modes and the random state put back). Every batch-shaped
    output of the pair must equal the single items' within ``COUPLING_RTOL``, and the
    pair's loss their losses weighted by the items they count (as micro-batches are)
    within ``LOSS_COUPLING_RTOL``. A router's load-balancing loss (a function of the
    whole batch's routing) or an expert capacity over the batch fails this;
    micro-batches would then train another function."""
    if layout == () or batch < 2:
        return None
    from memory.batch import first_items, loss_count, loss_of

    pair = first_items(inputs, targets, 2, layout)
    ones = split_batch(pair[0], pair[1], 2, layout)
    modes = [(m, m.training) for m in model.modules()]
    name = type(model).__name__
    try:
        model.eval()
        with _untouched(model), torch.no_grad():
            both = call_model(model, pair[0])
            alone = [call_model(model, x) for x, _ in ones]
            try:
                pair_loss = float(loss_of(both, pair[1], loss_fn))
                counts = [loss_count(model, loss_fn, x, y) for x, y in ones]
                losses = [
                    float(loss_of(a, y, loss_fn)) for a, (_, y) in zip(alone, ones)
                ]
            except Exception:  # no loss to compare: the outputs only
                pair_loss, counts, losses = None, [], []
    except Exception:  # the check is only a check; training will tell
        return None
    finally:
        for m, was in modes:
            m.training = was
    if pair_loss is not None and sum(counts) > 0:
        mean = sum(c * v for c, v in zip(counts, losses)) / sum(counts)
        rel = abs(pair_loss - mean) / max(abs(mean), 1e-12)
        if rel > LOSS_COUPLING_RTOL:
            return (
                f"{name}'s loss on two items differs from their own losses weighted "
                f"(relative {rel:.1e}: an auxiliary loss over the batch's routing, a "
                "layer over the batch); micro-batches would train another loss"
            )

    scalar = _scalars(both)
    for key, v in scalar.items():
        each = [_scalars(a).get(key) for a in alone]
        vs = [x for x in each if x is not None]
        if len(vs) != len(each):
            continue
        fits = [sum(vs) / 2, sum(vs)]
        if counts and sum(counts) > 0:
            fits.append(sum(c * x for c, x in zip(counts, vs)) / sum(counts))
        if all(abs(v - f) > COUPLING_RTOL * max(abs(f), 1e-6) for f in fits):
            return (
                f"{name}'s {key} on two items is neither the mean nor the sum of "
                "theirs (a router's load-balancing loss over the batch's routing); "
                "micro-batches would train another loss"
            )

    def rows(out: Any) -> list[torch.Tensor]:
        if isinstance(out, dict):
            out = list(out.values())
        return [
            t
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.is_floating_point()
        ]

    got = rows(both)
    singles = [rows(a) for a in alone]
    for i, t in enumerate(got):
        if t.shape[0] != 2 or any(len(s) <= i for s in singles):
            continue
        for j in range(2):
            one = singles[j][i]
            if one.shape != t[j : j + 1].shape:
                continue
            diff = (t[j : j + 1] - one).abs().max().item()
            scale = max(one.abs().max().item(), 1e-6)
            if diff > COUPLING_RTOL * scale:
                return (
                    f"{name}'s output for an item depends on the other items of its "
                    f"batch (relative {diff / scale:.1e}: an expert capacity over the "
                    "batch, a layer over the batch); micro-batches would train another "
                    "function"
                )
    return None


def _scalars(out: Any) -> dict[str, float]:
    """A model output's named float scalars but its loss (auxiliary losses)."""
    if not isinstance(out, dict):
        return {}
    return {
        k: float(v)
        for k, v in out.items()
        if k != "loss"
        and isinstance(v, torch.Tensor)
        and v.dim() == 0
        and v.is_floating_point()
    }
