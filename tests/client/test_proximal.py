"""FedProx's proximal term on every training path: plain, the one-device executor
under a plan, the per-unit trainer; refused where parameters are streamed."""

from __future__ import annotations

import pytest
import torch

from client.train import draw_batches, train_assigned
from memory.blocks import as_blocks
from memory.spec import BlockPlan, MemoryPlan
from memory.step import PlannedTrainer, TrainSettings
from memory.units import find_units
from partition.local import LocalExecutor
from partition.measured import plain_steps
from workloads import get_workload

MU, LR = 0.5, 1e-2
MODES = {"k": "keep", "r": "recompute", "o": "offload"}


def _plan(names, specs):
    return MemoryPlan(
        tuple(
            BlockPlan(
                n,
                MODES[specs[i % len(specs)].lower()],
                "stream" if specs[i % len(specs)].isupper() else "resident",
            )
            for i, n in enumerate(names)
        )
    )


def _setup(name="gpt-tiny", steps=3):
    wl = get_workload(name)
    batches, _, _ = draw_batches(
        wl, 0, 2, split="iid", alpha=0.5, seed=0, server_round=1, local_steps=steps
    )
    return wl, batches


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plain_steps_equal_autograd_on_the_regularised_loss():
    wl, batches = _setup()
    ref = wl.make_model(0)
    w0 = [p.detach().clone() for p in ref.parameters()]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for x, y in batches:
        prox = sum(((p - a) ** 2).sum() for p, a in zip(ref.parameters(), w0))
        (wl.loss_fn(ref(x), y) + MU / 2 * prox).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = wl.make_model(0)
    plain_steps(got, wl.loss_fn, batches, lr=LR, proximal_mu=MU)
    without = wl.make_model(0)
    plain_steps(without, wl.loss_fn, batches, lr=LR)
    want, have, off = _params(ref), _params(got), _params(without)
    for k in want:
        torch.testing.assert_close(have[k], want[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(have[k], off[k]) for k in want)


@pytest.mark.parametrize("specs", ["k", "kro"])
def test_executor_under_a_plan_equals_plain(specs, tmp_path):
    wl, batches = _setup()
    plain = wl.make_model(0)
    plain_steps(plain, wl.loss_fn, batches, lr=LR, proximal_mu=MU)
    model = wl.make_model(0)
    plan = _plan([b.name for b in as_blocks(model)], specs)
    with LocalExecutor(
        model, wl.loss_fn, plan, lr=LR, offload_dir=tmp_path, proximal_mu=MU
    ) as ex:
        for x, y in batches:
            ex.step(x, y)
        sd = ex.state_dict()
    for k, v in _params(plain).items():
        assert torch.equal(sd[k], v), k  # only data moves: bit for bit


def test_per_unit_trainer_equals_plain():
    wl, batches = _setup()
    plain = wl.make_model(0)
    plain_steps(plain, wl.loss_fn, batches, lr=LR, proximal_mu=MU)
    model = wl.make_model(0)
    units = find_units(model, batches[0][0])
    plan = _plan([u.name for u in units], "rk")
    settings = TrainSettings(lr=LR, weight_decay=1e-2, proximal_mu=MU)
    trainer = PlannedTrainer(
        model, plan, units=units, loss_fn=wl.loss_fn, settings=settings
    )
    trainer.train(batches)
    trainer.close()
    have = _params(model)
    for k, v in _params(plain).items():
        torch.testing.assert_close(have[k], v, rtol=1e-5, atol=1e-6)


def test_streamed_parameters_are_refused(tmp_path):
    wl, batches = _setup()
    model = wl.make_model(0)
    plan = _plan([b.name for b in as_blocks(model)], "kR")
    with pytest.raises(ValueError, match="proximal-mu=0.5 cannot be applied"):
        LocalExecutor(model, wl.loss_fn, plan, offload_dir=tmp_path, proximal_mu=MU)
    units = find_units(model, batches[0][0])
    with pytest.raises(ValueError, match="streamed from disk"):
        PlannedTrainer(
            model,
            _plan([u.name for u in units], "kR"),
            units=units,
            loss_fn=wl.loss_fn,
            settings=TrainSettings(proximal_mu=MU),
            offload_dir=tmp_path,
        )
    assert list(tmp_path.iterdir()) == []


def test_assigned_part_window_is_pulled_towards_the_global_model():
    wl, batches = _setup("digits-cnn", steps=5)
    state = wl.make_model(0).state_dict()

    def dist(mu):
        r = train_assigned(
            state,
            wl,
            batches,
            num_examples=10,
            torch_seed=0,
            plan=None,
            window=(1, 2),
            lr=LR,
            measure="inline",
            proximal_mu=mu,
        )
        return sum(float((r.state[k] - state[k]).square().sum()) for k in r.state)

    assert dist(50.0) < dist(0.0)


@pytest.mark.child
def test_measured_child_applies_the_term_as_inline_does():
    wl, batches = _setup("digits-cnn", steps=2)
    state = wl.make_model(0).state_dict()
    runs = [
        train_assigned(
            state,
            wl,
            batches,
            num_examples=10,
            torch_seed=0,
            plan=None,
            window=None,
            lr=LR,
            measure=measure,
            proximal_mu=MU,
        ).state
        for measure in ("inline", "child")
    ]
    for k, v in runs[0].items():
        assert torch.equal(runs[1][k], v), k


def test_the_memory_model_counts_the_anchor_and_never_streams():
    from memory.cost import STREAM, predict
    from memory.proximal import anchor_bytes, anchored
    from server.assign import part_profile
    from wire.windows import workload_profiles

    wl = get_workload("gpt-tiny")
    profile = workload_profiles(wl)[1]
    params = sum(p.numel() * p.element_size() for p in wl.make_model(0).parameters())
    assert anchored(profile, 0.0) is profile
    held = anchored(profile, MU)
    assert held.batch_bytes - profile.batch_bytes == anchor_bytes(profile) == params
    assert all(STREAM not in b.options for b in held.blocks)
    plain = MemoryPlan.plain([b.name for b in profile.blocks])
    assert (
        predict(held, plain).peak_bytes >= predict(profile, plain).peak_bytes + params
    )
    # a part window anchors only what it trains: the window and the head
    part = part_profile(profile, 1, 2)
    trained = [b for b in part.blocks if b.grad_bytes > 0]
    assert 0 < anchor_bytes(part) == sum(b.param_bytes for b in trained) < params


def test_the_assigner_plans_with_the_anchor():
    """Under FedProx a node gets a plan priced with w0 and no streamed block, and a
    budget that fits the plain step only without the anchor no longer gets it."""
    import math

    from memory.cost import predict
    from server.assign import Assigner
    from wire.facts import NodeFacts

    wl = get_workload("gpt-byte")

    def assigner(mu):
        return Assigner(
            wl,
            wl.make_model(0),
            local_steps=1,
            runtime_reserve_bytes=0,
            train_time_s=math.inf,
            proximal_mu=mu,
        )

    plain, prox = assigner(0.0), assigner(MU)
    names = plain.names
    need = predict(plain.profile, MemoryPlan.plain(names)).peak_bytes
    facts = NodeFacts(budget_bytes=need, disk_budget_bytes=2**40)
    got = plain.assign(facts, 1)
    assert got.kind == "full" and got.plan is not None
    assert all(b.state == "resident" for b in got.plan.blocks)  # plain-like
    anchored_got = prox.assign(facts, 1)
    assert anchored_got.plan is not None
    assert anchored_got.plan != got.plan  # the same budget buys a leaner plan
    assert all(b.state != "stream" for b in anchored_got.plan.blocks)
    assert anchored_got.plan.predicted_peak_bytes <= need


@pytest.mark.child
def test_the_anchor_costs_what_the_model_says(tmp_path):
    """Measured in a child: FedProx's w0 raises the peak by about the parameters'
    bytes, the amount ``anchored`` adds (gpt-byte: 77 MB)."""
    from memory.proximal import anchor_bytes
    from wire.windows import workload_profiles

    wl, batches = _setup("gpt-byte", steps=2)
    state = wl.make_model(0).state_dict()
    peaks = [
        train_assigned(
            state,
            wl,
            batches,
            num_examples=10,
            torch_seed=0,
            plan=None,
            window=None,
            lr=LR,
            measure="child",
            offload_dir=str(tmp_path),
            proximal_mu=mu,
        ).peak_bytes
        for mu in (0.0, MU)
    ]
    anchor = anchor_bytes(workload_profiles(wl)[1])
    assert 0.8 * anchor <= peaks[1] - peaks[0] <= 1.2 * anchor, (peaks, anchor)
