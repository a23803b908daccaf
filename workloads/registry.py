"""Workloads by name: a model factory, its loss, its data and its default batch shape.

Built-in names are listed in ``BUILTIN_WORKLOADS``; anything else must be a
``module:function`` returning ``(model, (inputs, targets), loss_fn)``, trained on
``loss_fn(model(inputs), targets)``. The module is imported with the caller's
``sys.path`` (its current directory and ``PYTHONPATH``); ``child_env`` passes that path
on to child processes.

The models users have (transformers, keyword arguments, dict inputs) fit too:
``inputs`` may be a tensor, a tuple or list (``model(*inputs)``) or a dict of tensors
(``model(**inputs)``), ``targets`` a tensor or None, and ``loss_fn`` a callable or None
(the model's own ``output.loss``, as transformers computes it from ``labels``). Such a
workload is marked ``Workload.any_model``: ``fleetfit memory`` plans it per unit
(``memory.units``) and the federation trains it so; partition pipelines take it
when it is a transformers GPT-2 or Llama (``partition.model_stages``); ONNX
evaluation on arrays refuses it (``Workload.require_tensors``).

A custom workload's module may define ``load_data(partition_id, num_partitions)``,
each node's own ``(train_batches, eval_batches)`` (``workloads.node_data``); without
it every node trains the example batch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from workloads import data as data_mod
from workloads import models, node_data, width
from workloads.errors import WorkloadError
from workloads.splits import private_indices, public_indices, split_indices

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SYNTHETIC_ITEMS = 256  # random-token sequences for the GPT-2 shaped workloads
EVAL_MAX_ITEMS = 256  # central evaluation of language models: first 256 test windows


def _cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


TENSOR_PATHS = "partition pipelines and ONNX evaluation on arrays"


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
    any_model: bool = False
    """A ``module:function`` workload beyond ``(model, (tensor, tensor), loss_fn)``:
    tuple, list or dict inputs, no targets, or the model's own loss: planned and
    trained per unit (``memory.units``); ``require_tensors`` refuses it elsewhere."""
    eval_windows: int = EVAL_MAX_ITEMS
    """Language models: how many held-out windows ``evaluate`` runs on (the first
    ones); ``with_eval_windows`` sets it."""
    data_fn: Callable[[int, int], Any] | None = field(default=None, repr=False)
    """A custom workload's ``load_data(partition_id, num_partitions)`` (None: every
    node trains the example batch)."""
    example: tuple[Any, Any, Callable | None] | None = field(default=None, repr=False)
    """A custom workload's ``(inputs, targets, loss_fn)`` as its function returned
    them (``loss_fn`` None: the model's own loss)."""

    def require_tensors(self, what: str = TENSOR_PATHS) -> None:
        """Refuse an ``any_model`` workload where ``what`` needs tensor batches.

        Raises:
            WorkloadError: one line naming the workload, why, and what takes it.
        """
        if not self.any_model:
            return
        why = ", ".join(_beyond(*self.example)) if self.example else "its batch"
        raise WorkloadError(
            f"workload {self.name} ({why}) trains with `fleetfit memory` and in "
            f"federations; {what} take only (model, (inputs_tensor, targets_tensor), "
            "loss_fn) workloads"
        )

    @property
    def metric_name(self) -> str:
        """``accuracy`` for classifiers, ``perplexity`` for language models (an
        ``any_model`` workload whose labels are per token)."""
        if self.any_model and self.example is not None:
            pair = (self.example[0], self.example[1])
            return "perplexity" if node_data.is_token_level(pair) else "accuracy"
        return "perplexity" if self.kind == "lm" else "accuracy"

    @property
    def own_data(self) -> bool:
        """Trained on batches the workload gives (``load_data`` or an ``any_model``
        example batch), not on items of a built-in dataset."""
        return self.data_fn is not None or self.any_model

    def node_data(self, partition_id: int, num_partitions: int) -> node_data.NodeData:
        """One node's batches from ``load_data`` (loaded once per process).

        Raises:
            WorkloadError: a partition id outside ``0..num_partitions - 1``, no
                ``load_data``, or a ``load_data`` that fails or returns something else
                than ``(train_batches, eval_batches)``.
        """
        if not 0 <= partition_id < num_partitions:
            raise WorkloadError(
                f"partition id {partition_id} is outside 0..{num_partitions - 1}"
            )
        if self.data_fn is None:
            raise WorkloadError(f"workload {self.name} has no {node_data.LOAD_DATA}")
        return _node_data(self.name, self.data_fn, partition_id, num_partitions)

    def node_batches(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        server_round: int,
        local_steps: int,
    ) -> tuple[list[Any], int]:
        """A round's batches for one node and its number of training examples:
        ``load_data``'s train batches from ``(server_round - 1) * local_steps`` on, or
        the example batch at every step without ``load_data``.

        Raises:
            WorkloadError: as ``node_data``, or a batch larger than the example batch.
        """
        assert self.example is not None
        example = (self.example[0], self.example[1])
        if self.data_fn is None:
            return [example] * local_steps, node_data.batch_size_of(example[0])
        nd = self.node_data(partition_id, num_partitions)
        batches = nd.train_batches((server_round - 1) * local_steps, local_steps)
        for b in batches:
            node_data.check_fits(b, example, nd.where)
        return batches, nd.num_examples

    def eval_batches(self, partition_id: int = 0, num_partitions: int = 1) -> list[Any]:
        """Held-out batches of a workload with its own data: ``load_data``'s eval
        batches of the node (central evaluation: partition 0 of 1, all of them), or
        the example batch without ``load_data``."""
        assert self.example is not None
        if self.data_fn is None:
            return [(self.example[0], self.example[1])]
        return self.node_data(partition_id, num_partitions).eval_batches()

    def with_eval_windows(self, windows: int) -> Workload:
        """A copy whose language-model evaluation runs on the first ``windows``
        held-out windows (validated; other kinds evaluate on all their items)."""
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise WorkloadError(
                f"eval windows must be a positive integer, got {windows!r}"
            )
        return replace(self, eval_windows=windows)

    def with_shape(
        self, batch_size: int | None = None, seq_len: int | None = None
    ) -> Workload:
        """A copy with another batch size or sequence length (validated)."""
        b = self.batch_size if batch_size is None else batch_size
        t = self.seq_len if seq_len is None else seq_len
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise WorkloadError(f"batch size must be a positive integer, got {b!r}")
        if self.kind == "custom" and (batch_size is not None or seq_len is not None):
            raise WorkloadError(
                f"{self.name} is a custom workload whose batch is fixed by its "
                "function (it cannot be reshaped); drop --batch/--seq and change the "
                "batch in the function"
            )
        if self.kind != "lm":
            if seq_len is not None:
                raise WorkloadError(
                    f"--seq applies to language models only; {self.name} has no sequence"
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
        self.require_tensors()
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
        public_share: float = 0.0,
    ) -> data_mod.Items:
        """The training items of one client of ``num_partitions`` (``classes``: the
        device class of each partition, for a natural split that follows them;
        ``public_share``: the share of every group held out from every client,
        ``public_items``)."""
        if not 0 <= partition_id < num_partitions:
            raise WorkloadError(
                f"partition id {partition_id} is outside 0..{num_partitions - 1}"
            )
        items = self.items(train=True)
        if self.dataset == "example":
            return items  # a custom workload trains its example batch everywhere
        items = self.private_items(public_share)
        parts = split_indices(
            items.groups, num_partitions, split, seed=seed, alpha=alpha, classes=classes
        )
        return items.subset(parts[partition_id])

    def public_items(self, share: float) -> data_mod.Items:
        """The training items held out from every client (``share`` of every group,
        ``workloads.splits.public_indices``): data a server may pretrain on."""
        items = self.items(train=True)
        return items.subset(public_indices(items.groups, share))

    def private_items(self, share: float = 0.0) -> data_mod.Items:
        """The training items the clients split among themselves: all but
        ``public_items(share)``."""
        items = self.items(train=True)
        if not share:
            return items
        return items.subset(private_indices(items.groups, share))

    def batches(self, items: data_mod.Items, seed: int) -> Iterator[Batch]:
        """An endless, seeded stream of training batches drawn from ``items``."""
        self.require_tensors()  # here, not at the first batch
        return self._batches(items, seed)

    def _batches(self, items: data_mod.Items, seed: int) -> Iterator[Batch]:
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
        self.require_tensors()
        if self.custom_batch is not None:
            return self.custom_batch
        return next(self.batches(self.items(train=True), seed))

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, items: data_mod.Items | None = None
    ) -> dict[str, float]:
        """Loss and accuracy (and perplexity for language models) on held-out items
        (a workload with its own data: on ``eval_batches()``)."""
        if self.own_data and items is None:
            return node_data.evaluate_batches(model, self.eval_batches(), self.loss_fn)
        self.require_tensors()
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
        ``eval_windows`` windows of ``seq_len`` token ids (int64) and the next tokens.
        For runtimes without torch (``onnxrun``).
        """
        self.require_tensors()
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
            w = items.inputs[: self.eval_windows, : self.seq_len + 1].long()
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
    if text.startswith("w"):  # width only: a HeteroFL/FedRolex sub-model
        return _parse_width(name, base_name, text[1:])
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


def _parse_width(name: str, base_name: str, text: str) -> Workload:
    """``NAME@wR``: built-in ``NAME`` at width ratio ``R`` (``workloads.width``)."""
    try:
        ratio = float(text)
    except ValueError:
        ratio = math.nan
    if not 0 < ratio <= 1 or _scale_str(ratio) != text:
        raise WorkloadError(
            f"workload {name!r}: the width ratio after '@w' must be a number in (0, 1] "
            "written without padding, e.g. gpt-byte@w0.25"
        )
    try:
        factory = width.width_factory(base_name, ratio)
    except ValueError as e:
        raise WorkloadError(f"workload {name!r}: {e}") from None
    return replace(BUILTIN_WORKLOADS[base_name], name=name, factory=factory)


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
    name: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    eval_windows: int | None = None,
) -> Workload:
    """A built-in workload by name, or a user's ``module:function``.

    ``NAME@SCALE`` is the built-in ``NAME`` on a model shrunk by ``SCALE`` in (0, 1]
    (width times ``SCALE``; for GPTs also depth, at least one layer): the same data,
    loss and batch shape (the ``smallest-model`` strategy of fleet simulations).
    ``NAME@wR`` is its width-scaled sub-model at ratio ``R`` (depth, inputs and
    outputs kept; ``workloads.width``: the ``heterofl`` and ``fedrolex`` strategies).
    ``eval_windows``: a language model's central evaluation runs on that many held-out
    windows (default ``EVAL_MAX_ITEMS``).

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
    if eval_windows is not None:
        wl = wl.with_eval_windows(eval_windows)
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
    if _standard_library(module_name):  # refused before it is imported
        raise _not_a_workload(spec, f"{module_name} is Python's standard library")
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
    _check_function(spec, func)

    def build() -> tuple[nn.Module, Any, Any, Callable | None]:
        return _check_result(spec, func())

    torch.manual_seed(0)
    _, inputs, targets, loss_fn = build()
    beyond = _beyond(inputs, targets, loss_fn)
    return Workload(
        spec,
        "custom",
        node_data.batch_size_of(inputs),
        None,
        lambda: build()[0],
        _own_loss if loss_fn is None else loss_fn,
        "example",
        None if beyond else (inputs, targets),
        any_model=bool(beyond),
        example=(inputs, targets, loss_fn),
        data_fn=_data_fn(module, spec),
    )


