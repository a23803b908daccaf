"""memory's mechanisms on their own: recompute, activation offload, the block store."""

from __future__ import annotations

import copy
import os
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from memory.errors import MemoryPlanError, OffloadDirError
from memory.offload import ActivationOffload
from memory.recompute import checkpoint_block, forward_no_grad, recompute
from memory.store import BlockStore, check_directory
from workloads.models import GPT_PRESETS, TransformerLayer


def _bn_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())


def _layer() -> nn.Module:
    torch.manual_seed(0)
    return TransformerLayer(GPT_PRESETS["gpt-tiny"])


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters()]


def _reference(
    m: nn.Module, x: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    x = x.clone().requires_grad_(True)
    m(x).square().sum().backward()
    return _grads(m), x.grad


@pytest.mark.parametrize(
    "make,shape", [(_bn_block, (4, 3, 6, 6)), (_layer, (2, 16, 64))]
)
def test_checkpoint_block_is_bit_identical_and_updates_buffers_once(make, shape):
    x = torch.randn(shape)
    ref = make()
    want_grads, want_xgrad = _reference(ref, x)
    m = make()
    xx = x.clone().requires_grad_(True)
    checkpoint_block(m, xx, m).square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(m), want_grads, strict=True))
    assert torch.equal(xx.grad, want_xgrad)
    for a, b in zip(m.buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)  # running stats and num_batches_tracked: one update


def test_no_grad_forward_then_recompute_matches_with_dropout_and_batchnorm():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.3))

    x = torch.randn(8, 16)
    ref = make()
    torch.manual_seed(5)
    want_out = ref(x.clone().requires_grad_(True))
    want_out.square().sum().backward()
    m = make()
    torch.manual_seed(5)
    out, record = forward_no_grad(m, x)
    after_forward = torch.get_rng_state()
    assert torch.equal(out, want_out.detach())
    leaf, out2 = recompute(m, record, m, input_requires_grad=True)
    assert torch.equal(torch.get_rng_state(), after_forward)  # RNG as after one forward
    out2.square().sum().backward()
    assert torch.equal(out2, out)
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(m.buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)
    assert leaf.grad is not None


def test_offload_is_bit_identical_keeps_parameters_and_removes_its_file(tmp_path):
    x = torch.randn(2, 16, 64)
    ref = _layer()
    want_grads, want_xgrad = _reference(ref, x)
    m = _layer()
    xx = x.clone().requires_grad_(True)
    acts = ActivationOffload(tmp_path).activations("1.0", keep=[*m.parameters(), xx])
    with acts.hooks():
        out = m(xx)
    acts.commit(out)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].stat().st_size == acts.bytes_offloaded > 0
    param_bytes = sum(p.numel() * 4 for p in m.parameters())
    # saved activations of one layer at this shape are far smaller than its weights:
    # had weights been offloaded, the file would be larger than this
    assert acts.bytes_offloaded < param_bytes
    out.square().sum().backward()
    acts.release()
    assert list(tmp_path.iterdir()) == []
    assert all(torch.equal(a, b) for a, b in zip(_grads(m), want_grads, strict=True))
    assert torch.equal(xx.grad, want_xgrad)


def test_offload_writes_a_shared_storage_once(tmp_path):
    base = torch.randn(64, 96, requires_grad=True)
    acts = ActivationOffload(tmp_path, min_bytes=0).activations("s", keep=[base])
    with acts.hooks():
        h = base * 2  # one storage
        q, k, v = h.split(32, dim=-1)
        y = (q * k).sum() + (v * v).sum()  # saves views of h only
    acts.commit(y)
    assert acts.bytes_offloaded == h.numel() * 4
    y.backward()
    acts.release()
    base2 = base.detach().clone().requires_grad_(True)
    q2, k2, v2 = (base2 * 2).split(32, dim=-1)
    ((q2 * k2).sum() + (v2 * v2).sum()).backward()
    assert torch.equal(base.grad, base2.grad)


# ------------------------------------------------------------------ store


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile")


