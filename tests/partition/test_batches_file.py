"""The batches file handed to a measured child holds tensors that share memory.

A custom workload returns one example batch and trains it at every step, so the
batches of a run are the same tensors several times; a batch's inputs and targets may
also be views of one storage. safetensors refuses both: ``save_batches`` writes each
distinct tensor once and ``load_batches`` gives every step its batch back, bit for bit.
"""

import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from client.train import draw_batches, train_assigned
from memory.blocks import as_blocks
from memory.spec import BlockPlan, MemoryPlan
from partition.run import load_batches, measured_run, save_batches
from workloads import get_workload

MODULE = "fleetfit_batches_file_job"
SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        x = torch.randn(6, 4)
        y = torch.randint(3, (6,))
        return model, (x, y), nn.functional.cross_entropy

    def sliced():
        # inputs and targets overlap in one storage: predict the next row
        torch.manual_seed(6)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        rows = torch.randn(7, 4)
        return model, (rows[:-1], rows[1:]), nn.functional.mse_loss
    """
)


@pytest.fixture
def job(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))  # measure_in_child passes sys.path on
    yield MODULE
    sys.modules.pop(MODULE, None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(loaded, original):
    assert len(loaded) == len(original)
    for (lx, ly), (ox, oy) in zip(loaded, original):
        for a, b in ((lx, ox), (ly, oy)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b))


def _plain_losses(spec: str, steps: int, lr: float = 1e-3) -> list[float]:
    """What training the example batch ``steps`` times in this process gives."""
    wl = get_workload(spec)
    x, y = wl.example_batch()
    model = wl.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_example_batch_is_written_once_and_read_back_per_step(job, tmp_path):
    wl = get_workload(f"{job}:build")
    stream = wl.batches(wl.items(train=True), seed=0)
    batches = [next(stream) for _ in range(3)]
    path = tmp_path / "batches.safetensors"
    save_batches(path, batches)
    with safe_open(str(path), framework="pt") as f:
        assert len(list(f.keys())) == 2  # one inputs and one targets tensor
    loaded = load_batches(path)
    _assert_same(loaded, batches)
    _assert_same(loaded, [wl.example_batch()] * 3)
    # the child holds the batch once, as the training job does
    assert all(b[0] is loaded[0][0] and b[1] is loaded[0][1] for b in loaded)


def _cases() -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 4, generator=g)
    x = torch.randn(5, 3, generator=g)
    grid = torch.randn(4, 6, generator=g)
    ints = torch.randint(100, (8,), generator=g)
    other = (torch.randn(5, 3, generator=g), torch.randint(3, (5,), generator=g))
    return {
        "overlapping slices": [(rows[:-1], rows[1:])] * 2,
        "disjoint slices": [(rows[:3], rows[3:6])],
        "same tensor twice": [(x, x), (x, x)],
        "non-contiguous views": [(grid.T, grid[:, ::2]), (grid, grid.T)],
        "views of another dtype": [(ints, ints.view(torch.float64)[:2])],
        "slices shared across steps": [(rows[:2], rows[2]), (rows[1:3], rows[3])],
        "distinct batches": [(x, ints), other],
        "empty": [(rows[:0], rows[7:]), (x[:0], x[:0])],
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_tensors_sharing_memory_round_trip_bit_for_bit(case, tmp_path):
    batches = _cases()[case]
    path = tmp_path / "batches.safetensors"
    save_batches(path, batches)
    _assert_same(load_batches(path), batches)


def test_files_of_one_tensor_per_key_still_load(tmp_path):
    batches = [(torch.randn(2, 3), torch.tensor([0, 1])) for _ in range(2)]
    path = tmp_path / "old.safetensors"
    tensors = {}
    for i, (x, y) in enumerate(batches):
        tensors[f"inputs.{i}"], tensors[f"targets.{i}"] = x, y
    save_file(tensors, str(path))
    _assert_same(load_batches(path), batches)


@pytest.mark.child
@pytest.mark.parametrize(
    ("fn", "planned", "steps"), [("build", False, 3), ("sliced", True, 2)]
)
def test_memory_run_trains_the_example_batch_for_several_steps(job, fn, planned, steps):
    """``fleetfit memory run --steps N`` (``measured_run``), plainly or under a plan."""
    spec = f"{job}:{fn}"
    plan = None
    if planned:
        names = [b.name for b in as_blocks(get_workload(spec).make_model(0))]
        kinds = [("keep", "resident"), ("recompute", "stream")]
        plan = MemoryPlan(
            tuple(BlockPlan(n, *kinds[i % 2]) for i, n in enumerate(names))
        )
    _, result = measured_run(spec, plan, steps=steps)
    assert result["losses"] == pytest.approx(_plain_losses(spec, steps), rel=1e-5)


@pytest.mark.child
def test_client_trains_the_example_batch_in_a_child(job):
    wl = get_workload(f"{job}:sliced")
    batches, n, torch_seed = draw_batches(
        wl, 0, 2, split="iid", alpha=0.5, seed=0, server_round=1, local_steps=2
    )
    state = wl.make_model(0).state_dict()
    kw = dict(num_examples=n, torch_seed=torch_seed, plan=None, window=None, lr=1e-3)
    child = train_assigned(state, wl, batches, measure="child", **kw)
    inline = train_assigned(state, wl, batches, measure="inline", **kw)
    assert child.steps == inline.steps == 2
    assert child.mean_loss == pytest.approx(inline.mean_loss, rel=1e-6)
    assert child.state.keys() == inline.state.keys()
    for k, v in inline.state.items():
        torch.testing.assert_close(child.state[k], v)
