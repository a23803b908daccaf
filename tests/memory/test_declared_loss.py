"""A declared loss gets the chunked head (issue 34, item 8a).

A user's own loss on a language model's output is a function the planner cannot see
into, so it gets no loss chunks: the head's logits (and a tied embedding) stay
resident. ``memory.LogitsCrossEntropy`` declares the loss instead (plain cross
entropy on the output Linear's logits); the planner checks that the model's logits
are that Linear's output and offers loss chunks. Two models written in plain torch,
as users write them: a GPT-like model whose head is tied to its embedding, and an
LSTM LM, trained with the declared loss under plans with loss chunks, micro-batches,
recompute and streaming, against plain training: losses and every gradient alike,
and the smallest plan's predicted peak well below what a plain lambda allows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memory
from memory.errors import MemoryPlanError
from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.unit_profile import unit_profiles
from memory.units import find_units

V, D, T, B = 2048, 32, 256, 2
SETTINGS = TrainSettings(lr=1e-3, clip_norm=1.0)  # clipping: streamed grads wait


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Embedding tied to the head, two blocks; returns the logits tensor."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return logits if self.scale == 1.0 else logits * self.scale


class LSTMLM(nn.Module):
    """Embedding -> LSTM -> Linear head; returns the logits in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.lstm = nn.LSTM(D, 2 * D, batch_first=True)
        self.head = nn.Linear(2 * D, V)

    def forward(self, ids: torch.Tensor) -> dict:
        return {"logits": self.head(self.lstm(self.embed(ids))[0])}


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = ids.clone()
    targets[0, T // 2 :] = -100  # padding: uneven counts per micro-batch
    return ids, targets


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT() if kind == "gpt" else LSTMLM()


LOSS = {
    "gpt": memory.LogitsCrossEntropy(shift=True),
    "lstm": memory.LogitsCrossEntropy(),
}


def _plain(model: nn.Module, loss_fn, x, y) -> tuple[float, dict]:
    model.zero_grad()
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out["logits"]
    t = y
    if loss_fn.shift:  # the declared loss is exactly this cross entropy
        logits, t = logits[:, :-1], y[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), ignore_index=-100)
    assert torch.allclose(loss, loss_fn(out, y), rtol=1e-6, atol=0)
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters()
    }


def _planned(model: nn.Module, loss_fn, plan: MemoryPlan, x, y) -> tuple[float, dict]:
    with PlannedTrainer(model, plan, x, loss_fn=loss_fn, settings=SETTINGS) as tr:
        loss = tr.backward(x, y)
        grads = {n: g.clone() for n, g in tr.gradients().items()}
    return loss, grads


def _assert_equal(got: tuple[float, dict], want: tuple[float, dict]) -> None:
    assert abs(got[0] - want[0]) <= 1e-5 * abs(want[0])
    assert got[1].keys() == want[1].keys()
    for n, g in want[1].items():
        assert float((got[1][n] - g).norm()) <= 1e-5 * float(g.norm()), n


