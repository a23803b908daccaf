"""The torch.nn zoo (issue 34): every ``torch.nn`` module class with parameters, each
inside a small model (tests/memory/nn_zoo.py), trained 2 steps plainly and under
plans made by the public API, ``memory.plan_training``: at half of plain's predicted
peak (``plain_peak_bytes // 2``) and at the smallest plan. Compared in process: the
losses within 1e-5 relative, and every parameter's gradient before each optimizer
step within ``||g_plan - g_plain|| <= 1e-5 ||g_plain||`` (max abs 1e-7 where
``||g_plain|| < 1e-6``). Plus weight parametrizations and blocks that the model
recomputes itself (``torch.utils.checkpoint``, reentrant and not).

The classes are enumerated from ``torch.nn`` by rule; a class the zoo's tables do not
know fails ``test_every_class_is_known``, so a new torch cannot shrink the zoo
silently. Both legs run for one representative of each family in the default tier
(``REPRESENTATIVES``), for the others under ``-m zoo`` (not in CI; tests/tiers.py
runs ``zoo`` tests only where ``-m`` names the marker). The whole zoo::

    pytest -m "zoo or not zoo" tests/memory/test_nn_zoo.py -p no:cacheprovider
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import memory
from memory.api import DROPOUT_NOTE
from memory.errors import BudgetError, MemoryPlanError
from memory.materialize import build_without_weights
from memory.plan import BATCH_DEPENDENT_NOTE
from memory.spec import BlockPlan, MemoryPlan
from memory.step import make_optimizer
from tests.memory import nn_zoo as Z

SETTINGS = memory.TrainSettings(lr=1e-3, clip_norm=1.0)
"""Clipping defers a streamed unit's update to after the backward, so every
gradient is there to compare before the optimizer step."""
STEPS = 2
RTOL = 1e-5

ENUMERATED = Z.module_classes()
KINDS = {name: Z.classify(name) for name in ENUMERATED}
CASES = [n for n in ENUMERATED if KINDS[n][0] == "zoo"] + list(Z.EXTRAS)

XFAIL: dict[str, str] = {}
"""Cases that fail for a cause outside this file's owners, with the cause."""

REPRESENTATIVES = {
    "linear": "Linear",
    "recurrent": "LSTM",
    "embedding": "EmbeddingBag",
    "attention": "TransformerEncoderLayer",
    "norm": "LayerNorm",
    "batchnorm": "BatchNorm2d",
    "conv": "Conv2d",
    "activation": "PReLU",
    "loss": "AdaptiveLogSoftmaxWithLoss",  # nonzero in its own code: one unit
    "parametrization": "spectral_norm",
    "checkpoint": "checkpoint_reentrant",
}
"""The family member that runs in the default tier (both legs; the others run
under ``-m zoo``): the default tier's 60 s do not hold two profiles of each of 53
cases (about 95 s of the half-budget leg alone on this machine's two shared cores)."""


def _spec(name: str) -> Z.Layer:
    return Z.LAYERS[name] if name in Z.LAYERS else Z.EXTRAS[name]


def _params() -> list:
    out = []
    for name in CASES:
        marks = []
        if name in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[name]))
        if REPRESENTATIVES.get(_spec(name).family) != name:
            marks.append(pytest.mark.zoo)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def test_every_class_is_known() -> None:
    """Every nn.Module class torch.nn exports is in the zoo, shown to have no
    parameters, or skipped with a reason; the tables name no class torch lacks."""
    unknown = [why for kind, why in KINDS.values() if kind == "unknown"]
    assert not unknown, "\n".join(unknown)
    stale = (set(Z.LAYERS) | set(Z.PARAMETERLESS) | set(Z.SKIPPED)) - set(ENUMERATED)
    assert not stale, f"the zoo's tables name classes torch.nn lacks: {sorted(stale)}"
    zoo = [n for n in ENUMERATED if KINDS[n][0] == "zoo"]
    for must in ("Linear", "Conv3d", "LSTM", "EmbeddingBag", "Transformer", "RMSNorm"):
        assert must in zoo
    assert len(zoo) >= 45, zoo  # torch 2.13: 48 classes with parameters


