"""memory.chunked_loss: a linear + cross-entropy head that never holds the full logits."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memory.chunked_loss import (
    HeadChunkBytes,
    causal_lm_targets,
    chunked_linear_cross_entropy,
    head_chunk_bytes,
)

IGNORE = -100


def _data(n=37, v=50, d=16, dtype=torch.float64, seed=0, ignored=(2, 5, 11, 30)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_(True)
    w = (0.5 * torch.randn(v, d, generator=g, dtype=dtype)).requires_grad_(True)
    b = (0.1 * torch.randn(v, generator=g, dtype=dtype)).requires_grad_(True)
    y = torch.randint(0, v, (n,), generator=g)
    y[[i for i in ignored if i < n]] = IGNORE
    return h, w, b, y


def _grads(loss, *ts):
    return torch.autograd.grad(loss, [t for t in ts if t is not None])


def _reference(h, w, b, y, **kw):
    return F.cross_entropy(F.linear(h, w, b), y, ignore_index=IGNORE, **kw)


def _close(got, want, rtol):
    # relative to the tensor's scale: elementwise relative error means nothing at ~0
    torch.testing.assert_close(
        got, want, rtol=rtol, atol=rtol * float(want.detach().abs().max()) + 1e-30
    )


# --------------------------------------------------------------------------- equality
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("vocab_chunks", [1, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_unchunked_in_float64(chunks, vocab_chunks, with_bias):
    h, w, b, y = _data()  # N = 37: no chunk count divides it
    b = b if with_bias else None
    ref = _reference(h, w, b, y)
    got = chunked_linear_cross_entropy(
        h, w, b, y, chunks=chunks, vocab_chunks=vocab_chunks
    )
    assert got.dtype == torch.float64
    _close(got, ref, 1e-10)
    for g, r in zip(_grads(got, h, w, b), _grads(ref, h, w, b)):
        _close(g, r, 1e-10)


@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("vocab_chunks", [1, 3])
def test_matches_unchunked_in_float32(chunks, vocab_chunks):
    h, w, b, y = _data(n=203, v=301, d=32, dtype=torch.float32, seed=1)
    ref = _reference(h, w, b, y)
    got = chunked_linear_cross_entropy(
        h, w, b, y, chunks=chunks, vocab_chunks=vocab_chunks
    )
    assert got.dtype == torch.float32
    _close(got, ref, 1e-6)
    for g, r in zip(_grads(got, h, w, b), _grads(ref, h, w, b)):
        _close(g, r, 1e-5)


def test_leading_dims_are_flattened_and_grad_output_scales():
    h, w, b, y = _data(n=24)
    h3 = h.detach().reshape(2, 12, -1).requires_grad_(True)
    y3 = y.reshape(2, 12)
    got = 3.0 * chunked_linear_cross_entropy(h3, w, b, y3, chunks=5)
    ref = 3.0 * _reference(h3.reshape(24, -1), w, b, y)
    _close(got, ref, 1e-10)
    gg, gr = _grads(got, h3, w, b), _grads(ref, h3, w, b)
    assert gg[0].shape == h3.shape
    for g, r in zip(gg, gr):
        _close(g, r, 1e-10)


def test_an_all_ignored_chunk_and_more_chunks_than_rows():
    h, w, b, y = _data(n=12, ignored=range(0, 6))  # chunks=2: the first one ignored
    ref = _reference(h, w, b, y)
    ref_grads = _grads(ref, h, w, b)
    for chunks in (2, 40):
        got = chunked_linear_cross_entropy(h, w, b, y, chunks=chunks)
        _close(got, ref, 1e-10)
        gh, gw, gb = _grads(got, h, w, b)
        assert torch.all(gh[:6] == 0)  # ignored rows get no gradient
        for g, r in zip((gh, gw, gb), ref_grads):
            _close(g, r, 1e-10)


def test_all_labels_ignored_gives_nan_like_the_mean():
    h, w, b, y = _data(n=8, ignored=range(8))
    got = chunked_linear_cross_entropy(h, w, b, y, chunks=3)
    assert torch.isnan(got) and torch.isnan(_reference(h, w, b, y))
    # with a count given the loss is 0, and so are the gradients
    got = chunked_linear_cross_entropy(h, w, b, y, chunks=3, reduction_count=8)
    assert float(got.detach()) == 0.0
    assert all(torch.all(g == 0) for g in _grads(got, h, w, b))


def test_frozen_weight_gets_no_gradient_and_saves_its_bytes():
    h, w, b, y = _data()
    w.requires_grad_(False)
    loss = chunked_linear_cross_entropy(h, w, b, y, chunks=3)
    loss.backward()
    assert w.grad is None and h.grad is not None and b.grad is not None
    _close(h.grad, torch.autograd.grad(_reference(h, w, b, y), h)[0], 1e-10)
    # a frozen head and frozen input: nothing requires grad, no graph at all
    h2 = h.detach()
    b2 = b.detach()
    assert not chunked_linear_cross_entropy(h2, w, b2, y, chunks=3).requires_grad


def test_tied_weight_gradient_sums_both_uses():
    torch.manual_seed(3)
    v, d = 40, 12
    emb = torch.nn.Embedding(v, d).double()
    proj = torch.nn.Linear(d, d).double()
    ids = torch.randint(0, v, (3, 9))
    y = torch.randint(0, v, (3, 9))
    y[0, :4] = IGNORE

    def run(head):
        emb.zero_grad()
        proj.zero_grad()
        hidden = torch.tanh(proj(emb(ids)))
        head(hidden).backward()
        return emb.weight.grad.clone(), proj.weight.grad.clone()

    got = run(
        lambda hd: chunked_linear_cross_entropy(hd, emb.weight, None, y, chunks=4)
    )
    want = run(
        lambda hd: F.cross_entropy(
            F.linear(hd, emb.weight).flatten(0, 1), y.flatten(), ignore_index=IGNORE
        )
    )
    for g, r in zip(got, want):
        _close(g, r, 1e-10)
    # both uses contribute: the head-only gradient differs from the total
    hidden = torch.tanh(proj(emb(ids))).detach()
    head_only = torch.autograd.grad(
        chunked_linear_cross_entropy(hidden, emb.weight, None, y, chunks=4),
        emb.weight,
    )[0]
    assert not torch.allclose(head_only, got[0])


def test_reduction_count_weights_micro_batches():
    h, w, b, y = _data(n=40, ignored=(1, 2, 3, 25))
    total = int((y != IGNORE).sum())
    whole = chunked_linear_cross_entropy(h, w, b, y, chunks=3)
    halves = sum(
        chunked_linear_cross_entropy(h[s], w, b, y[s], chunks=3, reduction_count=total)
        for s in (slice(0, 17), slice(17, 40))
    )
    _close(halves, whole, 1e-12)
    _close(whole, _reference(h, w, b, y), 1e-10)
    for g, r in zip(_grads(halves, h, w, b), _grads(whole, h, w, b)):
        _close(g, r, 1e-12)
    # an explicit count is a plain divisor of the sum
    s = chunked_linear_cross_entropy(h, w, b, y, chunks=2, reduction_count=7)
    _close(s, _reference(h, w, b, y, reduction="sum") / 7, 1e-10)


def test_bfloat16_is_computed_in_float32():
    h, w, b, y = _data(n=64, v=96, d=32, dtype=torch.float32, seed=4)
    hb, wb, bb = (t.detach().bfloat16().requires_grad_(True) for t in (h, w, b))
    got = chunked_linear_cross_entropy(hb, wb, bb, y, chunks=3, vocab_chunks=2)
    assert got.dtype == torch.float32  # as transformers upcasts its logits
    # the float32 loss of the bfloat16 logits
    ref = _reference(hb.float(), wb.float(), bb.float(), y)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    got.backward()
    gr = _grads(ref, hb, wb, bb)
    for t, r in zip((hb, wb, bb), gr):
        assert t.grad is not None and t.grad.dtype == torch.bfloat16
        rel = (t.grad.float() - r.float()).norm() / r.float().norm()
        assert rel < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    h, w, b, y = _data(n=97, v=257, d=32, dtype=torch.float32)
    cpu = chunked_linear_cross_entropy(h, w, b, y, chunks=4, vocab_chunks=2)
    hc, wc, bc = (t.detach().cuda().requires_grad_(True) for t in (h, w, b))
    got = chunked_linear_cross_entropy(hc, wc, bc, y.cuda(), chunks=4, vocab_chunks=2)
    torch.testing.assert_close(got.cpu(), cpu, rtol=1e-5, atol=1e-6)
    for g, r in zip(_grads(got, hc, wc, bc), _grads(cpu, h, w, b)):
        _close(g.cpu(), r, 1e-4)


# --------------------------------------------------------------------------- transformers
def test_equals_gpt2_loss_with_causal_targets():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=211,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 17))
    labels = ids.clone()
    labels[1, 12:] = IGNORE  # padding
    labels[2, 0] = IGNORE

    want = model(input_ids=ids, labels=labels).loss
    want.backward()
    want_grad = model.transformer.wte.weight.grad.clone()
    model.zero_grad()

    hidden = model.transformer(input_ids=ids).last_hidden_state
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    got = chunked_linear_cross_entropy(
        hidden.flatten(0, -2),
        model.lm_head.weight,
        None,
        causal_lm_targets(labels),
        chunks=5,
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    got.backward()
    _close(model.transformer.wte.weight.grad, want_grad, 1e-5)


def test_causal_lm_targets_shift():
    labels = torch.tensor([[1, 2, 3], [4, 5, IGNORE]])
    assert causal_lm_targets(labels).tolist() == [2, 3, IGNORE, 5, IGNORE, IGNORE]
    assert causal_lm_targets(torch.tensor([7, 8], dtype=torch.int32), -1).tolist() == [
        8,
        -1,
    ]
    assert causal_lm_targets(labels).dtype == torch.int64
    for bad in (torch.tensor(3), torch.zeros(2, 3), [1, 2]):
        with pytest.raises(ValueError, match="labels"):
            causal_lm_targets(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- memory
class _LiveBytes(TorchDispatchMode):
    """Live bytes of every storage an op creates, and their peak since ``reset``."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._refs:
            return
        nbytes = st.nbytes()

        def freed(_r: object, k: int = key, n: int = nbytes) -> None:
            self._freed(k, n)

        self._refs[key] = weakref.ref(st, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def reset(self) -> int:
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.track(t)
        return out


def _peaks(head, h, w, b, y):
    """(forward peak, backward peak above its start, whole-step peak), bytes."""
    tracker = _LiveBytes()
    with tracker:
        for t in (h, w, b, y):
            if t is not None:
                tracker.track(t)
        start = tracker.reset()
        loss = head(h, w, b, y)
        fwd = tracker.peak - start
        step_peak = tracker.peak
        level = tracker.reset()
        loss.backward()
        bwd = tracker.peak - level
        step_peak = max(step_peak, tracker.peak)
    return fwd, bwd, step_peak - start


def _tensors(n, v, d, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_(True)
    w = (0.1 * torch.randn(v, d, generator=g)).to(dtype).requires_grad_(True)
    b = torch.zeros(v, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = IGNORE
    return h, w, b, y


@pytest.mark.parametrize(
    "n, v, d, chunks, vocab_chunks, dtype, bias, frozen",
    [
        (1024, 8192, 64, 8, 1, torch.float32, True, False),
        (1024, 8192, 64, 4, 4, torch.float32, False, False),
        (1024, 8192, 64, 8, 1, torch.float32, True, True),
        (256, 4096, 32, 4, 2, torch.bfloat16, True, False),
    ],
)
def test_head_chunk_bytes_matches_tracked_peaks(
    n, v, d, chunks, vocab_chunks, dtype, bias, frozen
):
    h, w, b, y = _tensors(n, v, d, dtype, bias)
    if frozen:
        w.requires_grad_(False)
    fwd, bwd, _ = _peaks(
        lambda *a: chunked_linear_cross_entropy(
            *a, chunks=chunks, vocab_chunks=vocab_chunks
        ),
        h,
        w,
        b,
        y,
    )
    est = head_chunk_bytes(
        n,
        v,
        chunks,
        dtype.itemsize,
        vocab_chunks=vocab_chunks,
        hidden_size=d,
        weight_grad=not frozen,
        bias=bias,
    )
    assert isinstance(est, HeadChunkBytes)
    assert fwd == pytest.approx(est.forward_bytes, rel=0.10)
    assert bwd == pytest.approx(est.backward_bytes, rel=0.10)


def test_chunked_peak_is_a_fraction_of_the_unchunked_one():
    n, v, d = 1024, 8192, 64
    h, w, b, y = _tensors(n, v, d)
    chunked = _peaks(lambda *a: chunked_linear_cross_entropy(*a, chunks=8), h, w, b, y)
    full = _peaks(lambda *a: _reference(*a), h, w, b, y)
    logits = n * v * 4
    assert full[0] >= 2 * logits  # the logits and their log-softmax
    assert chunked[0] < full[0] / 4  # forward
    assert chunked[1] < full[1] / 4  # backward
    assert chunked[2] < full[2] / 4  # the whole step
    # the gradient of the whole head must exist in both
    assert chunked[1] >= (n * d + v * d + v) * 4


def test_head_chunk_bytes_arithmetic_and_errors():
    # GPT-2 small, 4 x 512 tokens, fp32: one 256-row block instead of 411 MB
    est = head_chunk_bytes(2048, 50257, 8, hidden_size=768)
    assert est.forward_bytes == 2048 * 13 + 256 * 50257 * 4 + 256 * 64
    assert est.grad_bytes == (2048 + 50257) * 768 * 4
    assert est.backward_bytes == est.grad_bytes + 256 * 50257 * 4 + 256 * 64
    assert head_chunk_bytes(2048, 50257, 8, 2).forward_bytes == (
        2048 * 13 + 256 * 50257 * 6 + 256 * 64
    )
    assert head_chunk_bytes(0, 10, 2) == HeadChunkBytes(0, 0, 0)
    with pytest.raises(ValueError, match="chunks"):
        head_chunk_bytes(10, 10, 0)
    with pytest.raises(ValueError, match="vocab"):
        head_chunk_bytes(10, 0, 1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        head_chunk_bytes(10, 10, 1, 3)


# --------------------------------------------------------------------------- errors
def _bad_calls():
    h, w, b, y = _data(n=6, v=5, d=4)
    return [
        (dict(hidden=h[0]), "hidden"),
        (dict(hidden=h.long()), "floating"),
        (dict(weight=w[:, :3]), "weight"),
        (dict(weight=w.float()), "dtype"),
        (dict(bias=b[:4]), "bias"),
        (dict(bias=b.float()), "bias dtype"),
        (dict(labels=y.int()), "int64"),
        (dict(labels=y[:5]), "labels shape"),
        (dict(labels=torch.tensor([0, 1, 2, 3, 4, 5])), r"\[0, 5\).*found 5"),
        (dict(labels=torch.tensor([0, -1, 2, 3, 4, 1])), "found -1"),
        (dict(chunks=0), "chunks"),
        (dict(chunks=2.0), "chunks"),
        (dict(chunks=True), "chunks"),
        (dict(vocab_chunks=0), "vocab_chunks"),
        (dict(reduction_count=0), "reduction_count"),
        (dict(reduction_count=3.5), "reduction_count"),
        (dict(ignore_index=None), "ignore_index"),
    ], dict(hidden=h, weight=w, bias=b, labels=y, chunks=2)


@pytest.mark.parametrize("case", range(17))
def test_bad_inputs_raise_value_error_naming_them(case):
    cases, good = _bad_calls()
    assert len(cases) == 17
    change, match = cases[case]
    with pytest.raises(ValueError, match=match):
        chunked_linear_cross_entropy(**{**good, **change})
