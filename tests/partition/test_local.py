"""The one-device executor against plain training: same losses, same parameters.

Bit for bit where only data moves (keep / recompute / offload / streamed blocks: the
per-block AdamW runs torch's own per-element kernel); within a relative 1e-6 where the
order of sums changes (micro-batches, loss chunks). Those are compared in float64:
in float32, AdamW turns gradients that are pure rounding noise (the attention key
bias, whose true gradient is zero) into +-lr steps, so no reordering can stay within
1e-6 of plain there; in float64 the noise sits far below AdamW's eps.
"""

from __future__ import annotations

import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from memory.blocks import as_blocks
from memory.errors import MemoryPlanError, OffloadDirError
from memory.spec import BlockPlan, MemoryPlan
from partition.local import LocalExecutor
from workloads.models import GPT, GPTConfig
from workloads.registry import get_workload

STEPS = 3
MODES = {"k": "keep", "r": "recompute", "o": "offload"}


def _plan(names: list[str], specs: str, m: int = 1, chunks: int = 1) -> MemoryPlan:
    """One letter per block, cycled: k/r/o = keep/recompute/offload; capitals stream."""
    blocks = []
    for i, name in enumerate(names):
        c = specs[i % len(specs)]
        state = "stream" if c.isupper() else "resident"
        blocks.append(BlockPlan(name, MODES[c.lower()], state))
    return MemoryPlan(tuple(blocks), num_microbatches=m, loss_chunks=chunks)


def _batches(wl, dtype: torch.dtype, n: int = STEPS):
    it = wl.batches(wl.items(), 0)
    out = []
    for _ in range(n):
        x, y = next(it)
        out.append((x.to(dtype) if x.is_floating_point() else x, y))
    return out


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = {
        n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
    }
    sd.update({n: b.clone() for n, b in model.named_buffers()})
    return sd


def _plain(make, loss_fn, batches, lr: float = 1e-3):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, _state(model)


def _executor(make, loss_fn, batches, plan_of, tmp: Path, lr: float = 1e-3):
    model = make()
    plan = plan_of([b.name for b in as_blocks(model)])
    with LocalExecutor(model, loss_fn, plan, lr=lr, offload_dir=tmp) as ex:
        losses = [ex.step(x, y) for x, y in batches]
        sd = ex.state_dict()
    assert list(tmp.iterdir()) == [], "temporary files left behind"
    return losses, sd


def _assert_equal(got, want):
    (gl, gs), (wl, ws) = got, want
    assert gl == wl
    assert gs.keys() == ws.keys()
    for k in ws:
        assert torch.equal(gs[k], ws[k]), k


def _assert_close(got, want, rel: float = 1e-6):
    (gl, gs), (wl, ws) = got, want
    for a, b in zip(gl, wl, strict=True):
        assert abs(a - b) <= rel * abs(b)
    for k in ws:
        err = float((gs[k] - ws[k]).abs().max())
        scale = float(ws[k].abs().max())
        assert err <= rel * scale, f"{k}: max error {err:.3g}, max |value| {scale:.3g}"


WORKLOADS = ["digits-cnn", "digits-cnn-bn", "digits-mlp", "gpt-tiny"]
EXACT_PLANS = {
    "plain": "k",
    "recompute": "r",
    "offload": "o",
    "mixed": "kro",
    "stream": "R",
    "stream-mixed": "kRoK",
    "stream-last": "rkK",
}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name, dtype=torch.float32):
        if (name, dtype) not in cache:
            wl = get_workload(name)
            batches = _batches(wl, dtype)
            make = lambda: wl.make_model(0).to(dtype)  # noqa: E731
            cache[(name, dtype)] = (
                wl,
                make,
                batches,
                _plain(make, wl.loss_fn, batches),
            )
        return cache[(name, dtype)]

    return get


@pytest.mark.parametrize("plan", EXACT_PLANS)
@pytest.mark.parametrize("name", WORKLOADS)
def test_bit_identical_to_plain_training(name, plan, references, tmp_path):
    wl, make, batches, want = references(name)
    got = _executor(
        make, wl.loss_fn, batches, lambda ns: _plan(ns, EXACT_PLANS[plan]), tmp_path
    )
    _assert_equal(got, want)  # BatchNorm running statistics included