@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 4096])
def test_store_adamw_equals_torch_adamw(tmp_path, chunk_bytes):
    torch.manual_seed(0)
    params = [torch.randn(300, 70), torch.randn(70), torch.randn(5, 3, 3)]
    ref = [nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2)
    store = BlockStore(tmp_path, chunk_bytes=chunk_bytes)
    store.add(0, params)
    for step in range(4):
        gs = [torch.randn_like(p) for p in params]
        for r, g in zip(ref, gs, strict=True):
            r.grad = g.clone()
        if step == 2:  # a parameter without a gradient is skipped, as AdamW does
            ref[1].grad = None
            gs[1] = None
        opt.step()
        views = store.load(0)
        store.adamw_step(
            0, views, [None if g is None else g.clone() for g in gs], lr=1e-2
        )
        del views
        store.flush(0)
    got = store.read(0)
    states = store.read_state(0)
    for r, g, st in zip(ref, got, states, strict=True):
        assert torch.equal(r.detach(), g)
        assert torch.equal(opt.state[r]["exp_avg"], st["exp_avg"])
        assert torch.equal(opt.state[r]["exp_avg_sq"], st["exp_avg_sq"])
        assert float(opt.state[r]["step"]) == float(st["step"])
    store.close()
    assert not store.root.exists()


def test_store_accumulated_gradients_add_to_the_last_one(tmp_path):
    torch.manual_seed(0)
    p = torch.randn(50, 20)
    g0, g1, g2 = (torch.randn_like(p) for _ in range(3))
    ref = nn.Parameter(p.clone())
    ref.grad = g0.clone()
    ref.grad += g1
    ref.grad += g2
    torch.optim.AdamW([ref], lr=1e-3).step()
    store = BlockStore(tmp_path)
    store.add(0, [p], with_grads=True)
    store.accumulate_grads(0, {0: g0})
    store.accumulate_grads(0, {0: g1})
    views = store.load(0)
    store.adamw_step(0, views, [g2.clone()], lr=1e-3)
    del views
    assert not store.has_grads(0)
    assert torch.equal(store.read(0)[0], ref.detach())
    store.close()


def test_store_mapping_leaves_rss_when_views_are_dropped(tmp_path):
    store = BlockStore(tmp_path)
    big = torch.randn(8 * 2**20 // 4)  # 8 MiB
    store.add(0, [big])
    before = _rss_file_kb()
    views = store.load(0)
    assert torch.equal(views[0], big)  # touches every page
    mapped = _rss_file_kb()
    views[0].mul_(2)
    del views
    store.flush(0)
    after = _rss_file_kb()
    assert mapped - before > 6 * 1024, (before, mapped)
    assert after - before < 1024, (before, mapped, after)
    assert torch.equal(store.read(0)[0], big * 2)
    store.close()


def test_bytes_needed_covers_the_file(tmp_path):
    ts = [torch.randn(1000, 3), torch.randn(17)]
    store = BlockStore(tmp_path)
    store.add(0, ts)
    store.add(1, ts, with_grads=True)
    assert store.nbytes == BlockStore.bytes_needed(ts) + BlockStore.bytes_needed(
        ts, with_grads=True
    )
    store.close()


# ------------------------------------------------------------------ directory checks


def test_full_directory_is_reported_with_numbers_and_fix(tmp_path, monkeypatch):
    import memory.store as store_mod

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        store_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000)
    )
    with pytest.raises(OffloadDirError) as e:
        check_directory(tmp_path, 5 * 10**6, what="2 streamed blocks")
    msg = str(e.value)
    assert str(tmp_path) in msg and "5000000 bytes" in msg and "1000 B free" in msg
    assert "choose another directory" in msg
    assert e.value.bytes_needed == 5 * 10**6 and e.value.bytes_free == 1000
    assert isinstance(e.value, MemoryPlanError)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
        capture_output=True,
    )
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.child
def test_really_full_directory(tiny_tmpfs):
    with pytest.raises(OffloadDirError, match="free but the plan needs"):
        check_directory(tiny_tmpfs, 10 * 2**20, what="activations")
    assert check_directory(tiny_tmpfs, 1024, what="activations") == tiny_tmpfs


