"""Width-scaled sub-models of the built-in workloads (HeteroFL, FedRolex).

A sub-model at ratio ``r`` keeps the model's depth, its inputs and its outputs (image
pixels, vocabulary, classes) and takes ``ceil(r * n)`` of every hidden dimension's
``n`` indices: channels and hidden units of the digits models; for the GPTs the
residual width, the number of attention heads (each head keeps its width, so a
sub-model's head is one of the full model's heads) and the MLP width. Which indices
is decided by an offset per hidden dimension: 0 takes the first ones (HeteroFL), a
round-dependent offset takes a window that wraps around (FedRolex).

- ``width_spec(name)``: the model's hidden dimensions ("axes") and, for every
  state-dict key, which axis each tensor dimension runs over (``None``: not scaled).
- ``index_maps(spec, ratio, offset)``: per key and tensor dimension, the full-model
  indices the sub-model's entries come from; ``slice_state`` applies them.
- ``width_model(name, ratio)``: the sub-model itself, whose state-dict shapes are the
  slices' shapes, with HeteroFL's scaler (below).

Registered as the workload ``NAME@wR`` (``get_workload("gpt-byte@w0.25")``), so a
client builds the sub-model it is sent from the workload name alone.

HeteroFL's "Scaler" (Diao et al. 2021): during training a sub-model's
hidden layers' outputs are divided by ``r`` (as inverted dropout does), so that the
sub-model's activations have the full model's scale; in evaluation it is the
identity. Here it is a forward hook on every weight layer except the output layer
(forward hooks keep the state-dict keys, and so the index maps, those of the full
model); a model at ratio 1 has no hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from workloads import models

LEVELS = (1.0, 0.5, 0.25, 0.125, 0.0625)
"""HeteroFL's model-rate levels (its ``a``-``e``: 1, 1/2, 1/4, 1/8, 1/16)."""

CHAIN_MODELS = ("digits-cnn", "digits-cnn-bn", "digits-mlp")


@dataclass(frozen=True)
class Dim:
    """How one tensor dimension runs over a hidden axis.

    The dimension has ``outer * axis_units * inner`` entries: ``outer`` blocks (the
    q, k, v thirds of a fused projection), each ``axis_units`` groups of ``inner``
    consecutive entries (the pixels of a channel after ``Flatten``, the width of an
    attention head).
    """

    axis: str
    inner: int = 1
    outer: int = 1


@dataclass(frozen=True)
class WidthSpec:
    """A model's hidden axes (name -> units) and per state-dict key, per tensor
    dimension, its ``Dim`` (``None``: never scaled: inputs, outputs, kernels)."""

    axes: Mapping[str, int]
    params: Mapping[str, tuple[Dim | None, ...]]


def sub_units(units: int, ratio: float) -> int:
    """Units of an axis kept at ``ratio``: ``ceil(ratio * units)``, at least one
    (HeteroFL's rounding)."""
    return max(1, math.ceil(ratio * units - 1e-9))


def _base_model(name: str) -> nn.Module:
    if name in models.GPT_PRESETS:
        return models.GPT(models.GPT_PRESETS[name])
    if name == "digits-cnn":
        return models.DigitsCNN()
    if name == "digits-cnn-bn":
        return models.DigitsCNN(batch_norm=True)
    if name == "digits-mlp":
        return models.MLP()
    raise ValueError(
        f"{name!r} has no width-scaled sub-models: built-ins "
        f"{', '.join((*CHAIN_MODELS, *models.GPT_PRESETS))} have"
    )


def supported(name: str) -> bool:
    return name in CHAIN_MODELS or name in models.GPT_PRESETS


def levels(name: str) -> tuple[float, ...]:
    """The levels of ``LEVELS`` ``name`` can be cut to: all for the digits models;
    for a GPT those that leave a whole number of heads."""
    if name in models.GPT_PRESETS:
        h = models.GPT_PRESETS[name].num_heads
        return tuple(
            r for r in LEVELS if abs(h * r - round(h * r)) < 1e-9 and h * r >= 1
        )
    _base_model(name)  # refuses an unknown name
    return LEVELS


def check_ratio(name: str, ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"width ratio {ratio!r} must be in (0, 1]")
    if name in models.GPT_PRESETS:
        h = models.GPT_PRESETS[name].num_heads
        if abs(h * ratio - round(h * ratio)) > 1e-9 or round(h * ratio) < 1:
            raise ValueError(
                f"{name} has {h} attention heads: a width ratio of {ratio:g} leaves "
                f"{h * ratio:g}; choose one of {', '.join(f'{r:g}' for r in levels(name))}"
            )


