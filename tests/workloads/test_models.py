import pytest
import torch

from memory.blocks import as_blocks, check_blocks
from workloads import BUILTIN_WORKLOADS, get_workload
from workloads.models import GPT, GPT_PRESETS, GPTConfig

SMALL = ["digits-cnn", "digits-cnn-bn", "digits-mlp", "gpt-tiny"]


@pytest.mark.parametrize("name", SMALL)
def test_forward_loss_and_blocks(name):
    wl = get_workload(name)
    model = wl.make_model(seed=0)
    x, y = wl.example_batch(seed=0)
    loss = wl.loss_fn(model(x), y)
    assert torch.isfinite(loss)
    loss.backward()
    blocks = check_blocks(model, x)
    assert len(blocks) >= 3


def test_gpt_blocks_are_embed_layers_head():
    model = get_workload("gpt-tiny").make_model(0)
    assert [b.name for b in as_blocks(model)] == [
        "embed",
        "layers.0",
        "layers.1",
        "head",
    ]


def test_same_seed_same_weights_other_seed_differs():
    wl = get_workload("digits-cnn")
    a, b, c = wl.make_model(3), wl.make_model(3), wl.make_model(4)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert any(
        not torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), c.state_dict().values())
    )


def test_gpt_parameter_counts_match_their_names():
    counts = {}
    for name in ("gpt-byte", "gpt2-small", "gpt2-medium"):
        with torch.device("meta"):
            model = GPT(GPT_PRESETS[name])
        counts[name] = sum(p.numel() for p in model.parameters())  # tied counted once
    assert 18e6 < counts["gpt-byte"] < 22e6
    assert abs(counts["gpt2-small"] - 124.44e6) < 0.1e6
    assert abs(counts["gpt2-medium"] - 354.8e6) < 1e6
    assert GPT_PRESETS["gpt2-small"].vocab_size == 50257


def test_gpt2_head_is_tied_to_embedding():
    with torch.device("meta"):
        model = GPT(GPT_PRESETS["gpt2-small"])
    assert model.head.proj.weight is model.embed.tok.weight


def test_bad_gpt_config():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, context=8, d_model=10, num_layers=1, num_heads=3)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(vocab_size=10, context=8, d_model=8, num_layers=0, num_heads=2)


def test_sequence_longer_than_context_is_refused():
    model = get_workload("gpt-tiny").make_model(0)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_every_builtin_is_listed():
    assert {
        "digits-cnn",
        "digits-mlp",
        "gpt-tiny",
        "gpt-byte",
        "gpt2-small",
        "gpt2-medium",
    } <= set(BUILTIN_WORKLOADS)
