"""memory.chain_profile: per-block costs from fake tensors."""

from __future__ import annotations

import pytest

from memory.blocks import as_blocks
from memory.chain_profile import profile_blocks, profile_workload_fake
from memory.measure import measure_in_child
from memory.profile import Profile
from workloads import get_workload


def test_mlp_costs_are_exact():
    wl = get_workload("digits-mlp")
    x, y = wl.example_batch(0)
    model = wl.make_model(0)
    prof = profile_blocks(as_blocks(model), x, y, wl.loss_fn, measure_time=False)
    b0, b1, b2 = prof.blocks
    assert b0.param_bytes == (64 * 128 + 128) * 4
    assert (
        b0.grad_bytes == b0.param_bytes
        and b0.optimizer_state_bytes == 2 * b0.param_bytes
    )
    c0 = b0.costs[1]
    assert c0.input_bytes == 32 * 64 * 4 and c0.output_bytes == 32 * 128 * 4
    # Linear saves its input (a view of the batch), ReLU its output: nothing else
    assert c0.saves_input and c0.saves_output and c0.saved_bytes == 0
    assert b0.saved_activation_bytes == 32 * 64 * 4 + 32 * 128 * 4
    # half the batch, half the bytes
    assert b1.costs[2].output_bytes == b1.costs[1].output_bytes // 2
    assert prof.microbatch_options == (1, 2, 4, 8, 16)
    assert not prof.batch_dependent
    # the real model was not touched
    assert all(p.grad is None for p in model.parameters())


def test_fake_and_real_profiles_agree():
    wl = get_workload("gpt-tiny")
    x, y = wl.example_batch(0)
    blocks = as_blocks(wl.make_model(0))
    fake = profile_blocks(
        blocks, x, y, wl.loss_fn, measure_time=False, max_microbatches=1
    )
    real = profile_blocks(
        blocks, x, y, wl.loss_fn, measure_time=False, fake=False, max_microbatches=1
    )
    for f, r in zip(fake.blocks, real.blocks):
        assert f.costs[1].saved_bytes == r.costs[1].saved_bytes
        assert f.costs[1].forward_peak_bytes == r.costs[1].forward_peak_bytes
        assert f.costs[1].backward_peak_bytes == r.costs[1].backward_peak_bytes


def test_tied_weights_count_once_and_logits_belong_to_the_head():
    wl = get_workload("gpt2-small", batch_size=1, seq_len=64)
    x, y = wl.example_batch(0)
    prof = profile_workload_fake(
        lambda: wl.make_model(0),
        x,
        y,
        wl.loss_fn,
        measure_time=False,
        max_microbatches=1,
        max_loss_chunks=2,
    )
    embed, head = prof.blocks[0], prof.blocks[-1]
    tok = 50257 * 768 * 4
    assert embed.param_bytes == tok + 1024 * 768 * 4
    assert head.param_bytes == 2 * 768 * 4  # its LayerNorm; the projection is tied
    assert head.shared_param_bytes == tok and head.shared_with == ("embed",)
    assert prof.param_bytes == pytest.approx(124.4e6 * 4, rel=0.01)
    # built with an untied head first: construction peaks above the parameters
    assert prof.construction_peak_bytes >= prof.param_bytes + tok
    # the loss saves the (64 x 50257) log-softmax: it is the head's
    assert head.costs[1].saved_bytes >= 64 * 50257 * 4
    assert prof.loss_chunk_options == (1, 2)
    assert head.chunk_costs[(1, 2)].saved_bytes < head.costs[1].saved_bytes
    again = Profile.from_dict(prof.to_dict())
    assert again == prof


@pytest.mark.child
def test_gpt2_medium_profiles_without_its_weights():
    m = measure_in_child("memhelpers:profile_big_fake", {"name": "gpt2-medium"})
    assert m.result["param_bytes"] > 1.4e9
    assert m.peak_bytes < 150e6  # ten times less than the weights


def test_time_is_measured_when_affordable():
    wl = get_workload("digits-cnn")
    x, y = wl.example_batch(0)
    prof = profile_blocks(
        as_blocks(wl.make_model(0)), x, y, wl.loss_fn, max_microbatches=2
    )
    assert prof.time_source == "measured"
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in prof.blocks)
    assert prof.flops_per_s > 1e8
    flops = profile_blocks(
        as_blocks(wl.make_model(0)),
        x,
        y,
        wl.loss_fn,
        measure_time=False,
        max_microbatches=1,
    )
    assert flops.time_source == "flops"
    assert flops.blocks[1].forward_s == pytest.approx(
        flops.blocks[1].costs[1].forward_flops / flops.flops_per_s
    )


def test_batchnorm_is_batch_dependent():
    wl = get_workload("digits-cnn-bn")
    x, y = wl.example_batch(0)
    prof = profile_blocks(
        as_blocks(wl.make_model(0)), x, y, wl.loss_fn, measure_time=False
    )
    assert prof.batch_dependent
    assert (
        prof.blocks[0].buffer_bytes == (16 * 2 + 1) * 4 + 4
    )  # mean, var, count(int64)
