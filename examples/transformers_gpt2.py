"""A transformers model with its own data per node: a fleetfit workload as users write it.

``build`` is the workload (``--workload examples.transformers_gpt2:build``, run from
the repository root): a small GPT-2 (``GPT2LMHeadModel`` from a config, random
weights, its head tied to the token embedding), called as ``model(**batch)`` and
trained on its own loss from ``labels``. ``load_data`` gives each node its own
byte-level text: the standard library's source files (``workloads.data.corpus``) as a
local Hugging Face dataset, cut by Flower Datasets' Dirichlet partitioner over package
families (``workloads.node_data.partition_dataset``), so nodes hold different code;
windows of ``SEQ`` bytes as token ids, DataLoaders of dict batches. Nothing is
downloaded. Needs ``pip install 'fleetfit[hf]'`` (transformers, flwr-datasets).

    fleetfit memory plan --workload examples.transformers_gpt2:build --memory-budget 160MB
    fleetfit simulate --workload examples.transformers_gpt2:build --clients 3 \
        --rounds 3 --local-steps 4 --memory-budgets 1GB,113MiB,105MiB \
        --disk-budgets 1GB,0,0
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers as tf
from torch import nn
from torch.utils.data import DataLoader

from workloads.data import corpus
from workloads.node_data import partition_dataset

SEQ = 32  # tokens per example
BATCH = 4  # examples per batch
VOCAB = 256  # bytes
BATCHES_PER_NODE = 32  # training batches a node holds
DATASET_ROWS = 2048  # corpus chunks in the dataset (a sample: quick to partition)
EVAL_BATCHES = 4  # held-out batches of each node (the server's: all of partition 0/1)


def _model() -> nn.Module:
    tf.logging.set_verbosity_error()
    cfg = tf.GPT2Config(
        n_embd=128,
        n_layer=4,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return tf.GPT2LMHeadModel(cfg)


def _batch(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    ids = rows[:, :SEQ].long()
    return {"input_ids": ids, "labels": ids.clone()}


def build() -> tuple[nn.Module, Any, None]:
    """The workload: the model, one example batch (as large as any node's: random
    bytes, so that building it reads no data), and no loss function (the model's own
    loss)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    return _model(), (_batch(rows), None), None


@functools.cache
def _dataset(train: bool) -> Any:
    """The corpus as a local Hugging Face dataset: one row per chunk, its first
    ``SEQ`` bytes and its package family."""
    from datasets import Dataset

    items = corpus()[0 if train else 1]
    every = max(1, len(items) // DATASET_ROWS)  # a spread-out sample of the chunks
    return Dataset.from_dict(
        {
            "input_ids": items.inputs[::every, :SEQ].long().tolist(),
            "family": items.groups[::every].tolist(),
        }
    )


def _loader(ds: Any, rows: int, drop_last: bool) -> DataLoader:
    ds = ds.select(range(min(len(ds), rows))).select_columns(["input_ids"])
    return DataLoader(
        ds.with_format("torch"),
        batch_size=BATCH,
        drop_last=drop_last,
        collate_fn=lambda rows: _batch(torch.stack([r["input_ids"] for r in rows])),
    )


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    """This node's ``(train_batches, eval_batches)``: its share of the corpus, cut by
    Flower Datasets' Dirichlet partitioner over package families (nodes hold
    different code), as DataLoaders of dict batches."""
    train, test = (
        partition_dataset(
            _dataset(is_train),
            partition_id,
            num_partitions,
            split="dirichlet",
            by="family",
            alpha=1.0,
        )
        for is_train in (True, False)
    )
    return (
        _loader(train, BATCH * BATCHES_PER_NODE, drop_last=True),
        _loader(test, BATCH * EVAL_BATCHES, drop_last=False),
    )