# ------------------------------------------------------------------ specs
def width_spec(name: str) -> WidthSpec:
    """The hidden axes of built-in ``name`` and the axis of every tensor dimension."""
    if name in models.GPT_PRESETS:
        return _gpt_spec(models.GPT_PRESETS[name])
    return _chain_spec(_base_model(name))


def _gpt_spec(cfg: models.GPTConfig) -> WidthSpec:
    d, h = cfg.d_model, cfg.num_heads
    hd = d // h
    axes: dict[str, int] = {"d": d}
    params: dict[str, tuple[Dim | None, ...]] = {
        "embed.tok.weight": (None, Dim("d")),
        "embed.pos.weight": (None, Dim("d")),
        "head.ln.weight": (Dim("d"),),
        "head.ln.bias": (Dim("d"),),
        "head.proj.weight": (None, Dim("d")),
    }
    for i in range(cfg.num_layers):
        p, heads, ffn = f"layers.{i}.", f"layers.{i}.heads", f"layers.{i}.ffn"
        axes[heads], axes[ffn] = h, 4 * d
        qkv = Dim(heads, inner=hd, outer=3)
        params |= {
            p + "ln1.weight": (Dim("d"),),
            p + "ln1.bias": (Dim("d"),),
            p + "qkv.weight": (qkv, Dim("d")),
            p + "qkv.bias": (qkv,),
            p + "proj.weight": (Dim("d"), Dim(heads, inner=hd)),
            p + "proj.bias": (Dim("d"),),
            p + "ln2.weight": (Dim("d"),),
            p + "ln2.bias": (Dim("d"),),
            p + "fc.weight": (Dim(ffn), Dim("d")),
            p + "fc.bias": (Dim(ffn),),
            p + "out.weight": (Dim("d"), Dim(ffn)),
            p + "out.bias": (Dim("d"),),
        }
    return WidthSpec(axes, params)


