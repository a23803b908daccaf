"""Plans applied to transformers models as they are (memory.units, memory.apply,
memory.step): units found, and losses and gradients equal to plain training."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from memory.batch import count_items, split_batch  # noqa: E402
from memory.errors import MemoryPlanError  # noqa: E402
from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from memory.step import PlannedTrainer, TrainSettings  # noqa: E402
from memory.units import find_units  # noqa: E402
from tests.hf.models import NAMES, build  # noqa: E402

STEPS = 3
SETTINGS = TrainSettings(lr=1e-3, clip_norm=1.0)


def _run(name: str, plan_of, *, m: int = 1, dropout: float = 0.0, chunks: int = 1):
    """Losses of STEPS steps and the gradients of the first backward."""
    model, (x, y) = build(name, dropout=dropout)
    units = find_units(model, x)
    plan = plan_of([u.name for u in units])
    plan = MemoryPlan(plan.blocks, num_microbatches=m, loss_chunks=chunks)
    losses = []
    grads = {}
    with PlannedTrainer(model, plan, units=units, settings=SETTINGS) as tr:
        for s in range(STEPS):
            torch.manual_seed(100 + s)  # the same dropout draws as the reference
            losses.append(tr.backward(x, y))
            if s == 0:
                grads = {n: g.clone() for n, g in tr.gradients().items()}
            tr._calls += 1
            tr._update()
    return losses, grads, [u.name for u in units]


@functools.cache
def _plain(name: str, dropout: float = 0.0):
    return _run(name, MemoryPlan.plain, dropout=dropout)


def _mixed(names: list[str]) -> MemoryPlan:
    """Every option somewhere: recompute, offload, recompute with inputs on disk."""
    kinds = [
        BlockPlan,
        functools.partial(BlockPlan, activations="recompute"),
        functools.partial(BlockPlan, activations="offload"),
        functools.partial(BlockPlan, activations="recompute", offload_inputs=True),
    ]
    return MemoryPlan(tuple(kinds[i % 4](n) for i, n in enumerate(names)))


def _streamed(names: list[str]) -> MemoryPlan:
    """Every unit streamed from disk, every other one with its inputs on disk too."""
    return MemoryPlan(
        tuple(
            BlockPlan(n, "recompute", "stream", offload_inputs=i % 2 == 1)
            for i, n in enumerate(names)
        )
    )


EXPECTED_UNITS = {
    "gpt2": ["transformer.wte", "transformer.wpe", "transformer.h.0"],
    "llama": ["model.embed_tokens", "model.layers.0"],
    "bert": ["bert.embeddings", "bert.encoder.layer.0"],
    "vit": ["vit.embeddings"],
    "t5": ["encoder.embed_tokens", "encoder.block.0"],
}


@pytest.mark.parametrize("name", NAMES)
def test_units_found_in_execution_order(name: str) -> None:
    _, _, units = _plain(name)
    assert units[: len(EXPECTED_UNITS[name])] == EXPECTED_UNITS[name]
    layers = [u for u in units if u.split(".")[-1].isdigit()]
    assert len(layers) >= 4  # one unit per layer
    if name == "t5":  # encoder first, then decoder
        assert units.index("encoder.block.2") < units.index("decoder.block.0")


@pytest.mark.parametrize("name", NAMES)
def test_data_moving_plans_are_bit_for_bit(name: str) -> None:
    ref_losses, ref_grads, _ = _plain(name)
    losses, grads, _ = _run(name, _mixed)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert torch.equal(grads[k], ref_grads[k]), k


@pytest.mark.parametrize("name", NAMES)
def test_streamed_state_is_bit_for_bit(name: str) -> None:
    """Parameters, gradients and AdamW state on disk, the update run per unit (here
    after the backward, since clipping needs the global norm): still plain's."""
    ref_losses, ref_grads, _ = _plain(name)
    losses, grads, _ = _run(name, _streamed)
    assert losses == ref_losses
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        assert torch.equal(grads[k], ref_grads[k]), k


