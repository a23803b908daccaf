"""Transformers models built without their weights (``params_on_meta``) and read from
a state file unit by unit (``memory.materialize``): the same training as the model
built in memory, bit for bit, with streamed units going straight into the store."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from memory.errors import MemoryPlanError  # noqa: E402
from memory.materialize import (  # noqa: E402
    has_meta_parameters,
    params_on_meta,
    save_state,
)
from memory.spec import BlockPlan, MemoryPlan  # noqa: E402
from memory.step import PlannedTrainer, TrainSettings, units_by_name  # noqa: E402
from memory.tensorfile import TensorFile  # noqa: E402
from memory.units import find_units  # noqa: E402
from tests.hf.models import NAMES, build  # noqa: E402

STEPS = 3
SETTINGS = TrainSettings(lr=1e-3)  # no clipping: streamed updates run in backward


def _tied_groups(model, units) -> list[set[str]]:
    """Units that share a parameter (tied weights), as sets of unit names."""
    users: dict[int, set[str]] = {}
    for u in units:
        for p in u.module.parameters():
            users.setdefault(id(p), set()).add(u.name)
    return [g for g in users.values() if len(g) > 1]


def _alternate(model, units) -> MemoryPlan:
    """Every other unit streamed, and every unit tied to a streamed one."""
    streamed = {u.name for i, u in enumerate(units) if i % 2 == 0}
    for group in _tied_groups(model, units):
        if group & streamed:
            streamed |= group
    return MemoryPlan(
        tuple(
            BlockPlan(u.name, "recompute", "stream")
            if u.name in streamed
            else BlockPlan(u.name, "recompute" if i % 3 == 1 else "keep")
            for i, u in enumerate(units)
        )
    )


def _train(model, plan, units, x, y, source=None):
    """Losses of STEPS steps and the final state (copies)."""
    with PlannedTrainer(
        model, plan, units=units, settings=SETTINGS, init_state=source
    ) as tr:
        losses = [tr.step(x, y) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


@functools.cache
def _reference(name: str, tmp: str):
    """The model built in memory: its state file and plain training's results."""
    model, (x, y) = build(name)
    path = f"{tmp}/{name}.safetensors"
    save_state(model, path)
    units = find_units(model, x)
    plain = MemoryPlan.plain([u.name for u in units])
    return path, [u.name for u in units], _train(model, plain, units, x, y)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("states"))


@pytest.mark.parametrize("name", NAMES)
def test_meta_build_keeps_buffers_and_tied_weights(name: str) -> None:
    real, _ = build(name)
    with params_on_meta():
        model, (x, _y) = build(name)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # computed in __init__, kept
    for (n, b), (_, rb) in zip(model.named_buffers(), real.named_buffers()):
        assert torch.equal(b, rb), n
    assert not x["input_ids" if "input_ids" in x else "pixel_values"].is_meta
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    real_tied = {n for n, _ in real.named_parameters(remove_duplicate=False)} - {
        n for n, _ in real.named_parameters()
    }
    assert tied == real_tied
    # the patch is gone: a model built afterwards is in memory
    assert not has_meta_parameters(build(name)[0])


@pytest.mark.parametrize("name", NAMES)
def test_read_from_file_trains_as_built_in_memory(name: str, state_dir: str) -> None:
    path, unit_names, (ref_losses, ref_state) = _reference(name, state_dir)
    with params_on_meta():
        model, (x, y) = build(name)
    units = units_by_name(model, unit_names)
    plan = _alternate(model, units)
    assert any(b.state == "stream" for b in plan.blocks)
    with TensorFile(path) as source:
        losses, state = _train(model, plan, units, x, y, source)
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()
    for k in state:
        assert torch.equal(state[k], ref_state[k]), k


def test_plain_training_read_from_file(state_dir: str) -> None:
    """Every unit resident: ``materialize`` reads every weight, as load_state_dict."""
    from memory.materialize import materialize

    path, unit_names, (ref_losses, _) = _reference("gpt2", state_dir)
    with params_on_meta():
        model, (x, y) = build("gpt2")
    with TensorFile(path) as source:
        materialize(model, source)
    assert not has_meta_parameters(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    units = find_units(model, x)
    losses, _ = _train(model, MemoryPlan.plain([u.name for u in units]), units, x, y)
    assert losses == ref_losses


def test_bad_state_files_are_refused(state_dir: str, tmp_path) -> None:
    path, unit_names, _ = _reference("gpt2", state_dir)
    with params_on_meta():
        model, _ = build("gpt2")
    units = units_by_name(model, unit_names)
    plan = MemoryPlan.plain(unit_names)
    with pytest.raises(MemoryPlanError, match="meta device; give init_state"):
        PlannedTrainer(model, plan, units=units)
    with pytest.raises(MemoryPlanError, match="does not have"):
        units_by_name(model, ["transformer.h.99"])
    other, _ = build("llama")  # another model's file: names it lacks
    save_state(other, tmp_path / "llama.safetensors")
    with (
        TensorFile(tmp_path / "llama.safetensors") as source,
        pytest.raises(
            MemoryPlanError, match="the state file has no tensor 'transformer[.]"
        ),
    ):
        PlannedTrainer(model, plan, units=units, init_state=source)


@pytest.mark.parametrize("name", NAMES)
def test_units_found_without_weights(name: str, state_dir: str) -> None:
    """``find_units`` traces a model built without weights (on a fake copy whose
    parameters are fake CPU tensors): the same units as the model in memory."""
    _, unit_names, _ = _reference(name, state_dir)
    with params_on_meta():
        model, (x, _y) = build(name)
    assert [u.name for u in find_units(model, x)] == unit_names
    assert has_meta_parameters(model)  # untouched


def orthogonal_factory(width: int = 16):
    """A ``module:function`` factory whose build reads a parameter's values:
    ``parametrizations.orthogonal`` checks the weight as it registers (on ``meta``:
    ``Tensor.item() cannot be called on meta tensors``)."""
    from torch import nn

    model = nn.Sequential(
        nn.utils.parametrizations.orthogonal(nn.Linear(width, width)),
        nn.Tanh(),
        nn.Linear(width, 4),
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, width, generator=g), torch.randint(0, 4, (8,), generator=g)
    return model, (x, y), nn.functional.cross_entropy


def test_a_factory_that_reads_its_weights_is_built_for_real(tmp_path) -> None:
    """Issue 34, item 6: such a factory could not train at all, not even plainly,
    where fleetfit builds it without weights; it is built whole instead (from the same
    random state), the state file read into it, and trains as plain does."""
    from memory.materialize import build_without_weights, save_state
    from memory.step import train_measured

    with pytest.raises(Exception, match="meta"):
        with params_on_meta():
            orthogonal_factory()
    torch.manual_seed(3)
    (model, _, _), hollow = build_without_weights(orthogonal_factory)
    torch.manual_seed(3)
    again = orthogonal_factory()[0]
    assert not hollow and not has_meta_parameters(model)
    pairs = zip(model.state_dict().values(), again.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)
    path = str(tmp_path / "init.safetensors")
    torch.manual_seed(5)  # weights other than the run's own seed would build
    save_state(orthogonal_factory()[0], path)
    factory = "tests.memory.test_materialize:orthogonal_factory"
    own = train_measured(factory, {}, None, steps=3, seed=0)
    saved = train_measured(factory, {}, None, steps=3, seed=5)
    read = train_measured(factory, {}, None, steps=3, seed=0, init_state=path)
    assert read["losses"] == saved["losses"] != own["losses"]  # the file's weights
