"""A custom workload's own data per node (``load_data``): which batches a round
trains, and one-line errors for loaders that break the contract."""

from __future__ import annotations

import textwrap

import pytest
import torch

from workloads import WorkloadError, get_workload

MODULE = "nodedata_jobs"

SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    MODE = {"value": "ok"}


    def build():
        x = torch.zeros(4, 3)
        return nn.Linear(3, 2), (x, torch.zeros(4, dtype=torch.long)), nn.functional.cross_entropy


    def _batch(pid, i, n=4):
        x = torch.full((n, 3), float(100 * pid + i))
        return x, torch.zeros(n, dtype=torch.long)


    def load_data(partition_id, num_partitions):
        mode = MODE["value"]
        if mode == "raise":
            raise OSError("no such file: shards/part-7")
        if mode == "one":
            return [_batch(partition_id, 0)]
        if mode == "not-iterable":
            return 3, None
        if mode == "big":
            return [_batch(partition_id, 0, n=8)], None
        if mode == "empty":
            return [], None
        train = [_batch(partition_id, i) for i in range(5)]
        train.append(_batch(partition_id, 5, n=2))  # a loader's short last batch
        return train, [_batch(partition_id, 99)]
    """
)


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module(MODULE)
    mod.MODE["value"] = "ok"
    from workloads import registry

    registry._node_data.cache_clear()
    yield mod
    registry._node_data.cache_clear()


def _first(batches):
    return [int(x[0, 0]) % 100 for x, _ in batches]


def test_rounds_walk_through_the_node_s_batches_and_wrap(jobs):
    wl = get_workload(f"{MODULE}:build")
    assert wl.own_data and not wl.any_model and wl.data_fn is not None
    b1, n = wl.node_batches(2, 3, server_round=1, local_steps=4)
    assert _first(b1) == [0, 1, 2, 3] and n == 22  # 5 x 4 + 2 examples
    assert all(int(x[0, 0]) // 100 == 2 for x, _ in b1)  # partition 2's own data
    b2, _ = wl.node_batches(2, 3, server_round=2, local_steps=4)
    assert _first(b2) == [4, 5, 0, 1]  # on into the next pass
    b3, _ = wl.node_batches(2, 3, server_round=3, local_steps=4)
    assert _first(b3) == [2, 3, 4, 5]
    ev = wl.eval_batches(1, 3)
    assert len(ev) == 1 and int(ev[0][0][0, 0]) == 199
    assert wl.evaluate(torch.nn.Linear(3, 2))["num_examples"] == 4  # central: 0 of 1


def test_a_loader_returning_one_iterable_is_refused(jobs):
    jobs.MODE["value"] = "one"
    wl = get_workload(f"{MODULE}:build")
    with pytest.raises(WorkloadError, match=r"load_data\(0, 2\) must return"):
        wl.node_batches(0, 2, server_round=1, local_steps=1)


@pytest.mark.parametrize(
    "mode,needle",
    [
        ("raise", r"load_data\(1, 2\) failed: OSError: no such file"),
        ("not-iterable", "train_batches is a int, not an iterable"),
        ("big", "larger than the workload's example batch"),
        ("empty", "train_batches is empty"),
    ],
)
def test_a_broken_loader_fails_in_one_line(jobs, mode, needle):
    jobs.MODE["value"] = mode
    wl = get_workload(f"{MODULE}:build")
    with pytest.raises(WorkloadError, match=needle) as e:
        wl.node_batches(1, 2, server_round=1, local_steps=2)
    assert "\n" not in str(e.value)


def test_partition_ids_are_checked(jobs):
    wl = get_workload(f"{MODULE}:build")
    for pid, n in ((2, 2), (-1, 2)):
        with pytest.raises(WorkloadError, match="outside 0..1"):
            wl.node_data(pid, n)


def test_dict_batches_are_inputs_without_targets(jobs):
    from workloads.node_data import as_pair

    x = {"input_ids": torch.zeros(2, 3)}
    assert as_pair(x, "w") == (x, None)
    assert as_pair([1, 2], "w") == (1, 2)
    with pytest.raises(WorkloadError, match="a batch is \\(inputs, targets\\)"):
        as_pair((1, 2, 3), "w")


def test_flower_datasets_partitioners_cut_a_local_dataset():
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("flwr_datasets")
    from workloads.node_data import partition_dataset

    ds = datasets.Dataset.from_dict(
        {"x": list(range(120)), "label": [i % 4 for i in range(120)]}
    )
    for split in ("iid", "dirichlet", "natural"):
        parts = [partition_dataset(ds, p, 4, split=split) for p in range(4)]
        seen = sorted(x for part in parts for x in part["x"])
        assert seen == list(range(120)), split  # every row on exactly one node
        again = partition_dataset(ds, 2, 4, split=split)
        assert again["x"] == parts[2]["x"]  # the same cut on every node
    natural = [
        set(partition_dataset(ds, p, 4, split="natural")["label"]) for p in range(4)
    ]
    assert all(len(labels) == 1 for labels in natural)
    for kwargs, needle in (
        (dict(split="natural", num_partitions=3), "has 4 values for 3 partitions"),
        (dict(split="pathological"), "is not one of iid, dirichlet, natural"),
        (dict(partition_id=4), "outside 0..3"),
    ):
        args = dict(partition_id=0, num_partitions=4) | kwargs
        with pytest.raises(WorkloadError, match=needle) as e:
            partition_dataset(
                ds, args.pop("partition_id"), args.pop("num_partitions"), **args
            )
        assert "\n" not in str(e.value)