def test_streamed_updates_in_backward_and_microbatches() -> None:
    """Without clipping each unit steps right after its backward; with micro-batches
    its gradients wait in the store for the last one."""
    model, (x, _) = build("gpt2")
    ref, _ = build("gpt2")
    units = find_units(model, x)
    names = [u.name for u in units]
    settings = TrainSettings(lr=1e-3)
    plain = MemoryPlan.plain(names)
    streamed = _streamed(names)
    with PlannedTrainer(ref, plain, units=find_units(ref, x), settings=settings) as a:
        want = [a.step(x) for _ in range(STEPS)]
    with PlannedTrainer(model, streamed, units=units, settings=settings) as b:
        got = [b.step(x) for _ in range(STEPS)]
    assert got == want
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    model2, _ = build("gpt2")
    mb = MemoryPlan(streamed.blocks, num_microbatches=2)
    with PlannedTrainer(
        model2, mb, units=find_units(model2, x), settings=settings
    ) as c:
        got2 = [c.step(x) for _ in range(STEPS)]
    for a_, b_ in zip(got2, want):
        assert abs(a_ - b_) <= 1e-4 * abs(b_)


def test_recompute_keeps_dropout_masks() -> None:
    ref_losses, ref_grads, _ = _plain("gpt2", 0.1)
    losses, grads, _ = _run("gpt2", _mixed, dropout=0.1)
    assert losses == ref_losses
    assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)


def _close(grads: dict, ref: dict, rtol: float = 1e-5) -> list[str]:
    """Names of gradients further than ``rtol`` (relative) from the reference. A
    tensor whose true gradient is zero (a key bias under softmax) holds only roundoff,
    so it is compared against the whole gradient's norm instead of its own."""
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values()))
    bad = []
    for k, g in ref.items():
        own = float(g.norm())
        scale = own if own > 1e-4 * float(total) else float(total)
        if float((grads[k] - g).norm()) > rtol * scale:
            bad.append(k)
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_microbatches_weight_by_counted_tokens(name: str) -> None:
    ref_losses, ref_grads, _ = _plain(name)
    losses, grads, _ = _run(name, _mixed, m=2)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert grads.keys() == ref_grads.keys()
    assert _close(grads, ref_grads) == []


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_chunked_loss_head_equals_the_models_own_loss(name: str) -> None:
    """The loss computed in the head, in chunks, never the full logits: causal
    (shifted), masked and seq2seq LMs, tied heads streamed with their embedding."""
    ref_losses, ref_grads, _ = _plain(name)

    def plan_of(names: list[str]) -> MemoryPlan:
        mixed = _mixed(names).blocks
        if name in ("gpt2", "t5"):  # the tied head and its owner streamed
            tied = {names[0], names[-1]} | {n for n in names if "embed" in n}
            mixed = tuple(
                BlockPlan(b.name, "recompute", "stream") if b.name in tied else b
                for b in mixed
            )
        return MemoryPlan(mixed)

    losses, grads, _ = _run(name, plan_of, m=2, chunks=4)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-4 * abs(b)
    assert grads.keys() == ref_grads.keys()
    assert _close(grads, ref_grads) == []


def test_a_per_microbatch_mean_would_be_wrong() -> None:
    """Llama's batch has a padded row: equal weights per micro-batch differ from the
    batch mean, the token counts do not."""
    model, (x, _) = build("llama")
    parts = split_batch(x, None, 2)
    counts = [count_items(model, p, None) for p, _ in parts]
    assert counts[0] != counts[1]
    assert sum(counts) == count_items(model, x, None)
    assert sum(counts) == int((x["labels"][:, 1:] != -100).sum())


def test_bad_plans_and_units_are_refused() -> None:
    model, (x, _) = build("gpt2")
    with pytest.raises(MemoryPlanError, match="not a module"):
        find_units(model, x, names=["transformer.nope"])
    with pytest.raises(MemoryPlanError, match="must not nest"):
        find_units(model, x, names=["transformer", "transformer.h.0"])
    units = find_units(model, x, names=["transformer.h.0", "lm_head"])
    assert [u.name for u in units] == ["transformer.h.0", "lm_head"]
    plan = MemoryPlan((BlockPlan("transformer.h.9"),))
    with pytest.raises(MemoryPlanError, match="does not have"):
        PlannedTrainer(model, plan, units=units)
    tied = find_units(model, x, names=["transformer.wte", "lm_head"])
    plan = MemoryPlan(
        (BlockPlan("transformer.wte", "recompute", "stream"), BlockPlan("lm_head"))
    )
    with pytest.raises(MemoryPlanError, match="tied"):
        PlannedTrainer(model, plan, units=tied)
    with pytest.raises(MemoryPlanError, match="split into 3"):
        split_batch(x, None, 3)


