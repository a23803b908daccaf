import numpy as np
import pytest
import torch

from workloads import WorkloadError, get_workload
from workloads.data import CHUNK_BYTES, corpus, digits, stdlib_sources
from workloads.splits import split_indices


def test_digits_held_out_is_disjoint_and_fixed():
    train, test = digits()
    assert len(train) + len(test) == 1797
    assert train.inputs.shape[1:] == (1, 8, 8) and float(train.inputs.max()) <= 1.0
    assert set(np.unique(test.groups)) == set(range(10))


def test_corpus_is_real_python_grouped_by_family():
    train, test = corpus()
    assert train.inputs.shape[1] == CHUNK_BYTES and train.inputs.dtype == torch.uint8
    text = bytes(train.inputs[:50].flatten().tolist()).decode("utf-8", "replace")
    assert "def " in text or "import " in text
    assert len(train.group_names) > 50 and "email" in train.group_names
    assert 0.05 < len(test) / (len(train) + len(test)) < 0.15


def test_stdlib_sources_sorted_without_site_packages():
    src = stdlib_sources()
    assert [p for _, p in src] == sorted(p for _, p in src)
    assert not any("site-packages" in p for _, p in src)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "natural"])
def test_splits_partition_the_items(kind):
    groups = digits()[0].groups
    parts = split_indices(groups, 10, kind, seed=1, alpha=0.3)
    joined = np.concatenate(parts)
    assert len(joined) == len(groups) and len(np.unique(joined)) == len(groups)
    assert all(len(p) > 0 for p in parts)
    again = split_indices(groups, 10, kind, seed=1, alpha=0.3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_natural_split_gives_each_client_its_own_groups():
    groups = corpus()[0].groups
    parts = split_indices(groups, 8, "natural")
    owners = [set(np.unique(groups[p])) for p in parts]
    for i in range(8):
        for j in range(i + 1, 8):
            assert not owners[i] & owners[j]


def test_dirichlet_skews_labels_more_with_small_alpha():
    groups = digits()[0].groups

    def skew(alpha):
        parts = split_indices(groups, 10, "dirichlet", seed=0, alpha=alpha)
        return np.mean(
            [np.bincount(groups[p], minlength=10).max() / len(p) for p in parts]
        )

    assert skew(0.1) > skew(100.0) + 0.2


def test_split_errors_name_the_value():
    groups = np.zeros(5, dtype=np.int64)
    with pytest.raises(WorkloadError, match="6 clients but only 5 items"):
        split_indices(groups, 6)
    with pytest.raises(WorkloadError, match="unknown split 'zipf'"):
        split_indices(groups, 2, "zipf")
    with pytest.raises(WorkloadError, match="1 groups for 2 clients"):
        split_indices(groups, 2, "natural")
    with pytest.raises(WorkloadError, match="alpha must be > 0"):
        split_indices(groups, 2, "dirichlet", alpha=0)


def test_lm_batches_are_next_byte_pairs_and_seeded():
    wl = get_workload("gpt-tiny")
    items = wl.client_items(0, 4, "natural")
    x1, y1 = next(wl.batches(items, seed=5))
    x2, _ = next(wl.batches(items, seed=5))
    assert x1.shape == (4, 32) and torch.equal(x1, x2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_digit_client_share_and_evaluate():
    wl = get_workload("digits-cnn")
    share = wl.client_items(3, 10, "iid", seed=0)
    assert 130 < len(share) < 160
    m = wl.evaluate(wl.make_model(0))
    assert 0.0 <= m["accuracy"] <= 0.3 and m["loss"] > 1.5