@pytest.mark.parametrize("name", ["digits-cnn", "digits-mlp", "gpt-tiny"])
@pytest.mark.parametrize("specs", ["k", "rKo"])
def test_microbatches_match_plain_within_1e_6(name, specs, references, tmp_path):
    wl, make, batches, want = references(name, torch.float64)
    got = _executor(
        make, wl.loss_fn, batches, lambda ns: _plan(ns, specs, m=4), tmp_path
    )
    _assert_close(got, want)
    wl, make, batches, want = references(name)  # float32: the losses
    got32 = _executor(
        make, wl.loss_fn, batches, lambda ns: _plan(ns, specs, m=2), tmp_path
    )
    _assert_close((got32[0], {}), (want[0], {}))


@pytest.mark.parametrize("specs", ["k", "ro", "rK", "R"])
def test_loss_chunks_match_plain_within_1e_6(specs, references, tmp_path):
    wl, make, batches, want = references("gpt-tiny", torch.float64)
    got = _executor(
        make, wl.loss_fn, batches, lambda ns: _plan(ns, specs, m=2, chunks=3), tmp_path
    )
    _assert_close(got, want)
    wl, make, batches, want = references("gpt-tiny")
    got32 = _executor(
        make, wl.loss_fn, batches, lambda ns: _plan(ns, specs, chunks=5), tmp_path
    )
    _assert_close((got32[0], {}), (want[0], {}))


# ------------------------------------------------------------------ tied weights

TIED = GPTConfig(
    vocab_size=64, context=16, d_model=32, num_layers=2, num_heads=2, tie_weights=True
)


def _tied_setup(dtype=torch.float32):
    def make():
        torch.manual_seed(0)
        return GPT(TIED).to(dtype)

    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(64, (4, 16), generator=g),
            torch.randint(64, (4, 16), generator=g),
        )
        for _ in range(STEPS)
    ]
    wl = get_workload("gpt-tiny")
    return make, wl.loss_fn, batches


@pytest.mark.parametrize(
    "specs", ["kKkk", "kkkK", "KkkK", "KRRK", "RkKK", "oKrK"], ids=lambda s: s
)
def test_tied_weights_exact(specs, tmp_path):
    make, loss_fn, batches = _tied_setup()
    model = make()
    assert model.head.proj.weight is model.embed.tok.weight
    want = _plain(make, loss_fn, batches)
    got = _executor(make, loss_fn, batches, lambda ns: _plan(ns, specs), tmp_path)
    _assert_equal(got, want)
    assert torch.equal(got[1]["head.proj.weight"], got[1]["embed.tok.weight"])


def test_tied_weights_streamed_with_microbatches(tmp_path):
    make, loss_fn, batches = _tied_setup(torch.float64)
    want = _plain(make, loss_fn, batches)
    got = _executor(make, loss_fn, batches, lambda ns: _plan(ns, "KrkK", m=2), tmp_path)
    _assert_close(got, want)


def test_tied_weights_unsupported_combination(tmp_path):
    make, loss_fn, _ = _tied_setup()
    model = make()
    plan = _plan([b.name for b in as_blocks(model)], "Kkkk")  # embed streamed, head not
    with pytest.raises(
        MemoryPlanError, match="'head' is resident but shares a parameter"
    ):
        LocalExecutor(model, loss_fn, plan, offload_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ errors, cleanup


def _mlp():
    wl = get_workload("digits-mlp")
    model = wl.make_model(0)
    return wl, model, [b.name for b in as_blocks(model)]


def test_streamed_parameters_leave_the_model(tmp_path):
    wl, model, names = _mlp()
    with LocalExecutor(
        model, wl.loss_fn, _plan(names, "kR"), offload_dir=tmp_path
    ) as ex:
        assert model[1][0].weight.numel() == 0  # block 1 streamed: its copy freed
        assert model[0][1].weight.numel() > 0
        files = list(tmp_path.rglob("*.bin"))
        assert len(files) == 1
        ex.step(*wl.example_batch())
    assert list(tmp_path.iterdir()) == []


def test_close_restore_gives_the_model_back(tmp_path):
    wl, model, names = _mlp()
    ex = LocalExecutor(model, wl.loss_fn, _plan(names, "R"), offload_dir=tmp_path)
    ex.step(*wl.example_batch())
    sd = ex.state_dict()
    ex.close(restore=True)
    ex.close()  # idempotent
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), sd[n])