@pytest.mark.parametrize("kind", ["gpt", "lstm"])
def test_declared_loss_chunks_equal_plain_and_go_lower(kind: str) -> None:
    x, y = _batch()
    loss_fn = LOSS[kind]
    want = _plain(_model(kind), loss_fn, x, y)

    planned = memory.plan_training(_model(kind), x, y, loss_fn)  # the smallest
    assert planned.plan.loss_chunks > 1, planned.plan.notes
    assert planned.loss_fn.head == "head"
    model = planned.model
    with planned.trainer(settings=SETTINGS) as tr:
        got = (tr.backward(x, y), {n: g.clone() for n, g in tr.gradients().items()})
    _assert_equal(got, want)

    names = [u.name for u in find_units(model, x)]
    streamed = MemoryPlan(  # every unit recomputed and streamed, 2 micro-batches
        tuple(
            BlockPlan(n, "recompute", "stream", offload_inputs=i % 2 == 1)
            for i, n in enumerate(names)
        ),
        num_microbatches=2,
        loss_chunks=4,
    )
    _assert_equal(_planned(_model(kind), loss_fn, streamed, x, y), want)
    mixed = MemoryPlan(  # head kept resident, the rest recomputed
        tuple(BlockPlan(n, "recompute" if n != "head" else "keep") for n in names),
        num_microbatches=2,
        loss_chunks=16,
    )
    _assert_equal(_planned(_model(kind), loss_fn, mixed, x, y), want)

    # a plain function computing the same loss: no chunks, and a higher floor
    def lam(out, t):
        return LOSS[kind](out, t)

    plain_fn = memory.plan_training(_model(kind), x, y, lam)
    assert plain_fn.plan.loss_chunks == 1
    ratio = planned.plan.predicted_peak_bytes / planned.plain_peak_bytes
    floor = plain_fn.plan.predicted_peak_bytes / plain_fn.plain_peak_bytes
    print(f"{kind}: smallest plan {ratio:.1%} of plain's peak, lambda's {floor:.1%}")
    assert ratio < 0.75 * floor


def test_declared_loss_refuses_a_transform_after_the_head() -> None:
    x, y = _batch()
    model = GPT(scale=0.5)
    profiles = unit_profiles(model, x, y, memory.LogitsCrossEntropy(shift=True))
    assert list(profiles) == [1]
    why = profiles[1].loss_chunk_refusal
    assert why is not None and "not the output of a nn.Linear head" in why
    assert "\n" not in why
    # given loss chunks anyway, the first forward stops in one line
    names = [u.name for u in find_units(model, x)]
    plan = MemoryPlan.plain(names)
    plan = MemoryPlan(plan.blocks, loss_chunks=4)
    loss = memory.LogitsCrossEntropy(shift=True, head="head")
    with pytest.raises(MemoryPlanError, match="changes its logits after its head"):
        with PlannedTrainer(model, plan, x, loss_fn=loss) as tr:
            tr.backward(x, y)
    with pytest.raises(MemoryPlanError, match="not another loss_fn"):
        PlannedTrainer(model, plan, x, loss_fn=lambda o, t: o.sum())


def test_declared_loss_is_plain_cross_entropy_and_checks_its_arguments() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    t = torch.randint(0, 7, (2, 5))
    t[0, 1] = 3  # ignore_index 3 here
    ce = memory.LogitsCrossEntropy(ignore_index=3)
    want = F.cross_entropy(logits.reshape(-1, 7), t.reshape(-1), ignore_index=3)
    assert torch.equal(ce(logits, t), want)
    assert ce.count(t) == int((t != 3).sum())
    at = memory.LogitsCrossEntropy(logits=1)
    assert torch.equal(
        at((None, logits), t), F.cross_entropy(logits.flatten(0, 1), t.flatten())
    )
    with pytest.raises(ValueError, match="ignore_index"):
        memory.LogitsCrossEntropy(ignore_index=1.5)  # type: ignore[arg-type]
    with pytest.raises(MemoryPlanError, match="no 'x' tensor"):
        memory.LogitsCrossEntropy(logits="x")({"logits": logits}, t)
    with pytest.raises(MemoryPlanError, match="integer class targets"):
        ce(logits, t.float())


def test_declared_head_is_found_on_a_model_built_without_weights() -> None:
    """A measured child builds the model on ``meta`` and reads its weights unit by
    unit: the head is found on a fake copy, with no weights."""
    from memory.head import declared_head
    from memory.materialize import params_on_meta

    x, _ = _batch()
    with params_on_meta():
        model = GPT()
    assert model.head.weight.is_meta
    assert declared_head(model, x, LOSS["gpt"]) == ("head", None)
    name, why = declared_head(GPT(scale=2.0), x, LOSS["gpt"])
    assert name is None and "not the output of a nn.Linear head" in why
