"""Shrunk built-ins (NAME@SCALE) and natural splits that follow device classes."""

from __future__ import annotations

import numpy as np
import pytest

from workloads import WorkloadError, get_workload
from workloads.splits import class_groups, split_indices


def params(wl):
    return sum(p.numel() for p in wl.make_model(0).parameters())


@pytest.mark.parametrize("name", ["gpt-byte", "digits-cnn", "digits-mlp"])
def test_scaled_models_shrink_and_keep_data_and_shape(name):
    wl = get_workload(name)
    half = get_workload(f"{name}@0.5")
    quarter = wl.scaled(0.25)
    assert half.name == f"{name}@0.5" and quarter.name == f"{name}@0.25"
    assert params(quarter) < params(half) < params(wl)
    assert (half.batch_size, half.seq_len, half.dataset) == (
        wl.batch_size,
        wl.seq_len,
        wl.dataset,
    )
    x, y = half.example_batch()
    loss = half.loss_fn(half.make_model(0)(x), y)
    assert loss.isfinite()
    assert get_workload(f"{name}@1") is get_workload(name)


def test_scaled_gpt_keeps_vocab_and_context():
    cfg = get_workload("gpt-byte@0.125").make_config()
    assert (cfg.vocab_size, cfg.context) == (256, 256)
    assert cfg.d_model % cfg.num_heads == 0 and cfg.num_layers >= 1


def test_scaled_keeps_a_custom_shape():
    wl = get_workload("gpt-byte", batch_size=2, seq_len=16).scaled(0.5)
    assert (wl.batch_size, wl.seq_len) == (2, 16)


@pytest.mark.parametrize(
    "name, needle",
    [
        ("gpt-byte@0", "(0, 1]"),
        ("gpt-byte@1.5", "(0, 1]"),
        ("gpt-byte@half", "(0, 1]"),
        ("gpt-byte@0.50", "without padding"),
        ("resnet@0.5", "unknown workload 'resnet@0.5'"),
    ],
)
def test_bad_scales_are_refused(name, needle):
    with pytest.raises(WorkloadError, match=None) as e:
        get_workload(name)
    assert needle in str(e.value)


def test_class_split_gives_each_class_its_own_groups():
    groups = get_workload("gpt-byte").items().groups
    classes = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    parts = split_indices(groups, len(classes), "natural", classes=classes)
    every = np.concatenate(parts)
    assert len(every) == len(groups) == len(np.unique(every))  # each item once
    owner = class_groups(groups, classes)
    for p, c in zip(parts, classes, strict=True):
        assert len(p) > 0
        assert {owner[int(g)] for g in np.unique(groups[p])} == {c}
    # the same call gives the same split
    again = split_indices(groups, len(classes), "natural", classes=classes)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_class_split_with_fewer_groups_than_clients_deals_evenly():
    groups = get_workload("digits-cnn").items().groups  # 10 digit classes
    classes = [0] * 9 + [1] * 3  # 12 clients: class 0 has fewer groups than clients
    parts = split_indices(groups, 12, "natural", classes=classes, seed=3)
    owner = class_groups(groups, classes)
    assert sorted(set(owner.values())) == [0, 1]
    assert sum(o == 0 for o in owner.values()) < 9
    sizes = [len(p) for p in parts[:9]]
    assert max(sizes) - min(sizes) <= 1  # class 0's items dealt evenly
    assert len(np.unique(np.concatenate(parts))) == len(groups)


@pytest.mark.parametrize(
    "classes, needle",
    [
        ([0, 2], "device class 1 has no partition"),
        ([0, -1], "device class -1"),
        ([0, 1, 2], "3 entries for 2 partitions"),
        (list(range(11)), "11 classes"),
    ],
)
def test_bad_class_lists(classes, needle):
    groups = get_workload("digits-cnn").items().groups
    n = 11 if len(classes) == 11 else 2
    with pytest.raises(WorkloadError) as e:
        split_indices(groups, n, "natural", classes=classes)
    assert needle in str(e.value)