def test_plan_is_removed_and_cache_restored() -> None:
    model, (x, _) = build("llama")
    model.config.use_cache = True
    units = find_units(model, x)
    plan = MemoryPlan(tuple(BlockPlan(u.name, "recompute") for u in units))
    layer = dict(model.named_modules())["model.layers.0"]
    with PlannedTrainer(model, plan, units=units) as tr:
        assert "forward" in layer.__dict__
        assert model.config.use_cache is False
        tr.step(x)
    assert "forward" not in layer.__dict__
    assert model.config.use_cache is True


def test_a_step_over_its_budget_stops_with_the_unit_named() -> None:
    """The run-time guard: a budget far below what a step needs stops the step at a
    unit boundary with the measured bytes, the budget and the unit, not the kernel's
    OOM kill; the trainer still closes cleanly."""
    from memory.errors import BudgetExceededError
    from memory.measure import rss_bytes

    model, (x, _) = build("gpt2")
    units = find_units(model, x)
    # The baseline sits 16 MiB below this process's RSS: the step is over its 1 MiB
    # budget from its first unit whatever memory earlier tests left this process
    # holding (freed and reused, a step here need not grow the RSS at all).
    tr = PlannedTrainer(
        model,
        MemoryPlan.plain([u.name for u in units]),
        units=units,
        memory_budget_bytes=2**20,
        baseline_bytes=rss_bytes() - 16 * 2**20,
    )
    with pytest.raises(BudgetExceededError) as info:
        tr.step(x)
    assert info.value.unit in {u.name for u in units} | {"optimizer step"}
    assert info.value.budget_bytes == 2**20
    assert info.value.measured_bytes > 2**20
    assert "budget" in str(info.value) and "\n" not in str(info.value)
    tr.close()
    assert not any("forward" in u.module.__dict__ for u in units)


@pytest.mark.parametrize(
    "name,m",
    [("gpt2", 1), ("llama", 1), ("bert", 1), ("t5", 1), ("gpt2", 2), ("llama", 2)],
)
def test_row_streamed_heads_and_lookups_are_bit_for_bit(
    name: str, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed units read their embedding tables by looked-up rows (sparse
    gradients summed into the store) and a chunked head's weight, own (Llama) or
    tied (GPT-2, BERT, T5), a vocabulary block at a time: the same losses and
    gradients as the chunked head with everything in memory, bit for bit; with
    micro-batches a tied weight's two gradients join the accumulator one after the
    other ((acc + head) + lookup, where autograd adds acc + (head + lookup)), so
    there only to float tolerance."""
    import memory.head
    from memory.store import BlockStore

    monkeypatch.setattr(memory.head, "HEAD_BLOCK_BYTES", 2**16)  # 128 blocks of 64 rows
    calls = {"rows": 0, "sparse": 0}
    for fn, key in (("load_rows", "rows"), ("accumulate_sparse", "sparse")):
        orig = getattr(BlockStore, fn)

        def spy(self, *a, _orig=orig, _key=key, **kw):
            calls[_key] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(BlockStore, fn, spy)

    def resident(names: list[str]) -> MemoryPlan:
        return MemoryPlan(tuple(BlockPlan(n, "recompute") for n in names))

    ref_losses, ref_grads, _ = _run(name, resident, m=m, chunks=4)
    assert calls == {"rows": 0, "sparse": 0}
    losses, grads, _ = _run(name, _streamed_only, m=m, chunks=4)
    assert calls["rows"] > 0 and calls["sparse"] > 0, calls
    assert grads.keys() == ref_grads.keys()
    if m > 1 and name != "llama":  # tied heads
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert _close(grads, ref_grads, 1e-6) == []
        return
    assert losses == ref_losses
    for k in grads:
        assert torch.equal(grads[k], ref_grads[k]), k


def _streamed_only(names: list[str]) -> MemoryPlan:
    return MemoryPlan(tuple(BlockPlan(n, "recompute", "stream") for n in names))