@pytest.mark.child
def test_unwritable_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = False
    if os.geteuid() == 0:  # root writes through permission bits: mount read-only
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
            capture_output=True,
        )
        if r.returncode != 0:
            pytest.skip("root without mount: cannot make a read-only directory")
        mounted = True
    else:
        ro.chmod(0o555)
    try:
        with pytest.raises(OffloadDirError, match="is not writable") as e:
            check_directory(ro, 1000, what="activations")
        assert str(ro) in str(e.value) and "1000 bytes" in str(e.value)
        assert list(ro.iterdir()) == []
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=False)
        else:
            ro.chmod(0o755)


def test_directory_under_a_file_is_reported(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OffloadDirError, match="not writable"):
        check_directory(f / "sub", 10, what="activations")


def test_checkpoint_block_on_deepcopy_does_not_touch_original():
    m = _bn_block()
    snap = copy.deepcopy(m.state_dict())
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    checkpoint_block(m, x, m).sum().backward()
    # one update (not zero, not two): differs from the snapshot by exactly one step
    ref = _bn_block()
    ref(x.detach())
    assert not torch.equal(m[1].running_mean, snap["1.running_mean"])
    assert torch.equal(m[1].running_mean, ref[1].running_mean)
    assert int(m[1].num_batches_tracked) == 1


def _dense_embedding_grad(table: torch.Tensor, ids: torch.Tensor, out_grad):
    w = table.clone().requires_grad_(True)
    torch.nn.functional.embedding(ids, w).backward(out_grad)
    return w.grad


def _sparse_embedding_grad(table: torch.Tensor, ids: torch.Tensor, out_grad):
    w = table.clone().requires_grad_(True)
    torch.nn.functional.embedding(ids, w, sparse=True).backward(out_grad)
    return w.grad


def test_store_sums_sparse_lookup_gradients_as_the_dense_backward(tmp_path):
    """Repeated tokens, two backwards, a row no lookup touched: the accumulator holds
    what the dense embedding backward gives, bit for bit."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 7, generator=g)
    store = BlockStore(tmp_path)
    store.add(0, [table], with_grads=True)
    want = None
    for step in range(2):
        ids = torch.randint(0, 40, (3, 33), generator=g)  # rows 40-49 untouched
        ids[0, :5] = 3  # one row many times
        out_grad = torch.randn(3, 33, 7, generator=g)
        dense = _dense_embedding_grad(table, ids, out_grad)
        want = dense if want is None else want + dense
        store.accumulate_sparse(0, 0, _sparse_embedding_grad(table, ids, out_grad))
        assert store.has_grad(0, 0)
        assert torch.equal(store.stored_grad(0, 0), want), step
    assert not store.stored_grad(0, 0)[40:].any()
    store.close()


def test_store_rows_read_and_accumulate_in_place(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(10, 4, generator=g)
    store = BlockStore(tmp_path)
    store.add(0, [w], with_grads=True)
    assert torch.equal(store.load_rows(0, 0, 3, 7), w[3:7])
    parts = [torch.randn(10, 4, generator=g) for _ in range(2)]
    for i, grad in enumerate(parts):
        for a, b in ((0, 4), (4, 10)):
            store.accumulate_rows(0, 0, a, b, grad[a:b], first=i == 0)
        store.rows_done(0, 0)
    assert torch.equal(store.stored_grad(0, 0), parts[0] + parts[1])
    # a sparse gradient after rows adds to them (a tied head, then its embedding)
    ids = torch.tensor([[1, 1, 9]])
    og = torch.randn(1, 3, 4, generator=g)
    store.accumulate_sparse(0, 0, _sparse_embedding_grad(w, ids, og))
    want = parts[0] + parts[1] + _dense_embedding_grad(w, ids, og)
    assert torch.equal(store.stored_grad(0, 0), want)
    store.close()
