"""Issue 34, item 4: on a causal LM with a ReLU MLP, a plan's losses equal plain's but
some saved weights differ by up to about one AdamW step. The evidence that this is
AdamW amplifying the rounding of a changed summation order, not a defect (GPT-2 with
ReLU, 4 micro-batches and 4 loss chunks, every unit recomputed, 3 steps):

- every gradient tensor of the plan is within 1e-5 of plain's, relative to its norm,
  at every step (here at most 6e-7), before each optimizer step;
- AdamW replayed on each run's own recorded gradients from the same start gives each
  run's weights: the trainer's update adds nothing of its own;
- the weights that differ (by up to 1.6e-5 here, 6 of 41 tensors) are where some
  step's gradient element was of rounding size (1e-10 to 1e-12 against tensor norms
  of 1e-2: an attention bias whose gradient cancels, a ReLU's dead unit), so its two
  runs' values differ relatively by far more than the tensors do, often in sign; and
  AdamW's update ``m / (sqrt(v) + eps)`` makes a step of up to ``lr`` of any
  gradient far above ``eps`` = 1e-8, whatever its size. SGD would keep such a
  difference at the gradients' rounding.
"""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from memory.step import PlannedTrainer, TrainSettings  # noqa: E402
from memory.units import find_units  # noqa: E402


def _run(microbatches: int, chunks: int):
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=512,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        activation_function="relu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = tf.GPT2LMHeadModel(cfg)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 512, (8, 32), generator=torch.Generator().manual_seed(1))
    x = {"input_ids": ids, "labels": ids}
    units = find_units(model, x)
    plan = MemoryPlan(
        tuple(BlockPlan(u.name, "recompute") for u in units),
        num_microbatches=microbatches,
        loss_chunks=chunks,
    )
    grads, losses = [], []
    with PlannedTrainer(
        model, plan, units=units, settings=TrainSettings(lr=1e-3)
    ) as tr:
        for _ in range(3):
            losses.append(tr.backward(x, None))
            grads.append({n: g.clone() for n, g in tr.gradients().items()})
            tr._calls += 1
            tr._update()
        tr.close()
    return losses, grads, dict(model.named_parameters()), start


def _replay(start: dict, grads: list[dict]) -> dict:
    """AdamW (torch's, the trainer's settings) applied to recorded gradients."""
    params = {n: torch.nn.Parameter(v.detach().clone()) for n, v in start.items()}
    s = TrainSettings(lr=1e-3)
    opt = torch.optim.AdamW(
        params.values(), lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay
    )
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone() if n in g else None
        opt.step()
    return params


def test_weights_differ_only_as_adamw_maps_rounding_size_gradient_differences():
    plain_losses, plain_grads, plain, start = _run(1, 1)
    losses, grads, planned, _ = _run(4, 4)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, plain_losses))
    worst = 0.0
    for step in range(3):
        for n, g in plain_grads[step].items():
            rel = float((grads[step][n] - g).norm() / g.norm())
            worst = max(worst, rel)
            assert rel <= 1e-5, (step, n, rel)
    # the optimizer did nothing else: AdamW replayed on each run's own gradients
    # from the same start gives each run's weights
    for run_grads, weights in ((plain_grads, plain), (grads, planned)):
        replayed = _replay(start, run_grads)
        for n, p in weights.items():
            assert torch.allclose(replayed[n], p, rtol=0, atol=1e-7), n
    # and the weights differ where a gradient element was of rounding size: there
    # its two runs' values differ relatively by far more than the tensors do
    big = [
        (float(d.max()), n, int(d.argmax()))
        for n, p in plain.items()
        if float((d := (planned[n] - p).detach().abs().flatten()).max()) > 1e-6
    ]
    assert big, "no weight differs: the effect the issue saw is not reproduced"
    assert max(b[0] for b in big) <= 3e-3  # at most a few AdamW steps of lr 1e-3
    for _, n, i in big:
        ratio = max(
            abs(float(grads[t][n].flatten()[i] - plain_grads[t][n].flatten()[i]))
            / (abs(float(plain_grads[t][n].flatten()[i])) + 1e-30)
            for t in range(3)
        )
        assert ratio > 100 * worst, (n, i, ratio, worst)