def _standard_library(module_name: str) -> bool:
    """Whether ``module_name`` is a module of Python itself (built in, frozen, or a
    file of the standard library), found without importing it; a user's module that
    shares a standard name (``code.py`` in the working directory) is not."""
    top = module_name.split(".")[0]
    if top in sys.builtin_module_names:
        return True
    if top not in sys.stdlib_module_names:
        return False
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    origin = found.origin if found is not None else None
    if origin is None or origin in ("built-in", "frozen"):
        return found is not None
    where = Path(origin).resolve()
    if {"site-packages", "dist-packages"} & set(where.parts):
        return False  # an installed distribution (inside the stdlib folder on some)
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    return any(where.is_relative_to(Path(r).resolve()) for r in roots)


def _not_a_workload(spec: str, why: str) -> WorkloadError:
    return WorkloadError(
        f"workload {spec!r} is not a workload function ({why}); give a function of "
        "your own module that takes no arguments and returns (model, (inputs, "
        "targets), loss_fn), e.g. mypkg.jobs:build"
    )


def _check_function(spec: str, func: Callable[..., Any]) -> None:
    """Refuse, before it is called, what cannot be a workload function: a built-in, a
    function of Python's standard library (``mymod:system`` where ``mymod`` imported
    ``os.system``), or one that needs arguments (a workload function is called with
    none).

    Raises:
        WorkloadError: one line naming ``spec``, why and the fix.
    """
    target = func.func if isinstance(func, functools.partial) else func
    if inspect.isbuiltin(target):
        raise _not_a_workload(spec, "a built-in function")
    home = getattr(target, "__module__", None)
    if isinstance(home, str) and home != "__main__" and _standard_library(home):
        raise _not_a_workload(spec, f"{home} is Python's standard library")
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        raise _not_a_workload(spec, "it has no Python signature") from None
    try:
        signature.bind()
    except TypeError:
        raise _not_a_workload(spec, f"it takes arguments {signature}") from None


