"""A model built on the meta device and read block by block from a file trains exactly
like the model built in memory."""

import pytest
import torch
from safetensors.torch import load_file

from memory.blocks import as_blocks
from memory.errors import MemoryPlanError
from memory.spec import BlockPlan, MemoryPlan
from partition.local import LocalExecutor
from partition.run import save_batches, save_initial_state, train_workload
from workloads import get_workload


@pytest.fixture
def files(tmp_path):
    wl = get_workload("gpt-tiny")
    it = wl.batches(wl.items(), seed=1)
    batches = tmp_path / "batches.safetensors"
    save_batches(batches, [next(it) for _ in range(3)])
    init = tmp_path / "init.safetensors"
    save_initial_state("gpt-tiny", init, seed=3)
    return batches, init


@pytest.mark.parametrize("pattern", ["SSSS", "KSRK", "RRRR"])
def test_meta_init_equals_plain(files, tmp_path, pattern):
    batches, init = files
    names = [b.name for b in as_blocks(get_workload("gpt-tiny").make_model(0))]
    kinds = {
        "K": ("keep", "resident"),
        "R": ("recompute", "resident"),
        "S": ("recompute", "stream"),
    }
    plan = MemoryPlan(tuple(BlockPlan(n, *kinds[c]) for n, c in zip(names, pattern)))
    plain = train_workload(
        "gpt-tiny", str(batches), seed=3, save=str(tmp_path / "plain.safetensors")
    )
    meta = train_workload(
        "gpt-tiny",
        str(batches),
        seed=3,
        plan=plan.to_dict(),
        init_file=str(init),
        offload_dir=str(tmp_path),
        save=str(tmp_path / "meta.safetensors"),
    )
    assert meta["losses"] == plain["losses"]
    a = load_file(str(tmp_path / "plain.safetensors"))
    b = load_file(str(tmp_path / "meta.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_meta_model_without_init_state_is_refused(tmp_path):
    wl = get_workload("gpt-tiny")
    with torch.device("meta"):
        model = wl.make_model(0)
    plan = MemoryPlan.plain([b.name for b in as_blocks(model)])
    with pytest.raises(MemoryPlanError, match="no init_state"):
        LocalExecutor(model, wl.loss_fn, plan, offload_dir=tmp_path)


def test_init_state_with_wrong_shape_is_refused(tmp_path):
    wl = get_workload("gpt-tiny")
    with torch.device("meta"):
        model = wl.make_model(0)
    plan = MemoryPlan.plain([b.name for b in as_blocks(model)])
    with pytest.raises(MemoryPlanError, match="init_state gave"):
        LocalExecutor(model, wl.loss_fn, plan, init_state=lambda n: torch.zeros(3))