def _train(
    case: Z.Case, planned: memory.TrainingPlan | None
) -> tuple[list, list, dict]:
    """Losses of STEPS steps, each step's gradients before its update and the
    buffers after the last (running statistics): plainly (torch and
    ``memory.step.make_optimizer``'s AdamW) or under ``planned``."""
    losses, grads = [], []
    if planned is None:
        model = case.model
        opt = make_optimizer(model, SETTINGS)
        assert opt is not None
        for s in range(STEPS):
            torch.manual_seed(100 + s)
            loss = case.loss_fn(model(*case.inputs), case.targets)
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append(
                {
                    n: p.grad.clone()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
            )
            torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS.clip_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return losses, grads, _buffers(model)
    with planned.trainer(settings=SETTINGS) as tr:
        for s in range(STEPS):
            torch.manual_seed(100 + s)
            losses.append(tr.backward(case.inputs, case.targets))
            grads.append({n: g.clone() for n, g in tr.gradients().items()})
            tr._calls += 1  # the update step() would run (no public update alone)
            tr._update()
    return losses, grads, _buffers(case.model)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


@functools.cache
def _plain(name: str) -> tuple[list, list]:
    return _train(Z.build(name), None)


def _differences(ref: tuple, got: tuple) -> list[str]:
    out = []
    for s, (a, b) in enumerate(zip(ref[0], got[0])):
        if abs(a - b) > RTOL * abs(a):
            out.append(f"step {s} loss {b!r} against plain {a!r}")
    for s, (want, have) in enumerate(zip(ref[1], got[1])):
        if want.keys() != have.keys():
            out.append(f"step {s} gradients of {sorted(want.keys() ^ have.keys())}")
            continue
        for k, g in want.items():
            norm = float(torch.linalg.vector_norm(g.double()))
            diff = (have[k].double() - g.double()).flatten()
            if norm < 1e-6:
                if float(diff.abs().max()) > 1e-7:
                    out.append(f"step {s} {k}: max abs {float(diff.abs().max()):.2e}")
            elif float(torch.linalg.vector_norm(diff)) > RTOL * norm:
                rel = float(torch.linalg.vector_norm(diff)) / norm
                out.append(f"step {s} {k}: relative {rel:.2e}")
    for k, b in ref[2].items():  # BatchNorm's statistics move as plainly
        have = got[2][k]
        if b.is_floating_point():
            bad = float((have.double() - b.double()).norm()) > RTOL * float(
                b.double().norm()
            )
        else:
            bad = not torch.equal(have, b)
        if bad:
            out.append(f"buffer {k} after {STEPS} steps")
    return out


def _describe(planned: memory.TrainingPlan) -> str:
    p = planned.plan
    kinds = sorted(
        {
            b.activations
            + ("+stream" if b.state == "stream" else "")
            + ("+inputs-on-disk" if b.offload_inputs else "")
            for b in p.blocks
        }
    )
    return (
        f"{p.num_microbatches} micro-batches, {', '.join(kinds)}; predicted "
        f"{p.predicted_peak_bytes / 2**20:.1f} MiB of plain's "
        f"{planned.plain_peak_bytes / 2**20:.1f} MiB"
    )


@functools.cache
def _planned(
    name: str,
) -> tuple[Z.Case, dict, memory.TrainingPlan, memory.TrainingPlan, str]:
    """The case (with its initial state), its smallest plan, and the plan at half of
    plain's predicted peak (the smallest where none fits), described. Both legs
    train the same model, its state put back in between: each model is profiled
    twice, not four times."""
    case = Z.build(name)
    initial = {k: v.clone() for k, v in case.model.state_dict().items()}
    smallest = memory.plan_training(
        case.model, case.inputs, case.targets, case.loss_fn, budget_bytes=None
    )
    budget = smallest.plain_peak_bytes // 2
    try:
        half = memory.plan_training(
            case.model, case.inputs, case.targets, case.loss_fn, budget_bytes=budget
        )
        what = f"the plan at half of plain ({budget} bytes)"
        assert half.plan.predicted_peak_bytes <= budget
    except BudgetError:
        half = smallest
        what = f"the smallest plan (none fits half of plain, {budget} bytes)"
    return case, initial, smallest, half, what


def _check(name: str, half: bool) -> None:
    case, initial, smallest, at_half, what = _planned(name)
    planned = at_half if half else smallest
    if not half:
        what = "the smallest plan"
    assert not planned.plan.is_plain, f"{name}: {what} is plain training"
    case.model.load_state_dict(initial)  # as built, whichever leg ran first
    bad = _differences(_plain(name), _train(case, planned))
    assert not bad, f"{name} under {what} ({_describe(planned)}): " + "; ".join(bad)


@pytest.mark.parametrize("name", _params())
def test_half_budget_plan_trains_like_plain(name: str) -> None:
    _check(name, half=True)


@pytest.mark.parametrize("name", _params())
def test_smallest_plan_trains_like_plain(name: str) -> None:
    _check(name, half=False)


# ------------------------------------------------- dropout and batch-dependent layers


def _case(spec: Z.Layer, seed: int = 0) -> Z.Case:
    Z.EXTRAS["_probe"] = spec
    try:
        return Z.build("_probe", seed)
    finally:
        del Z.EXTRAS["_probe"]


DROPOUT = Z.Layer(
    lambda: nn.TransformerEncoderLayer(
        Z.D, 2, dim_feedforward=2 * Z.D, dropout=0.1, batch_first=True
    ),
    "tokens",
    shape=(16, 16),
)
"""Encoder layers with their own dropout (p = 0.1: attention, feed-forward, residual)."""


def _all(names: list[str], **kw: object) -> MemoryPlan:
    return MemoryPlan(tuple(BlockPlan(n, **kw) for n in names))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kind", ["smallest", "recompute", "offload", "stream", "inputs-on-disk"]
)
def test_dropout_without_microbatches_is_plain(kind: str) -> None:
    """Recompute replays the random state its first run saw, offload keeps the
    tensors (the masks among them): without micro-batches every plan draws plain's
    masks, and trains bit for bit like plain (seeds set alike before each step)."""
    ref = _train(_case(DROPOUT), None)
    other = _case(DROPOUT)
    with torch.no_grad():  # the test could fail: other draws change the loss
        torch.manual_seed(7)
        out = other.loss_fn(other.model(*other.inputs), other.targets)
    assert float(out) != ref[0][0]
    case = _case(DROPOUT)
    planned = memory.plan_training(
        case.model, case.inputs, case.targets, case.loss_fn, allow_microbatching=False
    )
    assert planned.plan.num_microbatches == 1
    assert DROPOUT_NOTE not in planned.plan.notes
    names = [u.name for u in planned.units]
    plans = {
        "recompute": _all(names, activations="recompute"),
        "offload": _all(names, activations="offload"),
        "stream": _all(names, activations="recompute", state="stream"),
        "inputs-on-disk": _all(names, activations="recompute", offload_inputs=True),
    }
    if kind != "smallest":
        planned = dataclasses.replace(planned, plan=plans[kind])
    else:
        assert not planned.plan.is_plain
    losses, grads, _ = _train(case, planned)
    assert losses == ref[0]
    for want, have in zip(ref[1], grads):
        assert want.keys() == have.keys()
        for k in want:
            assert torch.equal(want[k], have[k]), k


