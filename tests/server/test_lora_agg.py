"""FLoRA's stacking (server.lora_agg): the aggregate is the example-weighted mean of
the devices' products B @ A, for equal and unequal ranks."""

from __future__ import annotations

import pytest
import torch

from memory.lora import factor_keys
from server.aggregate import Update, weighted_average
from server.lora_agg import AdapterReply, check_factors, merge, merged_update, stack

PATH = "layers.0.qkv"


def _reply(rank: int, n: int, seed: int, alpha: float = 8.0) -> AdapterReply:
    g = torch.Generator().manual_seed(seed)
    ka, kb = factor_keys(PATH)
    return AdapterReply(
        {ka: torch.randn(rank, 5, generator=g), kb: torch.randn(6, rank, generator=g)},
        n,
        alpha / rank,
    )


def _mean_product(replies: list[AdapterReply]) -> torch.Tensor:
    ka, kb = factor_keys(PATH)
    total = sum(r.num_examples for r in replies)
    return torch.stack(
        [
            (r.num_examples / total)
            * r.scaling
            * (r.factors[kb].double() @ r.factors[ka].double())
            for r in replies
        ]
    ).sum(0)


@pytest.mark.parametrize("ranks", [(4, 4, 4), (2, 4, 8)], ids=["equal", "unequal"])
def test_stack_is_the_weighted_mean_of_products(ranks):
    replies = [_reply(r, n, s) for s, (r, n) in enumerate(zip(ranks, (10, 30, 60)))]
    b, a = stack(replies, PATH)
    assert b.shape == (6, sum(ranks)) and a.shape == (sum(ranks), 5)
    torch.testing.assert_close(b @ a, _mean_product(replies), rtol=1e-12, atol=1e-12)


def test_by_hand():
    """Two rank-1 devices, 1 and 3 examples, scaling 1: (1/4) b1 a1 + (3/4) b2 a2;
    averaging the factors instead gives another matrix."""
    ka, kb = factor_keys(PATH)
    a1, b1 = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0], [0.0]])
    a2, b2 = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0], [1.0]])
    replies = [
        AdapterReply({ka: a1, kb: b1}, 1, 1.0),
        AdapterReply({ka: a2, kb: b2}, 3, 1.0),
    ]
    b, a = stack(replies, PATH)
    want = torch.tensor([[0.25, 0.0], [0.0, 0.75]], dtype=torch.float64)
    assert torch.equal(b @ a, want)
    naive = (0.25 * b1 + 0.75 * b2) @ (0.25 * a1 + 0.75 * a2)
    assert not torch.allclose(naive.double(), want)


def test_merged_updates_average_to_the_stacked_merge():
    """The server's path (each reply as dense target weights, then the per-key
    weighted mean) equals merging the stacked factors into the base."""
    replies = [_reply(r, n, s) for s, (r, n) in enumerate(((2, 5), (8, 7), (4, 1)))]
    w = torch.randn(6, 5, generator=torch.Generator().manual_seed(9))
    ref = {f"{PATH}.weight": w, f"{PATH}.bias": torch.zeros(6)}
    updates = [
        Update(
            i,
            i,
            r.num_examples,
            merged_update(ref, r.factors, [PATH], r.scaling),
            frozenset({f"{PATH}.weight"}),
        )
        for i, r in enumerate(replies)
    ]
    got = weighted_average(updates, ref)
    want = merge(ref, replies, [PATH])
    torch.testing.assert_close(got[f"{PATH}.weight"], want[f"{PATH}.weight"])
    torch.testing.assert_close(
        want[f"{PATH}.weight"].double(),
        w.double() + _mean_product(replies),
        rtol=1e-6,
        atol=1e-6,
    )
    assert torch.equal(got[f"{PATH}.bias"], ref[f"{PATH}.bias"])


def test_transposed_module():
    """A Conv1D (GPT-2) stores W as (in, out): the update is (B @ A).T."""
    r = _reply(3, 1, 0)
    ref = {f"{PATH}.weight": torch.zeros(5, 6)}
    got = merged_update(ref, r.factors, [PATH], r.scaling, {PATH: True})
    torch.testing.assert_close(
        got[f"{PATH}.weight"].double(), _mean_product([r]).T, rtol=1e-6, atol=1e-6
    )


def test_check_factors_names_the_fault():
    r = _reply(2, 1, 0)
    ka, kb = factor_keys(PATH)
    check_factors(r.factors, {ka: (2, 5), kb: (6, 2)})
    with pytest.raises(ValueError, match="shape"):
        check_factors(r.factors, {ka: (4, 5), kb: (6, 4)})
    with pytest.raises(ValueError, match="missing"):
        check_factors({ka: r.factors[ka]}, {ka: (2, 5), kb: (6, 2)})
    bad = {ka: r.factors[ka], kb: torch.full((6, 2), float("nan"))}
    with pytest.raises(ValueError, match="NaN"):
        check_factors(bad, {ka: (2, 5), kb: (6, 2)})