def _chain_spec(model: nn.Module) -> WidthSpec:
    """A chain's axes, from its weight layers in execution order: each ``Linear`` or
    ``Conv2d`` but the last opens an axis (its outputs) that the next one reads (a
    ``Linear`` after ``Flatten`` reads each channel's pixels: ``inner``), and a
    ``BatchNorm2d`` runs over the axis before it."""
    layers = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv2d | nn.BatchNorm2d)
    ]
    last = max(
        i for i, (_, m) in enumerate(layers) if not isinstance(m, nn.BatchNorm2d)
    )
    axes: dict[str, int] = {}
    params: dict[str, tuple[Dim | None, ...]] = {}
    prev: str | None = None
    for i, (name, m) in enumerate(layers):
        if isinstance(m, nn.BatchNorm2d):
            assert prev is not None, "a BatchNorm before any weight layer"
            for key in ("weight", "bias", "running_mean", "running_var"):
                params[f"{name}.{key}"] = (Dim(prev),)
            params[f"{name}.num_batches_tracked"] = ()
            continue
        conv = isinstance(m, nn.Conv2d)
        n_in: int = m.in_channels if isinstance(m, nn.Conv2d) else m.in_features
        n_out: int = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
        d_in: Dim | None = None
        if prev is not None:
            assert n_in % axes[prev] == 0, (name, n_in, axes[prev])
            d_in = Dim(prev, inner=n_in // axes[prev])
        d_out: Dim | None = None
        if i != last:
            axes[name] = n_out
            d_out = Dim(name)
        kernel = (None, None) if conv else ()
        params[f"{name}.weight"] = (d_out, d_in, *kernel)
        if m.bias is not None:
            params[f"{name}.bias"] = (d_out,)
        prev = name if i != last else None
    return WidthSpec(axes, params)


# ------------------------------------------------------------------ indices
def axis_indices(units: int, ratio: float, offset: int = 0) -> torch.Tensor:
    """The ``sub_units`` kept of an axis of ``units``: ``offset, offset + 1, ...``
    wrapping around (offset 0: the first ones, HeteroFL; FedRolex rolls it)."""
    k = sub_units(units, ratio)
    if k == units:  # the whole axis, in its own order
        return torch.arange(units)
    return (offset + torch.arange(k)) % units


def _dim_indices(dim: Dim, units: int, kept: torch.Tensor) -> torch.Tensor:
    inner = torch.arange(dim.inner)
    block = (kept[:, None] * dim.inner + inner[None, :]).reshape(-1)
    span = units * dim.inner
    return torch.cat([o * span + block for o in range(dim.outer)])


def index_maps(
    spec: WidthSpec,
    ratio: float,
    offsets: Mapping[str, int] | int = 0,
) -> dict[str, tuple[torch.Tensor | None, ...]]:
    """Per state-dict key, per tensor dimension, the full model's indices of the
    sub-model's entries (``None``: the whole dimension). ``offsets``: per axis, or
    one for all (an axis's offset is taken modulo its units)."""
    kept = {
        a: axis_indices(
            n,
            ratio,
            (offsets if isinstance(offsets, int) else offsets.get(a, 0)) % n,
        )
        for a, n in spec.axes.items()
    }
    return {
        key: tuple(
            None if d is None else _dim_indices(d, spec.axes[d.axis], kept[d.axis])
            for d in dims
        )
        for key, dims in spec.params.items()
    }


def rolling_offsets(spec: WidthSpec, server_round: int) -> dict[str, int]:
    """FedRolex's window for ``server_round`` (1-based): every axis's window starts
    ``server_round - 1`` units further on, modulo the axis's units."""
    return {a: (server_round - 1) % n for a, n in spec.axes.items()}


def slice_tensor(t: torch.Tensor, idx: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """``t`` restricted to ``idx`` (one index tensor or ``None`` per dimension)."""
    assert len(idx) == t.dim(), (tuple(t.shape), len(idx))
    for dim, i in enumerate(idx):
        if i is not None:
            t = t.index_select(dim, i)
    return t


def slice_state(
    state: Mapping[str, torch.Tensor],
    maps: Mapping[str, tuple[torch.Tensor | None, ...]],
) -> dict[str, torch.Tensor]:
    """The sub-model's state dict: every key of ``state`` sliced by ``maps``."""
    missing = sorted(set(state) - set(maps))
    if missing:
        raise ValueError(f"no index map for {missing[:5]}")
    return {k: slice_tensor(v, maps[k]).clone() for k, v in state.items()}


def full_indices(
    idx: tuple[torch.Tensor | None, ...], shape: torch.Size
) -> tuple[torch.Tensor, ...]:
    """``idx`` with every ``None`` spelled out, as ``meshgrid`` index tensors: the
    full tensor's entries ``t[full_indices(...)]`` are the slice's, in its order."""
    spelled = [torch.arange(n) if i is None else i for i, n in zip(idx, shape)]
    if not spelled:
        return ()
    return torch.meshgrid(*spelled, indexing="ij")


# ------------------------------------------------------------------ sub-models
def width_model(name: str, ratio: float) -> nn.Module:
    """Built-in ``name`` at width ``ratio`` (with the scaler when ``ratio < 1``)."""
    check_ratio(name, ratio)
    if name in models.GPT_PRESETS:
        cfg = models.GPT_PRESETS[name]
        heads = round(cfg.num_heads * ratio)
        sub = replace(
            cfg, d_model=cfg.d_model // cfg.num_heads * heads, num_heads=heads
        )
        gpt = models.GPT(sub)
        model: nn.Module = gpt
        output: nn.Module = gpt.head.proj
    else:

        def w(n: int) -> int:
            return sub_units(n, ratio)

        if name == "digits-mlp":
            model = models.MLP(hidden=(w(128), w(128)))
        else:
            model = models.DigitsCNN(
                channels=(w(16), w(32)),
                hidden=w(64),
                batch_norm=name == "digits-cnn-bn",
            )
        output = list(model)[-1]
    if ratio < 1:
        add_scaler(model, ratio, output)
    return model


def width_factory(name: str, ratio: float) -> Callable[[], nn.Module]:
    check_ratio(name, ratio)
    return lambda: width_model(name, ratio)


def add_scaler(model: nn.Module, ratio: float, output: nn.Module) -> None:
    """HeteroFL's scaler: in training, every weight layer's output but ``output``'s
    is divided by ``ratio``; the identity in evaluation."""

    def scale(module: nn.Module, _inputs: object, out: torch.Tensor) -> torch.Tensor:
        return out / ratio if module.training else out

    for m in model.modules():
        if m is not output and isinstance(m, nn.Linear | nn.Conv2d | nn.Embedding):
            m.register_forward_hook(scale)
