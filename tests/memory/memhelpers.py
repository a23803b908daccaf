"""Targets for measuring children in tests/memory (imported by name in the child)."""

from __future__ import annotations

import time

import torch

from memory.measure import peak_rss_bytes, reset_peak, rss_bytes


def allocate(num_bytes: int, hold_s: float = 0.0) -> dict:
    """Allocate and touch ``num_bytes``, then free them."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    time.sleep(hold_s)
    total = float(x[::4096].sum())
    del x
    return {"sum": total}


class Targets:
    """A static method as a target: imported by its qualified name."""

    @staticmethod
    def allocate(num_bytes: int) -> dict:
        return allocate(num_bytes)


def fail(message: str) -> dict:
    raise ZeroDivisionError(message)


def sleep(seconds: float) -> dict:
    time.sleep(seconds)
    return {}


def step_peak(first_bytes: int, second_bytes: int) -> dict:
    """A large allocation, a peak reset, then a smaller one: the second step's peak."""
    allocate(first_bytes)
    before = rss_bytes()
    reset_peak()
    allocate(second_bytes)
    return {"step_peak": peak_rss_bytes() - before}


def cuda_allocate(num_bytes: int) -> dict:
    x = torch.ones(num_bytes // 4, device="cuda")
    del x
    return {}


def getenv(keys: list[str]) -> dict:
    import os

    return {k: os.environ.get(k) for k in keys}


def profile_big_fake(name: str) -> dict:
    """Profile a large built-in model on fake tensors; report its parameter bytes."""
    from memory.chain_profile import profile_workload_fake
    from workloads import get_workload

    wl = get_workload(name)
    x, y = wl.example_batch(0)
    prof = profile_workload_fake(
        lambda: wl.make_model(0),
        x,
        y,
        wl.loss_fn,
        measure_time=False,
        max_microbatches=1,
        max_loss_chunks=4,
    )
    return {
        "param_bytes": prof.param_bytes,
        "construction": prof.construction_peak_bytes,
    }


def train(name: str, steps: int = 3, recompute: bool = False) -> dict:
    """Plain training (or every block under torch.utils.checkpoint) of a workload."""
    from torch.utils.checkpoint import checkpoint

    from memory.blocks import as_blocks
    from workloads import get_workload

    wl = get_workload(name)
    x, y = wl.example_batch(0)
    model = wl.make_model(0)
    blocks = as_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        h = x
        for b in blocks:
            h = (
                checkpoint(b.module, h, use_reentrant=False)
                if recompute
                else b.module(h)
            )
        loss = wl.loss_fn(h, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        del h, loss
    return {"losses": losses}


def kill_self() -> dict:
    """End this process with SIGKILL, as the kernel's out-of-memory killer would."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    return {}