def _data_fn(module: Any, spec: str) -> Callable[[int, int], Any] | None:
    fn = getattr(module, node_data.LOAD_DATA, None)
    if fn is not None and not callable(fn):
        raise WorkloadError(
            f"{spec.split(':')[0]}.{node_data.LOAD_DATA} is a {type(fn).__name__}, "
            "not a function (partition_id, num_partitions) -> (train, eval)"
        )
    return fn


@functools.lru_cache(maxsize=8)
def _node_data(
    spec: str, fn: Callable, partition_id: int, num_partitions: int
) -> node_data.NodeData:
    return node_data.NodeData(spec, fn, partition_id, num_partitions)


def _beyond(inputs: Any, targets: Any, loss_fn: Callable | None) -> list[str]:
    """What takes a custom workload beyond ``(model, (tensor, tensor), loss_fn)``."""
    out = []
    if not isinstance(inputs, torch.Tensor):
        out.append(f"{type(inputs).__name__} inputs")
    if targets is None:
        out.append("no targets")
    if loss_fn is None:
        out.append("the model's own loss")
    return out


def _own_loss(output: Any, targets: Any) -> torch.Tensor:
    """The loss of a workload whose ``loss_fn`` is None: the model's ``output.loss``."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise WorkloadError(
            f"the model's output ({type(output).__name__}) has no loss; give the "
            "inputs labels or return a loss_fn(output, targets)"
        )
    return loss


_CONTRACT = (
    "(model, (inputs, targets), loss_fn): an nn.Module; inputs a tensor, a tuple/list "
    "or a dict of tensors with the batch first; targets a tensor or None; loss_fn a "
    "callable or None (the model's own output.loss)"
)


def _check_result(
    spec: str, result: Any
) -> tuple[nn.Module, Any, Any, Callable | None]:
    """``(model, inputs, targets, loss_fn)`` of what ``spec``'s function returned.

    Raises:
        WorkloadError: one line naming the spec, what is wrong and the contract.
    """

    def fail(what: str) -> WorkloadError:
        return WorkloadError(f"{spec} must return {_CONTRACT}; {what}")

    if not isinstance(result, tuple | list) or len(result) != 3:
        n = f" of {len(result)}" if isinstance(result, tuple | list) else ""
        raise fail(f"got {type(result).__name__}{n}")
    model, batch, loss_fn = result
    if not isinstance(model, nn.Module):
        raise fail(f"the model is {type(model).__name__}, not an nn.Module")
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        n = f" of {len(batch)}" if isinstance(batch, tuple | list) else ""
        raise fail(f"the batch is {type(batch).__name__}{n}, not (inputs, targets)")
    inputs, targets = batch
    if isinstance(inputs, dict) and not all(isinstance(k, str) for k in inputs):
        raise fail("the inputs dict has keys that are not strings (argument names)")
    if not isinstance(inputs, torch.Tensor | tuple | list | dict):
        raise fail(f"the inputs are {type(inputs).__name__}")
    if not isinstance(inputs, torch.Tensor) and not any(
        t.dim() for t in node_data.tensors_of(inputs)
    ):
        raise fail("the inputs hold no tensor with a batch dimension")
    if targets is not None and not isinstance(targets, torch.Tensor):
        raise fail(f"the targets are {type(targets).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise fail(f"loss_fn is {type(loss_fn).__name__}, not callable")
    return model, inputs, targets, loss_fn


def refuse_any_model(name: object, what: str) -> None:
    """Refuse, before anything starts, a ``module:function`` workload that only
    ``fleetfit memory`` takes (``Workload.any_model``), for ``what``.

    A name that does not load here is left to the caller's own loading, which reports
    it as it always has.

    Raises:
        WorkloadError: the workload is ``any_model`` (one line).
    """
    if not isinstance(name, str) or ":" not in name:
        return  # built-ins (and shrunk ones) take tensors
    try:
        wl = get_workload(name)
    except WorkloadError:
        return
    wl.require_tensors(what)


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
