"""The fixed memory cost of training with torch, measured once per process.

Two costs come on top of a model's own tensors and are the same for every plan:

- modules that torch imports lazily on the first optimizer step (``torch._dynamo``, about
  75 MB of RSS) or on the first recompute. ``preload_runtime`` imports them with the
  other imports, so a measured child counts them in its import baseline, reported
  separately, as it counts ``import torch`` itself;
- the first forward and backward's runtime state (autograd engine threads, kernel code
  paged in, oneDNN caches): ``runtime_overhead_bytes`` measures it with a tiny training
  step in a child process, and profiles carry it as ``Profile.runtime_bytes``, which
  the planner adds to every event of a step.

``workload_runtime_bytes`` measures the second cost for one ``module:function``
workload instead, with its own model and kernels: the generic probe's figure is off by
tens of MiB for a model whose kernels it does not run (see its docstring), and the
per-unit planner (``memory.unit_profile``) uses it.

Set ``FLEETFIT_RUNTIME_BYTES`` to skip the probes (e.g. on a device measured before);
otherwise each probe runs once per machine (``memory.machine``'s cache).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

RUNTIME_MODULES = ("torch._dynamo", "torch.utils.checkpoint", "torch.optim")


def preload_runtime() -> None:
    """Import what torch would import lazily during the first training step."""
    for name in RUNTIME_MODULES:
        importlib.import_module(name)


def _probe() -> dict[str, Any]:
    """Two tiny training steps touching the common kernels: conv, norm, linear,
    embedding, attention, recompute and AdamW. Its peak is the runtime's own."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    conv = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2)
    )
    emb = nn.Embedding(16, 8)
    ln = nn.LayerNorm(8)
    lin = nn.Linear(8, 8)
    params = [
        *conv.parameters(),
        *emb.parameters(),
        *ln.parameters(),
        *lin.parameters(),
    ]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for _ in range(2):
        img = conv(torch.randn(2, 1, 8, 8)).mean()
        x = ln(emb(torch.randint(16, (2, 4))))
        q = checkpoint(lin, x, use_reentrant=False).view(2, 2, 4, 4)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        logits = F.gelu(a).reshape(16, 4)
        loss = F.cross_entropy(logits, torch.zeros(16, dtype=torch.long))
        (loss + img).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {}


def runtime_overhead_bytes() -> int:
    """Peak RSS of a tiny training step above the import baseline, bytes (cached;
    ``FLEETFIT_RUNTIME_BYTES`` read at every call, never cached)."""
    override = os.environ.get("FLEETFIT_RUNTIME_BYTES")
    if override:
        from memory.sizes import parse_bytes

        return parse_bytes(override, what="FLEETFIT_RUNTIME_BYTES", allow_zero=True)
    return _generic_runtime()


@functools.cache
def _generic_runtime() -> int:
    from memory.machine import cached
    from memory.measure import measure_in_child

    return int(
        cached(
            "runtime_overhead_bytes",
            lambda: measure_in_child(_probe, {}).peak_bytes,
        )
    )


def _workload_runtime(
    factory: str, kwargs: dict[str, Any], offload_dir: str | None
) -> int:
    from memory.measure import measure_in_child
    from memory.step import runtime_probe, warm_up

    m = measure_in_child(
        runtime_probe,
        {"factory": factory, "factory_kwargs": kwargs, "offload_dir": offload_dir},
        preload=(factory.split(":")[0],),
        warmup=(warm_up, {"factory": factory, "factory_kwargs": kwargs}),
        timeout_s=1800,
    )
    return int(m.result["file_bytes"])


def workload_runtime_bytes(
    factory: str,
    factory_kwargs: dict[str, Any] | None = None,
    *,
    offload_dir: str | None = None,
) -> int:
    """The runtime's first-step cost for one ``module:function`` workload, bytes:
    the library code its training step pages in, measured in a child that starts as
    the workload's measured runs do (the factory's module imported and its model
    built on ``meta`` before the baseline) and trains the model on two examples,
    plainly and under a plan using every mechanism (``memory.step.runtime_probe``).

    Why not ``runtime_overhead_bytes``: the runtime's cost is almost all file-backed
    pages of library code (``RssFile``; the generic probe's anonymous growth is under
    0.5 MiB), so it depends on which kernels run (a ViT's patch convolution pages in
    oneDNN code that the generic probe's 3x3 convolution does not: 23 MiB of a ViT
    run's 80 MiB) and on how the libraries sit in the page cache (a freshly written
    ``libtorch_cpu.so`` is cached in large folios, mapped whole: the generic probe
    measured 76 MiB right after ``pip install`` and 30 MiB once those pages had been
    evicted and read back; 21 MiB right after another machine's install). Measured
    once per workload and kept in the machine cache (``memory.machine``), so the same
    command plans the same; costs one child that builds the model (seconds). Delete
    the cache after reinstalling torch."""
    import json

    override = os.environ.get("FLEETFIT_RUNTIME_BYTES")
    if override:
        return runtime_overhead_bytes()
    from memory.machine import cached

    kwargs = factory_kwargs or {}
    return int(
        cached(
            f"workload_runtime_bytes {factory} {json.dumps(kwargs, sort_keys=True)}",
            lambda: _workload_runtime(factory, kwargs, offload_dir),
        )
    )
