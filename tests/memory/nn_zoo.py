"""The torch.nn zoo's models: every ``torch.nn`` module class with parameters, each
inside a small model (issue 34), enumerated by rule.

``classify(name)`` sorts every ``nn.Module`` subclass that ``torch.nn`` exports:

- ``"zoo"``: it has parameters once built with the table's small arguments
  (``LAYERS``); ``build(name)`` makes a model around it: an input projection, copies
  of the layer (a ``ModuleList``, so each copy is a unit) and a head;
- ``"none"``: it has no parameters once built (containers, losses, activations,
  pools, pads: the no-argument constructor, or ``PARAMETERLESS``'s arguments);
- ``"skip"``: ``SKIPPED`` says why (a wrapper of another module, an abstract base);
- ``"unknown"``: none of the tables knows it and it cannot be built without
  arguments, or it has parameters and no zoo entry: a new torch version's class,
  which the zoo's test fails on until the tables say what it is.

Layers whose parameters are created by their first forward (``Lazy*``) are
materialised by a dry forward in eval mode (no running statistics move) before the
model is planned. Sizes are small but the activations dominate the fixed part of a
prediction (``memory.cost.ALLOCATOR_SLACK_BYTES``), so that plans at half of plain's
predicted peak exist: they micro-batch, recompute, offload and stream.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

B, T, D = 64, 64, 64
"""Items per batch, tokens per item, features (the token frames: 1 MiB a tensor)."""
C = 8
"""Channels (the convolution frames)."""
SPATIAL = {1: (512,), 2: (24, 24), 3: (8, 8, 8)}
"""Each convolution frame's item size (1 to 3 spatial dimensions)."""
SPATIAL_B = {1: 64, 2: 64, 3: 64}
"""Each convolution frame's batch (1 to 1.1 MiB a tensor)."""
K = 10
"""Classes of the head."""
V = 4000
"""Rows of an embedding table (1 MiB: its state dominates the ids frame's peak)."""
COPIES = 3
"""Copies of the layer in each model (a ModuleList: one unit each)."""


@dataclass(frozen=True)
class Layer:
    """How one class enters the zoo.

    Attributes:
        make: builds one copy of the layer (small arguments).
        frame: the model around it: ``"tokens"`` (B, T, D), ``"vectors"`` (B*T, D),
            ``"conv1"``/``"conv2"``/``"conv3"`` (B, C, *spatial), ``"ids"`` (B, T)
            token ids whose tables' outputs add up, ``"loss"`` (the layer is the
            model's head and computes the loss from the targets).
        call: ``call(layer, h) -> h``, how the model calls a copy (default
            ``layer(h)``).
        family: the group the zoo's representatives are drawn from.
        copies: copies of the layer.
        shape: ``(items, tokens)`` of the token frames (default ``(B, T)``): recurrent
            layers run ``tokens`` steps one after another, so they get fewer.
    """

    make: Callable[[], nn.Module]
    frame: str
    call: Callable[[nn.Module, Any], Any] | None = None
    family: str = ""
    copies: int = COPIES
    shape: tuple[int, int] = (B, T)


def _first(layer: nn.Module, h: Any) -> Any:
    return layer(h)[0]  # recurrent layers: (output, state)


def _self_attention(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h, h, h, need_weights=False)[0]


def _on_itself(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h, h)  # decoders: the same sequence as target and memory


def _encoder_layer(**kw: Any) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(
        D, 2, dim_feedforward=2 * D, dropout=0.0, batch_first=True, **kw
    )


def _decoder_layer() -> nn.TransformerDecoderLayer:
    return nn.TransformerDecoderLayer(
        D, 2, dim_feedforward=2 * D, dropout=0.0, batch_first=True
    )