def test_full_offload_dir_fails_before_training(tmp_path, monkeypatch):
    import memory.store as store_mod

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(
        store_mod.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 100)
    )
    wl, model, names = _mlp()
    with pytest.raises(OffloadDirError) as e:
        LocalExecutor(model, wl.loss_fn, _plan(names, "R"), offload_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "streamed block" in msg and "100 B free" in msg
    assert e.value.bytes_needed > 3 * sum(p.numel() * 4 for p in model.parameters())
    assert all(p.numel() > 0 for p in model.parameters())  # nothing was moved
    assert list(tmp_path.iterdir()) == []


@pytest.mark.child
def test_unwritable_offload_dir_fails_before_training(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        import subprocess

        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)],
            capture_output=True,
        )
        if r.returncode != 0:
            pytest.skip("root without mount: cannot make a read-only directory")
    else:
        ro.chmod(0o555)
    wl, model, names = _mlp()
    try:
        with pytest.raises(OffloadDirError, match="is not writable"):
            LocalExecutor(model, wl.loss_fn, _plan(names, "o"), offload_dir=ro)
    finally:
        if os.geteuid() == 0:
            import subprocess

            subprocess.run(["umount", str(ro)], check=False)
        else:
            ro.chmod(0o755)


def test_files_are_removed_when_a_step_fails(tmp_path):
    wl, model, names = _mlp()
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return wl.loss_fn(out, y)

    x, y = wl.example_batch()
    with pytest.raises(RuntimeError, match="boom"):
        with LocalExecutor(
            model, loss_fn, _plan(names, "oRK"), offload_dir=tmp_path
        ) as ex:
            ex.step(x, y)
            ex.step(x, y)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="previous step failed"):
        ex.step(x, y)


def test_bad_inputs_are_refused(tmp_path):
    wl, model, names = _mlp()
    with pytest.raises(MemoryPlanError, match="not the model's blocks"):
        LocalExecutor(model, wl.loss_fn, MemoryPlan.plain(names[:-1]))
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        LocalExecutor(model, wl.loss_fn, MemoryPlan.plain(names), optimizer="sgd")
    ex = LocalExecutor(model, wl.loss_fn, _plan(names, "k", m=3))
    x, y = wl.example_batch()
    with pytest.raises(ValueError, match="does not split into 3"):
        ex.step(x, y)


# ------------------------------------------------------------------ measured memory


def train_steps(workload: str, specs: str, steps: int, offload_dir: str) -> dict:
    """Measuring child: build the workload's model and train ``steps`` steps, plainly
    (``specs == "plain"``) or with the executor under a plan from ``specs``."""
    torch.set_num_threads(1)
    wl = get_workload(workload)
    it = wl.batches(wl.items(), 0)
    batches = [next(it) for _ in range(steps)]
    model = wl.make_model(0)
    if specs == "plain":
        losses, _ = _plain(lambda: model, wl.loss_fn, batches)
        return {"losses": losses}
    plan = _plan([b.name for b in as_blocks(model)], specs)
    with LocalExecutor(model, wl.loss_fn, plan, offload_dir=offload_dir) as ex:
        losses = [ex.step(x, y) for x, y in batches]
    return {"losses": losses}


@pytest.mark.child
def test_streamed_recompute_plan_measures_lower_peak_than_plain(tmp_path):
    from memory.measure import measure_in_child

    kw = {"workload": "gpt-byte", "steps": 2, "offload_dir": str(tmp_path)}
    plain = measure_in_child("test_local:train_steps", {**kw, "specs": "plain"})
    streamed = measure_in_child("test_local:train_steps", {**kw, "specs": "R"})
    mb = 2**20
    print(
        f"\ngpt-byte peak above baseline: plain {plain.peak_bytes / mb:.1f} MiB "
        f"({plain.wall_s:.1f} s), streamed+recompute {streamed.peak_bytes / mb:.1f} MiB "
        f"({streamed.wall_s:.1f} s); baseline {plain.baseline_bytes / mb:.1f} MiB"
    )
    assert streamed.result["losses"] == plain.result["losses"]
    assert streamed.peak_bytes < 0.6 * plain.peak_bytes
