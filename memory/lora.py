"""LoRA adapters on a frozen base: which modules carry them, adding them (peft), and
their factors as plain tensors.

An adapter assignment trains, for every target module ``m`` (a ``nn.Linear``, or a
transformers ``Conv1D`` as in GPT-2) in the blocks ``[start, last)``, two factors
``A`` (rank x in) and ``B`` (out x rank); the module computes
``base(x) + scaling * B @ A @ x`` with ``scaling = alpha / rank``. Everything else
is frozen: no gradient, no optimizer state. Blocks before ``start`` run under
``no_grad`` (no activation stored); the blocks from ``start`` up, the head included,
run forward and backward (the loss's gradient must reach the lowest adapter).

The factors travel as ``"<module path>.lora_A"`` and ``"<module path>.lora_B"``
(``factor_keys``), independent of peft's parameter names.

Example:
    >>> spec = LoraSpec(rank=8, alpha=16.0, targets=("qkv", "proj"), start=1)
    >>> paths = add_adapters(model, spec, as_blocks(model))  # doctest: +SKIP
    >>> factors = adapter_state(model, paths)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memory.blocks import Block
from memory.errors import MissingExtraError

log = logging.getLogger(__name__)

BASE_DTYPES = ("float32", "bfloat16", "int8")
"""Storage of the frozen base: ``int8`` holds each untied linear weight as int8 with a
float32 scale per output row (``Int8Linear``); every other tensor stays float32."""


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter assignment trains.

    Attributes:
        rank: the factors' inner dimension ``r`` (>= 1).
        alpha: LoRA's ``alpha``; the update is scaled by ``alpha / rank``.
        targets: leaf names of the modules that carry adapters (``qkv``, ``c_attn``,
            ``q_proj``); empty: every linear module of the adapted blocks.
        start: index of the first block (or unit) carrying adapters; adapters sit in
            blocks ``[start, last)`` (never in the head).
        base_dtype: storage of the frozen base's floating parameters: ``float32``;
            ``bfloat16`` (half the bytes; the forward computes in bfloat16 under
            autocast); or ``int8`` (each untied linear weight in int8 with a float32
            scale per output row, ``Int8Linear``: about a quarter of its bytes; the
            arithmetic stays float32, the weight dequantized one layer at a time).
            The adapters' own parameters and optimizer stay float32.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = ()
    start: int = 0
    base_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank {self.rank}: must be >= 1")
        if not self.alpha > 0:
            raise ValueError(f"lora alpha {self.alpha}: must be > 0")
        if self.start < 0:
            raise ValueError(f"adapter start block {self.start}: must be >= 0")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"base dtype {self.base_dtype!r}: one of {', '.join(BASE_DTYPES)}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _is_linear(module: nn.Module) -> bool:
    # transformers' Conv1D (GPT-2) is a linear layer with a transposed weight
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def fan_in_fan_out(module: nn.Module) -> bool:
    """The module stores its weight as (in, out) (transformers' ``Conv1D``)."""
    return type(module).__name__ == "Conv1D"


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear module."""
    w = module.weight
    assert isinstance(w, torch.Tensor)
    a, b = int(w.shape[0]), int(w.shape[1])
    return (a, b) if fan_in_fan_out(module) else (b, a)


def target_paths(
    model: nn.Module, blocks: Sequence[Block], spec: LoraSpec
) -> list[list[str]]:
    """Per block, the paths of the modules that carry adapters (empty lists for the
    blocks before ``spec.start`` and for the head).

    Raises:
        ValueError: ``spec.start`` is not a block before the head, or no target
            module is found in blocks ``[start, last)``.
    """
    last = len(blocks) - 1
    if not 0 <= spec.start < last:
        raise ValueError(
            f"adapter start block {spec.start} is outside the model's {last} blocks "
            "before the head"
        )
    names = {id(m): n for n, m in model.named_modules()}
    out: list[list[str]] = []
    for i, b in enumerate(blocks):
        paths: list[str] = []
        if spec.start <= i < last:
            for sub, m in b.module.named_modules():
                leaf = sub.rsplit(".", 1)[-1]
                if sub and _is_linear(m) and (not spec.targets or leaf in spec.targets):
                    paths.append(names[id(m)])
        out.append(paths)
    if not any(out):
        raise ValueError(
            f"no linear module named {list(spec.targets) or 'anything'} in blocks "
            f"{spec.start}..{last - 1} ({[b.name for b in blocks[spec.start : last]]})"
        )
    return out


def default_targets(model: nn.Module, blocks: Sequence[Block]) -> tuple[str, ...]:
    """Leaf names of the linear modules in the blocks before the head (attention and
    MLP projections of a transformer's layers)."""
    names: list[str] = []
    for b in blocks[:-1]:
        for sub, m in b.module.named_modules():
            leaf = sub.rsplit(".", 1)[-1]
            if sub and _is_linear(m) and leaf not in names:
                names.append(leaf)
    return tuple(names)


def factor_keys(path: str) -> tuple[str, str]:
    """The wire keys of a target module's ``A`` and ``B`` factors."""
    return f"{path}.lora_A", f"{path}.lora_B"


def factor_shapes(
    model: nn.Module, paths: Sequence[str], rank: int
) -> dict[str, tuple[int, ...]]:
    """Wire key -> shape of every factor: ``A`` (rank, in), ``B`` (out, rank)."""
    modules = dict(model.named_modules())
    shapes: dict[str, tuple[int, ...]] = {}
    for p in paths:
        n_in, n_out = linear_shape(modules[p])
        a, b = factor_keys(p)
        shapes[a] = (rank, n_in)
        shapes[b] = (n_out, rank)
    return shapes


QUANTIZE_BLOCK_BYTES = 2**20
"""``quantize`` converts a weight a block of rows of at most this many float32 bytes at
a time (its temporaries stay this small, whatever the weight's size)."""


class _Int8Matmul(torch.autograd.Function):
    """``x @ dequantize(q, scale).T`` whose backward dequantizes the weight again
    instead of keeping it: autograd saves only the int8 weight and its scales (the
    module's own buffers) and never the input (the weight takes no gradient)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, scale)
        return x @ dequantize(q, scale).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        q, scale = ctx.saved_tensors
        return grad @ dequantize(q, scale), None, None


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a ``(out, in)`` weight, one float32 scale per
    output row (``max |w| / 127``; an all-zero row gets scale 1)."""
    w = weight.detach()
    rows = max(1, QUANTIZE_BLOCK_BYTES // max(1, 4 * w.shape[1]))
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for a in range(0, w.shape[0], rows):  # a block of rows at a time: small temporaries
        blk = w[a : a + rows].to(torch.float32, copy=True)
        amax = blk.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q[a : a + rows] = blk.div_(s.unsqueeze(1)).round_().clamp_(-127, 127)
        scale[a : a + rows] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``q * scale`` (one new tensor of the weight's size)."""
    return q.to(torch.float32).mul_(scale.unsqueeze(1))


class Int8Linear(nn.Module):
    """A frozen linear layer whose weight is held in int8 (``quantize``): the
    ``(out, in)`` int8 weight and its scales are buffers, the bias a frozen float32
    parameter. ``from_linear`` converts an ``nn.Linear`` or a transformers ``Conv1D``
    (its ``(in, out)`` weight transposed once, at conversion)."""

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        )

    @classmethod
    def from_linear(cls, module: nn.Module) -> Int8Linear:
        w = module.weight
        assert isinstance(w, torch.Tensor)
        q, scale = quantize(w.t() if fan_in_fan_out(module) else w)
        return cls(q, scale, getattr(module, "bias", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Int8Matmul.apply(x, self.qweight, self.scale)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def int8_linears(model: nn.Module) -> list[str]:
    """Paths of the linear layers an ``int8`` base holds in int8: every
    ``nn.Linear`` or ``Conv1D`` whose weight no other module uses (a head tied to the
    embedding stays float32) and that is not an adapter factor."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [
        path
        for path, m in model.named_modules()
        if _is_linear(m)
        and ".lora_" not in f".{path}"
        and uses.get(id(m.weight), 0) == 1
    ]


def frozen_base_bytes(
    module: nn.Module, base_dtype: str, int8: set[int], only: set[int] | None = None
) -> tuple[int, int]:
    """What ``module``'s frozen parameters hold in ``base_dtype``, bytes, and the
    transient bytes its forward and backward add (``int8``: the largest of its int8
    layers' weights dequantized to float32, one at a time). ``int8``: the ``id`` of
    each module ``int8_linears`` names. Counts each parameter once, and with
    ``only`` just the parameters whose ``id`` it holds."""
    held, transient = 0, 0
    quantized: set[int] = set()
    for m in module.modules():
        if (
            base_dtype == "int8"
            and id(m) in int8
            and (only is None or id(m.weight) in only)
        ):
            n_in, n_out = linear_shape(m)
            held += n_in * n_out + 4 * n_out  # int8 weight, float32 scales
            transient = max(transient, 4 * n_in * n_out)
            quantized.add(id(m.weight))
    seen: set[int] = set()
    for p in module.parameters():
        if (
            id(p) in seen
            or id(p) in quantized
            or (only is not None and id(p) not in only)
        ):
            continue
        seen.add(id(p))
        per = (
            2
            if base_dtype == "bfloat16" and p.is_floating_point()
            else p.element_size()
        )
        held += p.numel() * per
    return held, transient


def adapters_available() -> bool:
    """Whether this install can add adapters: peft (the ``hf`` extra) is found.

    Looked up, not imported (importing peft imports transformers: seconds and tens
    of MB), so a node can say it in its query reply."""
    try:
        return importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError):  # a broken parent or module spec
        return False


def require_peft() -> None:
    """Raise ``MissingExtraError`` (one line naming the ``hf`` extra) where this
    install cannot add adapters."""
    if not adapters_available():
        raise MissingExtraError("adapters", "peft", "hf")


def add_adapters(
    model: nn.Module, spec: LoraSpec, blocks: Sequence[Block]
) -> list[str]:
    """Add LoRA adapters (peft's ``inject_adapter_in_model``, module names kept) to
    ``model`` in place, freeze everything else and hold the frozen base in
    ``spec.base_dtype``; return the target paths. ``A`` is drawn from torch's global
    generator (Kaiming-uniform), ``B`` is zero: the model computes what it did.

    Raises:
        MissingExtraError: peft is not installed (the ``hf`` extra).
    """
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ModuleNotFoundError as e:
        if e.name != "peft":
            raise
        raise MissingExtraError("adapters", "peft", "hf") from None
    paths = [p for ps in target_paths(model, blocks, spec) for p in ps]
    modules = dict(model.named_modules())
    transposed = {fan_in_fan_out(modules[p]) for p in paths}
    if len(transposed) > 1:
        raise ValueError(
            "targets mix nn.Linear and Conv1D modules; choose targets of one kind"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft: alpha / r, a float
        lora_dropout=0.0,
        bias="none",
        fan_in_fan_out=transposed.pop(),
        target_modules="|".join(re.escape(p) for p in paths),  # full-match regex
    )
    inject_adapter_in_model(config, model)
    if spec.base_dtype == "int8":
        for path in int8_linears(model):
            parent, _, leaf = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, leaf, Int8Linear.from_linear(model.get_submodule(path)))
    elif spec.base_dtype != "float32":
        dtype = getattr(torch, spec.base_dtype)
        for name, p in model.named_parameters():
            if "lora_" not in name and p.is_floating_point():
                p.data = p.data.to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return paths


def adapter_state(model: nn.Module, paths: Sequence[str]) -> dict[str, torch.Tensor]:
    """The factors of the adapters ``add_adapters`` added, under their wire keys."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for p in paths:
        m = modules[p]
        a, b = factor_keys(p)
        out[a] = m.lora_A["default"].weight.detach().clone()  # type: ignore[index]
        out[b] = m.lora_B["default"].weight.detach().clone()  # type: ignore[index]
    return out


def autocast_for(spec: LoraSpec | None) -> torch.autocast | None:
    """The autocast context a frozen base in ``spec.base_dtype`` computes under
    (None: float32, none needed). Its cast cache is off: one context spans many
    optimizer steps, and a cached cast of an adapter's weight would outlive its
    update."""
    if spec is None or spec.base_dtype in ("float32", "int8"):
        return None
    dtype = getattr(torch, spec.base_dtype)
    return torch.autocast("cpu", dtype=dtype, cache_enabled=False)


__all__ = [
    "BASE_DTYPES",
    "Int8Linear",
    "LoraSpec",
    "adapter_state",
    "add_adapters",
    "autocast_for",
    "default_targets",
    "dequantize",
    "factor_keys",
    "factor_shapes",
    "fan_in_fan_out",
    "frozen_base_bytes",
    "int8_linears",
    "linear_shape",
    "quantize",
    "target_paths",
]