def _bilinear(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return layer(h, h[..., :4])  # a narrow second input: torch's bilinear is slow


def _conv(n: int, family: str, make: Callable[[], nn.Module]) -> Layer:
    # without micro-batches (BatchNorm) a plan cuts only activations: more copies, so
    # that they dominate one unit's working set
    copies = 12 if family == "batchnorm" else COPIES
    return Layer(make, f"conv{n}", family=family, copies=copies)


_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONVT = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_LAZY_CONV = {1: nn.LazyConv1d, 2: nn.LazyConv2d, 3: nn.LazyConv3d}
_LAZY_CONVT = {
    1: nn.LazyConvTranspose1d,
    2: nn.LazyConvTranspose2d,
    3: nn.LazyConvTranspose3d,
}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_LAZY_BN = {1: nn.LazyBatchNorm1d, 2: nn.LazyBatchNorm2d, 3: nn.LazyBatchNorm3d}
_IN = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
_LAZY_IN = {
    1: nn.LazyInstanceNorm1d,
    2: nn.LazyInstanceNorm2d,
    3: nn.LazyInstanceNorm3d,
}


def _layers() -> dict[str, Layer]:
    out: dict[str, Layer] = {
        "Linear": Layer(lambda: nn.Linear(D, D), "tokens", family="linear"),
        "Bilinear": Layer(
            lambda: nn.Bilinear(D, 4, D), "tokens", _bilinear, family="linear"
        ),
        "LazyLinear": Layer(lambda: nn.LazyLinear(D), "tokens", family="linear"),
        **{
            name: Layer(
                lambda cls=cls: cls(D, D, batch_first=True),
                "tokens",
                _first,
                "recurrent",
                shape=(B * T // 8, 8),
            )
            for name, cls in (("RNN", nn.RNN), ("LSTM", nn.LSTM), ("GRU", nn.GRU))
        },
        "RNNCell": Layer(lambda: nn.RNNCell(D, D), "vectors", family="recurrent"),
        "LSTMCell": Layer(lambda: nn.LSTMCell(D, D), "vectors", _first, "recurrent"),
        "GRUCell": Layer(lambda: nn.GRUCell(D, D), "vectors", family="recurrent"),
        "Embedding": Layer(lambda: nn.Embedding(V, D), "ids", family="embedding"),
        "EmbeddingBag": Layer(
            lambda: nn.EmbeddingBag(V, D, mode="mean"), "ids", family="embedding"
        ),
        "MultiheadAttention": Layer(
            lambda: nn.MultiheadAttention(D, 2, batch_first=True),
            "tokens",
            _self_attention,
            "attention",
        ),
        "TransformerEncoderLayer": Layer(_encoder_layer, "tokens", family="attention"),
        "TransformerDecoderLayer": Layer(
            _decoder_layer, "tokens", _on_itself, "attention"
        ),
        "Transformer": Layer(
            lambda: nn.Transformer(
                D,
                2,
                num_encoder_layers=1,
                num_decoder_layers=1,
                dim_feedforward=2 * D,
                dropout=0.0,
                batch_first=True,
            ),
            "tokens",
            _on_itself,
            "attention",
            copies=2,
        ),
        "TransformerEncoder": Layer(
            lambda: nn.TransformerEncoder(
                _encoder_layer(), 2, enable_nested_tensor=False
            ),
            "tokens",
            family="attention",
            copies=2,
        ),
        "TransformerDecoder": Layer(
            lambda: nn.TransformerDecoder(_decoder_layer(), 2),
            "tokens",
            _on_itself,
            "attention",
            copies=2,
        ),
        "LayerNorm": Layer(lambda: nn.LayerNorm(D), "tokens", family="norm"),
        "RMSNorm": Layer(lambda: nn.RMSNorm(D), "tokens", family="norm"),
        "GroupNorm": _conv(2, "norm", lambda: nn.GroupNorm(2, C)),
        "SyncBatchNorm": _conv(2, "batchnorm", lambda: nn.SyncBatchNorm(C)),
        "PReLU": Layer(nn.PReLU, "tokens", family="activation"),
        "AdaptiveLogSoftmaxWithLoss": Layer(
            lambda: nn.AdaptiveLogSoftmaxWithLoss(D, K, cutoffs=[4, 8]),
            "loss",
            lambda layer, h: layer(*h).loss,
            "loss",
        ),
        "LinearCrossEntropyLoss": Layer(
            lambda: nn.LinearCrossEntropyLoss(D, K, bias=True),
            "loss",
            lambda layer, h: layer(*h),
            "loss",
        ),
    }
    for n in (1, 2, 3):
        d = f"{n}d"
        out[f"Conv{d}"] = _conv(n, "conv", lambda n=n: _CONV[n](C, C, 3, padding=1))
        out[f"ConvTranspose{d}"] = _conv(
            n, "conv", lambda n=n: _CONVT[n](C, C, 3, padding=1)
        )
        out[f"LazyConv{d}"] = _conv(
            n, "conv", lambda n=n: _LAZY_CONV[n](C, 3, padding=1)
        )
        out[f"LazyConvTranspose{d}"] = _conv(
            n, "conv", lambda n=n: _LAZY_CONVT[n](C, 3, padding=1)
        )
        out[f"BatchNorm{d}"] = _conv(n, "batchnorm", lambda n=n: _BN[n](C))
        out[f"LazyBatchNorm{d}"] = _conv(n, "batchnorm", lambda n=n: _LAZY_BN[n]())
        out[f"InstanceNorm{d}"] = _conv(n, "norm", lambda n=n: _IN[n](C, affine=True))
        out[f"LazyInstanceNorm{d}"] = _conv(
            n, "norm", lambda n=n: _LAZY_IN[n](affine=True)
        )
    return out


LAYERS = _layers()
"""Every class with parameters, by name: how the zoo builds and calls it."""

PARAMETERLESS: dict[str, tuple] = {
    **{f"AdaptiveAvgPool{n}d": (2,) for n in (1, 2, 3)},
    **{f"AdaptiveMaxPool{n}d": (2,) for n in (1, 2, 3)},
    **{f"AvgPool{n}d": (2,) for n in (1, 2, 3)},
    **{f"MaxPool{n}d": (2,) for n in (1, 2, 3)},
    **{f"MaxUnpool{n}d": (2,) for n in (1, 2, 3)},
    **{f"LPPool{n}d": (2, 2) for n in (1, 2, 3)},
    **{
        f"{p}Pad{n}d": (1,)
        for p in ("Circular", "Reflection", "Replication", "Zero")
        for n in (1, 2, 3)
    },
    **{f"ConstantPad{n}d": (1, 0.0) for n in (1, 2, 3)},
    "FractionalMaxPool2d": (2, (2, 2)),
    "FractionalMaxPool3d": (2, (2, 2, 2)),
    "ChannelShuffle": (2,),
    "CrossMapLRN2d": (2,),
    "LocalResponseNorm": (2,),
    "Fold": ((4, 4), (2, 2)),
    "Unfold": (2,),
    "PixelShuffle": (2,),
    "PixelUnshuffle": (2,),
    "Threshold": (0.1, 0.0),
    "Unflatten": (1, (2, 2)),
}
"""Classes without parameters whose constructors need arguments: built with these to
show that they have none (the rest are built without arguments)."""

SKIPPED = {
    "DataParallel": "wraps another module to replicate it over devices (its "
    "parameters are that module's); one device here",
    "RNNBase": "the base class of RNN, LSTM and GRU (each in the zoo)",
    "RNNCellBase": "the base class of RNNCell, LSTMCell and GRUCell (each in the zoo)",
}
"""Classes left out, with the reason."""


def module_classes() -> list[str]:
    """Every ``nn.Module`` subclass exported by ``torch.nn`` and ``torch.nn.modules``,
    by name, sorted."""
    names = set()
    for ns in (nn, nn.modules):
        for name in dir(ns):
            obj = getattr(ns, name)
            if (
                not name.startswith("_")
                and inspect.isclass(obj)
                and issubclass(obj, nn.Module)
            ):
                names.add(name)
    return sorted(names)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def classify(name: str) -> tuple[str, str]:
    """``(kind, why)`` for the class ``name``: kind is ``"zoo"``, ``"none"``,
    ``"skip"`` or ``"unknown"`` (see the module docstring)."""
    if name in SKIPPED:
        return "skip", SKIPPED[name]
    cls = getattr(nn, name)
    if name in LAYERS:
        layer = LAYERS[name].make()
        if isinstance(layer, nn.modules.lazy.LazyModuleMixin) or _has_parameters(layer):
            return "zoo", ""
        return "unknown", f"{name}: its zoo entry builds a module without parameters"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated classes (Container, NLLLoss2d)
        try:
            module = cls(*PARAMETERLESS.get(name, ()))
        except TypeError as e:
            return "unknown", (
                f"unknown class {name} ({e}): add it to the table (tests/memory/"
                "nn_zoo.py: LAYERS if it has parameters, else PARAMETERLESS)"
            )
    if _has_parameters(module):
        return "unknown", (
            f"unknown class {name}: it has parameters; add it to the zoo's table "
            "(tests/memory/nn_zoo.py: LAYERS)"
        )
    return "none", ""


class ZooModel(nn.Module):
    """An input projection, ``copies`` of the layer and a linear head. Nothing runs
    between the units that saves a tensor for the backward (a unit whose output such
    "glue" saves can only be kept, ``memory.unit_profile``), so that every unit may
    be recomputed, offloaded and streamed."""

    def __init__(self, spec: Layer) -> None:
        super().__init__()
        self.frame = spec.frame
        self._call = spec.call or (lambda layer, h: layer(h))
        # a norm that normalises per channel (InstanceNorm, BatchNorm) makes the
        # affine parameters of the copy before it inert: each copy also gets the
        # projection's output, added (an addition saves nothing for the backward)
        self.residual = spec.family in ("norm", "batchnorm")
        conv = spec.frame.startswith("conv")
        if conv:
            self.inp: nn.Module = _CONV[int(spec.frame[-1])](2, C, 1)
        elif spec.frame != "ids":
            self.inp = nn.Linear(D // 2, D)
        if spec.frame == "loss":  # the layer is the head, after linear layers
            self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(spec.copies))
            self.head = spec.make()
            return
        self.layers = nn.ModuleList(spec.make() for _ in range(spec.copies))
        # a class per position (token, pixel): each weight's gradient sums terms
        # that vary, not a pooled mean's near-cancelling ones
        self.head = _CONV[int(spec.frame[-1])](C, K, 1) if conv else nn.Linear(D, K)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Any:
        if self.frame == "ids":
            h = sum(self._call(layer, x) for layer in self.layers)
        elif self.frame == "loss":
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self._call(self.head, (h, y))
        else:
            h = h0 = self.inp(x)
            for layer in self.layers:
                h = self._call(layer, h)
                if self.residual:
                    h = h + h0
        assert isinstance(h, torch.Tensor)
        return self.head(h)


def batch(spec: Layer, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and class targets (one per position) for a layer's frame."""
    g = torch.Generator().manual_seed(seed)
    items, tokens = spec.shape
    if spec.frame == "tokens":
        x = torch.randn(items, tokens, D // 2, generator=g)
        where: tuple[int, ...] = (items, tokens)
    elif spec.frame in ("vectors", "loss"):
        x = torch.randn(items * tokens, D // 2, generator=g)
        where = (items * tokens,)
    elif spec.frame == "ids":
        x = torch.randint(0, V, (items, tokens), generator=g)
        bag = isinstance(spec.make(), nn.EmbeddingBag)  # one vector per item
        where = (items,) if bag else (items, tokens)
    else:
        d = int(spec.frame[-1])
        where = (SPATIAL_B[d], *SPATIAL[d])
        x = torch.randn(where[0], 2, *where[1:], generator=g)
    return x, torch.randint(0, K, where, generator=g)


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy, classes in dimension 1 (rows, pixels)."""
    return F.cross_entropy(out, y)


def token_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every token, classes last."""
    return F.cross_entropy(out.reshape(-1, K), y.reshape(-1))


def own_loss(out: torch.Tensor, _y: Any) -> torch.Tensor:
    return out  # the model computed its loss itself


@dataclass
class Case:
    """One zoo model with its batch and loss: the model is called as
    ``model(*inputs)`` and trained on ``loss_fn(model(*inputs), targets)``."""

    model: nn.Module
    inputs: tuple
    targets: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_dependent: bool = False


def build(name: str, seed: int = 0) -> Case:
    """The zoo model of class ``name`` (``LAYERS``) or extra case (``EXTRAS``),
    with its batch; the same weights for the same seed."""
    spec = LAYERS[name] if name in LAYERS else EXTRAS[name]
    torch.manual_seed(seed)
    model = ZooModel(spec)
    x, y = batch(spec)
    if spec.frame == "loss":
        case = Case(model, (x, y), None, own_loss)
    elif y.dim() == 2 and spec.frame in ("tokens", "ids"):
        case = Case(model, (x,), y, token_cross_entropy)
    else:
        case = Case(model, (x,), y, cross_entropy)
    if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
        model.eval()  # a dry forward sizes the parameters; no statistics move
        with torch.no_grad():
            model(*case.inputs)
        model.train()
    case.batch_dependent = any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
    )
    return case


# ---------------------------------------------------------------- parametrizations


class _Parametrized(nn.Module):
    """A linear layer whose weight is a parametrization's output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        P = nn.utils.parametrizations
        lin = nn.Linear(D, D)
        if kind == "weight_norm":
            self.lin = P.weight_norm(lin)
        elif kind == "spectral_norm":
            self.lin = P.spectral_norm(lin)
        elif kind == "orthogonal":
            self.lin = P.orthogonal(lin)  # reads the weight's values (registration)
        else:
            raise ValueError(kind)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


class _Recomputed(nn.Module):
    """A block that the model recomputes itself (``torch.utils.checkpoint``)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(D, 2 * D)
        self.b = nn.Linear(2 * D, D)

    def inner(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(h)))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, h, use_reentrant=self.reentrant)


EXTRAS: dict[str, Layer] = {
    "weight_norm": Layer(
        lambda: _Parametrized("weight_norm"), "tokens", family="parametrization"
    ),
    "spectral_norm": Layer(  # no micro-batches (batch dependent): more copies
        lambda: _Parametrized("spectral_norm"),
        "tokens",
        family="parametrization",
        copies=12,
    ),
    "orthogonal": Layer(
        lambda: _Parametrized("orthogonal"), "tokens", family="parametrization"
    ),
    "checkpoint_reentrant": Layer(
        lambda: _Recomputed(True), "tokens", family="checkpoint"
    ),
    "checkpoint_nonreentrant": Layer(
        lambda: _Recomputed(False), "tokens", family="checkpoint"
    ),
}
"""Weight parametrizations and blocks the model recomputes itself, by case name."""
