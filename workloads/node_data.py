"""A user workload's own data, per node: ``load_data(partition_id, num_partitions)``.

A ``module:function`` workload's module may define, beside its function, the data
loader Flower's app templates define::

    def load_data(partition_id: int, num_partitions: int):
        '''This node's (train_batches, eval_batches).'''
        return train_loader, eval_loader

Each is an iterable of batches (a ``torch.utils.data.DataLoader``, a list, anything
that can be iterated more than once). A batch is ``(inputs, targets)`` (a
``TensorDataset``'s ``[x, y]``) or a dict of tensors, ``model(**batch)``, with
``labels`` in it for a model that computes its own loss (a transformers collator's
output). ``eval_batches`` may be None: that node then has no held-out data.

``fleetfit simulate``, ``server`` and ``client`` then train each node on its own
batches: round ``r`` of ``local_steps`` steps takes batches ``(r - 1) * local_steps``
onwards of the endless repetition of ``train_batches`` (from the start of a new pass
when the iterable has a length; a ``DataLoader`` with ``shuffle=True`` reshuffles at
each pass). The server evaluates centrally on ``load_data(0, 1)``'s eval batches (the
whole held-out set, one partition); each node's federated evaluation uses its own.

Every batch must be no larger than the workload's example batch (the one its
function returns): memory plans are made for that batch. A smaller batch (a loader's
last, short batch) is trained as the plan allows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workloads.errors import WorkloadError

LOAD_DATA = "load_data"
"""The name of the per-node data function in a workload's module."""

Batch = tuple[Any, Any]


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in a batch structure (tensors, dicts, tuples, lists), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_of(v)]
    if isinstance(x, tuple | list):
        return [t for v in x for t in tensors_of(v)]
    return []


def batch_size_of(inputs: Any) -> int:
    """The first dimension of the inputs' first tensor that has one (1 if none)."""
    for t in tensors_of(inputs):
        if t.dim():
            return int(t.shape[0])
    return 1


def as_pair(batch: Any, where: str) -> Batch:
    """A loader's batch as ``(inputs, targets)``: a dict is ``(batch, None)``.

    Raises:
        WorkloadError: neither a dict nor an ``(inputs, targets)`` pair.
    """
    if isinstance(batch, dict):
        return batch, None
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    n = f" of {len(batch)}" if isinstance(batch, tuple | list) else ""
    raise WorkloadError(
        f"{where} gave a batch that is a {type(batch).__name__}{n}: a batch is "
        "(inputs, targets) or a dict of tensors (model(**batch))"
    )


class NodeData:
    """One node's batches from a workload's ``load_data``."""

    def __init__(
        self, spec: str, fn: Callable, partition_id: int, num_partitions: int
    ) -> None:
        self.where = (
            f"{spec.split(':')[0]}.{LOAD_DATA}({partition_id}, {num_partitions})"
        )
        try:
            got = fn(partition_id, num_partitions)
        except WorkloadError:
            raise
        except Exception as e:  # the user's loader: its failure, named, one line
            raise WorkloadError(f"{self.where} failed: {type(e).__name__}: {e}") from e
        if not isinstance(got, tuple | list) or len(got) != 2:
            n = f" of {len(got)}" if isinstance(got, tuple | list) else ""
            raise WorkloadError(
                f"{self.where} must return (train_batches, eval_batches), got "
                f"{type(got).__name__}{n}"
            )
        self.train, self.eval = got
        for name, it in (("train_batches", self.train), ("eval_batches", self.eval)):
            if it is None and name == "eval_batches":
                continue
            if not isinstance(it, Iterable) or isinstance(it, dict | str | bytes):
                raise WorkloadError(
                    f"{self.where}: {name} is a {type(it).__name__}, not an iterable "
                    "of batches (a DataLoader or a list)"
                )

    def _passes(self) -> Iterator[Batch]:
        """The train batches, pass after pass."""
        while True:
            empty = True
            for b in self.train:
                empty = False
                yield as_pair(b, self.where)
            if empty:
                raise WorkloadError(f"{self.where}: train_batches is empty")

    def train_batches(self, first: int, count: int) -> list[Batch]:
        """``count`` batches from batch ``first`` of the endless repetition."""
        try:
            first %= max(1, len(self.train))  # type: ignore[arg-type]
        except TypeError:
            pass  # no length: skip through the passes
        it = self._passes()
        for _ in range(first):
            next(it)
        return [next(it) for _ in range(count)]

    @functools.cached_property
    def num_examples(self) -> int:
        """Training examples of this node: the loader's dataset length, else the
        examples of one pass."""
        dataset = getattr(self.train, "dataset", None)
        if dataset is not None:
            try:
                return len(dataset)
            except TypeError:
                pass
        return sum(batch_size_of(as_pair(b, self.where)[0]) for b in self.train)

    def eval_batches(self) -> list[Batch]:
        """The held-out batches (none if ``eval_batches`` is None)."""
        if self.eval is None:
            return []
        return [as_pair(b, self.where) for b in self.eval]


PARTITIONERS = ("iid", "dirichlet", "natural")


