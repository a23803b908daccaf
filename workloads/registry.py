"""Workloads by name: a model factory, its loss, its data and its default batch shape.

Built-in names are listed in ``BUILTIN_WORKLOADS``; anything else must be a
``module:function`` returning ``(model, (inputs, targets), loss_fn)``, trained on
``loss_fn(model(inputs), targets)``. The module is imported with the caller's
``sys.path`` (its current directory and ``PYTHONPATH``); ``child_env`` passes that path
on to child processes.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workloads import data as data_mod
from workloads import models
from workloads.errors import WorkloadError
from workloads.splits import split_indices

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SYNTHETIC_ITEMS = 256  # random-token sequences for the GPT-2 shaped workloads
EVAL_MAX_ITEMS = 256  # central evaluation of language models: first 256 test windows


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


@dataclass(frozen=True)
class Workload:
    """A trainable job: model factory, loss, data and default batch shape.

    Attributes:
        name: the built-in name or the ``module:function`` spec.
        kind: ``image``, ``lm`` (next-token) or ``custom``.
        batch_size: examples per step, the federated client's local batch.
        seq_len: tokens per example (``lm`` only).
    """

    name: str
    kind: str
    batch_size: int
    seq_len: int | None
    factory: Callable[[], nn.Module] = field(repr=False)
    loss_fn: LossFn = field(repr=False)
    dataset: str = "none"  # digits | corpus | synthetic | example
    custom_batch: Batch | None = field(default=None, repr=False)
    scale: float = 1.0  # width (and depth) factor of a shrunk built-in: NAME@SCALE

    @property
    def metric_name(self) -> str:
        """``accuracy`` for classifiers, ``perplexity`` for language models."""
        return "perplexity" if self.kind == "lm" else "accuracy"

    def with_shape(
        self, batch_size: int | None = None, seq_len: int | None = None
    ) -> Workload:
        """A copy with another batch size or sequence length (validated)."""
        b = self.batch_size if batch_size is None else batch_size
        t = self.seq_len if seq_len is None else seq_len
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise WorkloadError(f"batch size must be a positive integer, got {b!r}")
        if self.kind != "lm":
            if seq_len is not None:
                raise WorkloadError(
                    f"--seq applies to language models only; {self.name} has no sequence"
                )
            if self.kind == "custom" and batch_size is not None:
                raise WorkloadError(
                    f"{self.name} is a custom workload whose batch is fixed by its "
                    "function; drop --batch"
                )
        else:
            assert t is not None
            ctx = self.make_config().context
            limit = (
                min(ctx, data_mod.CHUNK_BYTES - 1) if self.dataset == "corpus" else ctx
            )
            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= limit:
                raise WorkloadError(
                    f"sequence length must be an integer in 1..{limit} for {self.name}, "
                    f"got {t!r}"
                )
        return replace(self, batch_size=b, seq_len=t)

    @property
    def base_name(self) -> str:
        """The built-in name without its ``@SCALE`` suffix."""
        return self.name.split("@", 1)[0]

    def make_config(self) -> models.GPTConfig:
        return scaled_gpt_config(models.GPT_PRESETS[self.base_name], self.scale)

    def scaled(self, scale: float) -> Workload:
        """The same job on a model shrunk by ``scale`` (``NAME@SCALE``; see
        ``get_workload``): same data, loss and batch shape."""
        return get_workload(f"{self.base_name}@{_scale_str(scale)}").with_shape(
            self.batch_size, self.seq_len if self.kind == "lm" else None
        )

    def make_model(self, seed: int = 0) -> nn.Module:
        """The model, initialised from ``seed`` (same seed, same weights, bit for bit)."""
        torch.manual_seed(seed)
        return self.factory()

    # ---------------------------------------------------------------- data
    def items(self, train: bool = True) -> data_mod.Items:
        """All training (or held-out test) items of this workload's dataset."""
        if self.dataset == "digits":
            return data_mod.digits()[0 if train else 1]
        if self.dataset == "corpus":
            return data_mod.corpus()[0 if train else 1]
        if self.dataset == "synthetic":
            assert self.seq_len is not None
            vocab = self.make_config().vocab_size
            g = torch.Generator().manual_seed(1 if train else 2)
            toks = torch.randint(
                vocab, (_SYNTHETIC_ITEMS, self.seq_len + 1), generator=g
            )
            groups = np.arange(_SYNTHETIC_ITEMS, dtype=np.int64) % 16
            return data_mod.Items(toks, None, groups, tuple(str(i) for i in range(16)))
        assert self.custom_batch is not None
        x, y = self.custom_batch
        return data_mod.Items(
            x[None], y[None], np.zeros(1, dtype=np.int64), ("example",)
        )

    def client_items(
        self,
        partition_id: int,
        num_partitions: int,
        split: str = "iid",
        *,
        seed: int = 0,
        alpha: float = 0.5,
        classes: Sequence[int] | None = None,
    ) -> data_mod.Items:
        """The training items of one client of ``num_partitions`` (``classes``: the
        device class of each partition, for a natural split that follows them)."""
        if not 0 <= partition_id < num_partitions:
            raise WorkloadError(
                f"partition id {partition_id} is outside 0..{num_partitions - 1}"
            )
        items = self.items(train=True)
        if self.dataset == "example":
            return items  # a custom workload trains its example batch everywhere
        parts = split_indices(
            items.groups, num_partitions, split, seed=seed, alpha=alpha, classes=classes
        )
        return items.subset(parts[partition_id])

    def batches(self, items: data_mod.Items, seed: int) -> Iterator[Batch]:
        """An endless, seeded stream of training batches drawn from ``items``."""
        g = torch.Generator().manual_seed(seed)
        if self.dataset == "example":
            assert items.targets is not None
            while True:
                yield items.inputs[0], items.targets[0]
        if self.kind == "lm":
            assert self.seq_len is not None
            span = self.seq_len + 1
            width = items.inputs.shape[1]
            while True:
                rows = torch.randint(len(items), (self.batch_size,), generator=g)
                offs = torch.randint(width - span + 1, (self.batch_size,), generator=g)
                w = torch.stack(
                    [items.inputs[r, o : o + span] for r, o in zip(rows, offs)]
                )
                w = w.long()
                yield w[:, :-1].contiguous(), w[:, 1:].contiguous()
        assert items.targets is not None
        while True:
            perm = torch.randperm(len(items), generator=g)
            for s in range(0, len(perm) - self.batch_size + 1, self.batch_size):
                idx = perm[s : s + self.batch_size]
                yield items.inputs[idx], items.targets[idx]
            if len(perm) < self.batch_size:  # tiny client: one short batch per epoch
                yield items.inputs[perm], items.targets[perm]

    def example_batch(self, seed: int = 0) -> Batch:
        """One training batch of the default shape (the custom workload's own batch)."""
        if self.custom_batch is not None:
            return self.custom_batch
        return next(self.batches(self.items(train=True), seed))

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, items: data_mod.Items | None = None
    ) -> dict[str, float]:
        """Loss and accuracy (and perplexity for language models) on held-out items."""
        items = self.items(train=False) if items is None else items
        was_training = model.training
        model.eval()
        total_loss = 0.0
        correct = 0
        count = 0
        try:
            for x, y in self._eval_batches(items):
                out = model(x)
                batch_loss = self.loss_fn(out, y)
                n = int(y.numel()) if self.kind == "lm" else int(y.shape[0])
                total_loss += float(batch_loss) * n
                if self.kind != "custom" or out.shape[:-1] == y.shape:
                    correct += int((out.argmax(-1) == y).sum())
                count += n
        finally:
            model.train(was_training)
        loss = total_loss / max(count, 1)
        metrics: dict[str, float] = {"loss": loss, "accuracy": correct / max(count, 1)}
        if self.kind == "lm":
            metrics["perplexity"] = math.exp(min(loss, 50.0))
        return metrics

    def eval_arrays(
        self, items: data_mod.Items | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """What ``evaluate`` runs on, as numpy arrays ``(inputs, targets)``.

        Images: ``(N, ...)`` float32 and their classes; language models: the first
        ``EVAL_MAX_ITEMS`` windows of ``seq_len`` token ids (int64) and the next tokens.
        For runtimes without torch (``onnxrun``).
        """
        items = self.items(train=False) if items is None else items
        batches = list(self._eval_batches(items))
        x = torch.cat([b[0] for b in batches]) if batches else items.inputs[:0]
        y = torch.cat([b[1] for b in batches]) if batches else torch.zeros(0)
        if self.kind == "lm":
            x, y = x.long(), y.long()
        return x.numpy().copy(), y.numpy().copy()

    def _eval_batches(self, items: data_mod.Items, size: int = 64) -> Iterator[Batch]:
        if self.dataset == "example":
            assert items.targets is not None
            yield items.inputs[0], items.targets[0]
            return
        if self.kind == "lm":
            assert self.seq_len is not None
            w = items.inputs[:EVAL_MAX_ITEMS, : self.seq_len + 1].long()
            for s in range(0, len(w), size):
                yield w[s : s + size, :-1], w[s : s + size, 1:]
            return
        assert items.targets is not None
        for s in range(0, len(items), 256):
            yield items.inputs[s : s + 256], items.targets[s : s + 256]


def _gpt_factory(name: str) -> Callable[[], nn.Module]:
    return lambda: models.GPT(models.GPT_PRESETS[name])


def scaled_gpt_config(cfg: models.GPTConfig, scale: float) -> models.GPTConfig:
    """``cfg`` shrunk by ``scale``: width and depth times ``scale`` (at least one layer;
    the width a multiple of the heads, at least 8 per head), vocabulary and context kept."""
    if scale == 1.0:
        return cfg
    heads = cfg.num_heads
    width = max(8 * heads, round(cfg.d_model * scale / heads) * heads)
    if width < 8 * heads * 2 and heads > 1:  # very small: fewer heads, 16 wide each
        heads = max(1, round(cfg.d_model * scale / 16))
        width = 16 * heads
    return replace(
        cfg,
        d_model=width,
        num_heads=heads,
        num_layers=max(1, round(cfg.num_layers * scale)),
    )


def _scaled_factory(base: Workload, scale: float) -> Callable[[], nn.Module]:
    """The model factory of ``base`` shrunk by ``scale``."""
    name = base.name
    if name in models.GPT_PRESETS:
        cfg = scaled_gpt_config(models.GPT_PRESETS[name], scale)
        return lambda: models.GPT(cfg)

    def width(n: int) -> int:
        return max(2, round(n * scale))

    if name in ("digits-cnn", "digits-cnn-bn"):
        bn = name == "digits-cnn-bn"
        return lambda: models.DigitsCNN(
            channels=(width(16), width(32)), hidden=width(64), batch_norm=bn
        )
    if name == "digits-mlp":
        return lambda: models.MLP(hidden=(width(128), width(128)))
    raise WorkloadError(f"{name} has no shrunk variants")  # pragma: no cover


def _scale_str(scale: float) -> str:
    return f"{scale:g}"


def _parse_scaled(name: str) -> Workload:
    base_name, _, text = name.partition("@")
    if base_name not in BUILTIN_WORKLOADS:
        raise WorkloadError(
            f"unknown workload {name!r}: NAME@SCALE shrinks a built-in, choose NAME "
            f"from {', '.join(BUILTIN_WORKLOADS)}"
        )
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not 0 < scale <= 1 or _scale_str(scale) != text:
        raise WorkloadError(
            f"workload {name!r}: the scale after '@' must be a number in (0, 1] written "
            "without padding, e.g. gpt-byte@0.5"
        )
    base = BUILTIN_WORKLOADS[base_name]
    if scale == 1.0:
        return base
    return replace(base, name=name, factory=_scaled_factory(base, scale), scale=scale)


BUILTIN_WORKLOADS: dict[str, Workload] = {
    "digits-cnn": Workload(
        "digits-cnn", "image", 32, None, models.DigitsCNN, _cross_entropy, "digits"
    ),
    "digits-cnn-bn": Workload(
        "digits-cnn-bn",
        "image",
        32,
        None,
        lambda: models.DigitsCNN(batch_norm=True),
        _cross_entropy,
        "digits",
    ),
    "digits-mlp": Workload(
        "digits-mlp", "image", 32, None, models.MLP, _cross_entropy, "digits"
    ),
    "gpt-tiny": Workload(
        "gpt-tiny", "lm", 4, 32, _gpt_factory("gpt-tiny"), models.lm_loss, "corpus"
    ),
    "gpt-byte": Workload(
        "gpt-byte", "lm", 8, 128, _gpt_factory("gpt-byte"), models.lm_loss, "corpus"
    ),
    "gpt2-small": Workload(
        "gpt2-small",
        "lm",
        4,
        512,
        _gpt_factory("gpt2-small"),
        models.lm_loss,
        "synthetic",
    ),
    "gpt2-medium": Workload(
        "gpt2-medium",
        "lm",
        4,
        512,
        _gpt_factory("gpt2-medium"),
        models.lm_loss,
        "synthetic",
    ),
}


def get_workload(
    name: str, *, batch_size: int | None = None, seq_len: int | None = None
) -> Workload:
    """A built-in workload by name, or a user's ``module:function``.

    ``NAME@SCALE`` is the built-in ``NAME`` on a model shrunk by ``SCALE`` in (0, 1]
    (width times ``SCALE``; for GPTs also depth, at least one layer): the same data,
    loss and batch shape (the ``smallest-model`` strategy of fleet simulations).

    Raises:
        WorkloadError: unknown name, malformed spec, a module or function that cannot be
            loaded, or a function that does not return ``(model, (inputs, targets),
            loss_fn)``.
    """
    if not isinstance(name, str) or not name:
        raise WorkloadError(f"workload must be a name or module:function, got {name!r}")
    if name in BUILTIN_WORKLOADS:
        wl = BUILTIN_WORKLOADS[name]
    elif "@" in name and ":" not in name:
        wl = _parse_scaled(name)
    elif ":" in name:
        wl = _load_custom(name)
    else:
        raise WorkloadError(
            f"unknown workload {name!r}: choose one of {', '.join(BUILTIN_WORKLOADS)} "
            "(NAME@SCALE for a shrunk one, e.g. gpt-byte@0.5) or give your own as "
            "module:function"
        )
    if batch_size is None and seq_len is None:
        return wl
    return wl.with_shape(batch_size, seq_len)


def _load_custom(spec: str) -> Workload:
    if not _SPEC.match(spec):
        raise WorkloadError(
            f"malformed workload {spec!r}: expected module:function, e.g. mypkg.jobs:build"
        )
    module_name, func_name = spec.split(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise WorkloadError(
            f"cannot import module {module_name!r} of workload {spec!r}: {e}. Run from "
            "the directory that holds it or add that directory to PYTHONPATH"
        ) from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise WorkloadError(f"module {module_name!r} has no function {func_name!r}")

    def build() -> tuple[nn.Module, Batch, LossFn]:
        result = func()
        ok = (
            isinstance(result, tuple)
            and len(result) == 3
            and isinstance(result[0], nn.Module)
            and isinstance(result[1], tuple | list)
            and len(result[1]) == 2
            and all(isinstance(t, torch.Tensor) for t in result[1])
            and callable(result[2])
        )
        if not ok:
            raise WorkloadError(
                f"{spec} must return (model, (inputs, targets), loss_fn) with an "
                f"nn.Module and two tensors; got {type(result).__name__}"
            )
        return result[0], (result[1][0], result[1][1]), result[2]

    torch.manual_seed(0)
    _, batch, loss_fn = build()
    return Workload(
        spec,
        "custom",
        int(batch[0].shape[0]) if batch[0].dim() else 1,
        None,
        lambda: build()[0],
        loss_fn,
        "example",
        batch,
    )


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process that imports modules as this process does.

    Prepends this process's working directory and ``sys.path`` entries to
    ``PYTHONPATH`` so that a ``module:function`` workload loads in the child too.
    """
    env = dict(os.environ if env is None else env)
    paths = [os.getcwd()] + [p for p in sys.path if p]
    old = env.get("PYTHONPATH")
    if old:
        paths.append(old)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