def test_dropout_with_microbatches_is_stated() -> None:
    """Micro-batches draw each micro-batch's masks, not the whole batch's: losses
    differ by design, and the plan's notes say so; without dropout they do not."""
    case = _case(DROPOUT)
    planned = memory.plan_training(case.model, case.inputs, case.targets, case.loss_fn)
    assert planned.plan.num_microbatches > 1
    assert DROPOUT_NOTE in planned.plan.notes
    case.model.eval()  # no dropout in eval mode
    quiet = memory.plan_training(case.model, case.inputs, case.targets, case.loss_fn)
    assert quiet.plan.num_microbatches > 1
    assert DROPOUT_NOTE not in quiet.plan.notes


BATCHNORM = Z.Layer(lambda: nn.BatchNorm1d(Z.C), "conv1", family="batchnorm", copies=2)
SPECTRAL = Z.Layer(lambda: Z.EXTRAS["spectral_norm"].make(), "tokens", shape=(16, 16))


def test_batchnorm_is_never_microbatched_silently() -> None:
    """A BatchNorm model's plans have no micro-batches; forced with
    allow_microbatching=True they have, and their notes say that losses differ (they
    do); a plan with micro-batches made by hand stops in one line naming the layer
    and the fix, also when the micro-batches are asked for at the step; in eval mode
    (a frozen BatchNorm reads fixed statistics) micro-batches are allowed."""
    case = _case(BATCHNORM)
    auto = memory.plan_training(case.model, case.inputs, case.targets, case.loss_fn)
    assert auto.plan.num_microbatches == 1
    assert BATCH_DEPENDENT_NOTE not in auto.plan.notes
    assert not auto.plan.batch_dependent_microbatches

    forced = memory.plan_training(
        case.model,
        case.inputs,
        case.targets,
        case.loss_fn,
        allow_microbatching=True,
    )
    assert forced.plan.num_microbatches > 1
    assert BATCH_DEPENDENT_NOTE in forced.plan.notes
    assert forced.plan.batch_dependent_microbatches
    plain = _case(BATCHNORM)
    for c in (case, plain):  # items of different scales: each part's statistics differ
        (x,) = c.inputs
        c.inputs = (x * torch.linspace(0.1, 4.0, len(x)).view(-1, 1, 1),)
    ref = _train(plain, None)
    losses, _, _ = _train(case, forced)  # allowed: trains, differently by design
    assert abs(losses[0] - ref[0][0]) > 1e-3 * abs(ref[0][0])

    by_hand = dataclasses.replace(
        auto, plan=MemoryPlan(auto.plan.blocks, num_microbatches=2)
    )
    with pytest.raises(MemoryPlanError) as e:
        by_hand.trainer(settings=SETTINGS)
    msg = str(e.value)
    assert "\n" not in msg
    assert "BatchNorm1d 'layers.0' normalises over the batch" in msg
    assert "num_microbatches=1" in msg and "allow_microbatching=True" in msg
    with auto.trainer(settings=SETTINGS) as tr, pytest.raises(MemoryPlanError):
        tr.backward(case.inputs, case.targets, num_microbatches=2)

    case.model.eval()
    with by_hand.trainer(settings=SETTINGS) as tr:
        tr.backward(case.inputs, case.targets)  # eval mode: nothing batch-dependent


def test_spectral_norm_is_batch_dependent() -> None:
    """spectral_norm's power iteration runs once per forward in training mode: once
    per micro-batch, and the next forward reads it, so it is batch-dependent (its
    plans have no micro-batches, the zoo's spectral_norm case trains like plain) and a
    hand-made plan with micro-batches is refused."""
    case = _case(SPECTRAL)
    auto = memory.plan_training(case.model, case.inputs, case.targets, case.loss_fn)
    assert auto.plan.num_microbatches == 1
    by_hand = dataclasses.replace(
        auto, plan=MemoryPlan(auto.plan.blocks, num_microbatches=2)
    )
    with pytest.raises(MemoryPlanError, match="spectral_norm at 'layers.0.lin"):
        by_hand.trainer(settings=SETTINGS)


@pytest.mark.parametrize("name", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_models_build_without_weights(name: str) -> None:
    """A measured child builds the model without its weights
    (``memory.materialize.build_without_weights``); orthogonal reads its weight at
    registration, so it is built for real, with the weights a plain build gives."""
    model, hollow = build_without_weights(lambda: Z.build(name).model)
    assert hollow == (name != "orthogonal")
    if not hollow:
        want = Z.build(name).model.state_dict()
        got = model.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