def partition_dataset(
    dataset: Any,
    partition_id: int,
    num_partitions: int,
    *,
    split: str = "iid",
    by: str = "label",
    alpha: float = 0.5,
    seed: int = 0,
) -> Any:
    """Node ``partition_id``'s share of a local Hugging Face ``datasets.Dataset``,
    cut by Flower Datasets' partitioners (``flwr-datasets``: the ``hf`` extra), for a
    ``load_data`` to build its batches from.

    Args:
        dataset: a ``datasets.Dataset`` (e.g. ``Dataset.from_dict`` of local data).
        split: ``iid`` (``IidPartitioner``), ``dirichlet`` (``DirichletPartitioner``
            over column ``by``, concentration ``alpha``) or ``natural``
            (``NaturalIdPartitioner``: one value of ``by`` per node; the column must
            have exactly ``num_partitions`` values).
        by: the column ``dirichlet`` and ``natural`` split by.
        seed: the partitioners' seed (the same on every node: the same cut).

    Raises:
        WorkloadError: flwr-datasets missing, an unknown ``split``, a partition id
            outside ``0..num_partitions - 1``, or a split the data cannot take.
    """
    if not 0 <= partition_id < num_partitions:
        raise WorkloadError(
            f"partition id {partition_id} is outside 0..{num_partitions - 1}"
        )
    if split not in PARTITIONERS:
        raise WorkloadError(f"split {split!r} is not one of {', '.join(PARTITIONERS)}")
    try:
        import datasets
        from flwr_datasets import partitioner as fp
    except ImportError as e:
        raise WorkloadError(
            "partition_dataset needs Flower Datasets: pip install 'fleetfit[hf]' "
            "(or flwr-datasets)"
        ) from e
    datasets.disable_progress_bars()  # no bars on a node's stderr
    try:
        if split == "iid":
            part: Any = fp.IidPartitioner(num_partitions=num_partitions)
        elif split == "dirichlet":
            part = fp.DirichletPartitioner(
                num_partitions=num_partitions,
                partition_by=by,
                alpha=alpha,
                seed=seed,
                min_partition_size=0,
            )
        else:
            values = len(set(dataset[by]))
            if values != num_partitions:
                raise WorkloadError(
                    f"a natural split gives each node one value of {by!r}: the data "
                    f"has {values} values for {num_partitions} partitions; use iid or "
                    "dirichlet, or as many nodes as values"
                )
            part = fp.NaturalIdPartitioner(partition_by=by)
        part.dataset = dataset
        return part.load_partition(partition_id)
    except WorkloadError:
        raise
    except Exception as e:  # the partitioner's own refusal, in one line
        raise WorkloadError(
            f"Flower Datasets' {split} partitioner cannot split this dataset into "
            f"{num_partitions}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e


def check_fits(batch: Batch, example: Batch, where: str) -> None:
    """Refuse a batch larger than the example batch the plans are made for.

    Raises:
        WorkloadError: more examples, or more bytes, than the example batch.
    """
    n, limit = batch_size_of(batch[0]), batch_size_of(example[0])
    size = sum(t.nelement() * t.element_size() for t in tensors_of(batch))
    cap = sum(t.nelement() * t.element_size() for t in tensors_of(example))
    if n > limit or size > cap:
        raise WorkloadError(
            f"{where} gave a batch of {n} examples ({size} bytes), larger than the "
            f"workload's example batch ({limit} examples, {cap} bytes) that memory "
            "plans are made for; return an example batch as large as the largest "
            "batch of load_data"
        )


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple or list, else
    ``model(inputs)`` (as ``memory.units.call_model``)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple | list) else model(inputs)


def _labels(inputs: Any, targets: Any) -> torch.Tensor | None:
    if isinstance(targets, torch.Tensor):
        return targets
    if isinstance(inputs, dict) and isinstance(inputs.get("labels"), torch.Tensor):
        return inputs["labels"]
    return None


def is_token_level(example: Batch) -> bool:
    """The example's labels are per token (2-D or more): a language model, whose
    metric is perplexity; else accuracy."""
    labels = _labels(*example)
    return labels is not None and labels.dim() >= 2


def _logits(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, dict):
        logits = out.get("logits")
    return logits if isinstance(logits, torch.Tensor) else None


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[Batch], loss_fn: Callable
) -> dict[str, float]:
    """Loss (each batch's mean weighted by its counted items: labels other than
    -100, else examples), accuracy (argmax of the logits against the labels, shifted
    by one token for a causal LM) and, for per-token labels, perplexity."""
    was_training = model.training
    model.eval()
    total = 0.0
    count = correct = scored = 0
    token_level = False
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    try:
        for inputs, targets in batches:
            out = call_model(model, inputs)
            loss = float(loss_fn(out, targets))
            labels = _labels(inputs, targets)
            n = batch_size_of(inputs)
            if labels is not None and labels.dim() >= 2:
                token_level = True
                if causal:
                    labels = labels[:, 1:]
                n = int((labels != -100).sum())
            total += loss * n
            count += n
            logits = _logits(out)
            if labels is not None and logits is not None:
                if causal and logits.dim() >= 3:
                    logits = logits[:, :-1]
                if logits.shape[:-1] == labels.shape:
                    keep = labels != -100
                    correct += int((logits.argmax(-1)[keep] == labels[keep]).sum())
                    scored += int(keep.sum())
    finally:
        model.train(was_training)
    loss_mean = total / max(count, 1)
    metrics = {"loss": loss_mean, "accuracy": correct / max(scored, 1)}
    if token_level:
        metrics["perplexity"] = math.exp(min(loss_mean, 50.0))
    metrics["num_examples"] = float(count)
    return metrics
