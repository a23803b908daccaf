"""Central pretraining on public data before a federation fine-tunes on private data.

On-device keyboards are trained this way: a model pretrained on public text, then
fine-tuned in the federation on data the server never sees. A fleet file names the
phase in a ``[pretrain]`` table::

    [pretrain]
    share = 0.2        # of every data group's training items, held out from every
                       #   device (workloads.splits.public_indices): the public data
    steps = 200        # optimizer steps (AdamW), centrally
    batch-size = 0     # examples per step; 0: the run's batch-size
    lr = 0.0           # learning rate; 0: the run's lr; a list of candidates
                       #   (lr = [1e-4, 3e-4, 1e-3]): each model is pretrained at
                       #   every one and keeps its best (the lr rule, below)

The devices split only the rest (run-config ``public-share``), so no device holds an
item the server pretrained on. Every strategy starts from its own model pretrained the
same way (``smallest-model``'s shrunk model too), through the run config's
``init-model``. A pretrained model is cached by (workload, batch and sequence, seed,
pretraining settings) in a folder, ``OUT/pretrain/`` in a comparison, so each model is
pretrained once: ``fleetfit`` and ``exclude`` share one. Without a ``[pretrain]``
table every strategy starts from scratch, as before.

A list of learning rates is the same rule for every model (issue 16, item 5): each
model is pretrained at every candidate for ``steps`` steps and keeps the one whose
model has the best metric on the central held-out set (ties to the smaller lr), so a
wide model is not held to the lr that suits a narrow one. Each candidate is cached as
if it had been the only lr; the record lists every candidate's metric (``lr_sweep``)
and the lr kept (``lr``), which a comparison can also use as the model's client lr
(``compare(..., lr_from_pretrain=True)``).

Example:
    >>> from simulations.fleet import load_fleet
    >>> from simulations.pretrain import pretrained_model
    >>> fleet = load_fleet("my-fleet.toml")  # with a [pretrain] table
    >>> done = pretrained_model(fleet, "gpt-byte", "runs/x/pretrain")
    >>> done.path, done.cached
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.fleet import Fleet
    from wire.shape import RunShape

log = logging.getLogger(__name__)

PRETRAIN_FIELDS = ("share", "steps", "batch-size", "lr")
PRETRAIN_VERSION = 1  # part of the cache key: bump when pretraining changes


@dataclass(frozen=True)
class Pretrain:
    """A ``[pretrain]`` table: central training on held-out public data."""

    share: float = 0.2  # [share] of every data group's training items held out from
    #   every device, in (0, 0.5]
    steps: int = 200  # [steps] optimizer steps
    batch_size: int = 0  # [batch-size] examples per step; 0: the run's
    lr: float = 0.0  # [lr] AdamW learning rate; 0: the run's
    lrs: tuple[float, ...] = ()  # [lr] as a list: candidates, ascending; each model
    #   keeps its best (``lr`` is then unused)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        if not self.lrs:  # one lr: the cache key of before candidates existed
            del d["lrs"]
        return d


def parse_pretrain(raw: Any, shape: RunShape, fail: Any) -> Pretrain:
    """Validate a fleet file's ``[pretrain]`` table (``fail`` makes the error)."""
    if not isinstance(raw, dict):
        raise fail(f"pretrain = {raw!r} must be a table ([pretrain])")
    extra = sorted(set(raw) - set(PRETRAIN_FIELDS))
    if extra:
        raise fail(
            f"unknown field pretrain.{extra[0]} = {raw[extra[0]]!r}: known fields "
            f"are {', '.join('pretrain.' + k for k in PRETRAIN_FIELDS)}"
        )
    share = raw.get("share", Pretrain.share)
    if (
        isinstance(share, bool)
        or not isinstance(share, int | float)
        or not 0 < share <= 0.5
    ):
        raise fail(
            f"pretrain.share = {share!r} must be in (0, 0.5]: the share of every "
            "data group held out from every device, e.g. 0.2"
        )
    steps = raw.get("steps", Pretrain.steps)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise fail(
            f"pretrain.steps = {steps!r} must be an integer >= 1 (leave out "
            "[pretrain] to train from scratch)"
        )
    batch = raw.get("batch-size", 0)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise fail(
            f"pretrain.batch-size = {batch!r} must be an integer >= 0 (0: the "
            "run's batch-size)"
        )
    lr = raw.get("lr", 0.0)
    if isinstance(lr, list):
        if not lr or not all(_is_lr(x) and x > 0 for x in lr):
            raise fail(
                f"pretrain.lr = {lr!r}: a list of candidates must hold numbers > 0, "
                "e.g. [1e-4, 3e-4, 1e-3]"
            )
        lrs = tuple(sorted({float(x) for x in lr}))
        return Pretrain(float(share), steps, batch, 0.0, lrs)
    if not _is_lr(lr):
        raise fail(
            f"pretrain.lr = {lr!r} must be a number >= 0 (0: the run's lr) or a list "
            "of candidates, e.g. [1e-4, 3e-4, 1e-3]"
        )
    return Pretrain(float(share), steps, batch, float(lr) or shape.lr)


def _is_lr(x: Any) -> bool:
    return (
        not isinstance(x, bool)
        and isinstance(x, int | float)
        and math.isfinite(x)
        and x >= 0
    )


@dataclass(frozen=True)
class Pretrained:
    """A pretrained model in the cache."""

    path: Path  # the safetensors file (run-config init-model)
    cached: bool  # found in the cache, not trained now
    record: dict[str, Any]  # settings, losses, metric, wall seconds (its .json)


def cache_key(fleet: Fleet, workload: str) -> dict[str, Any]:
    """What a pretrained model depends on: equal keys, equal weights."""
    assert fleet.pretrain is not None
    return {
        "version": PRETRAIN_VERSION,
        "workload": workload,
        "batch_size": fleet.shape.batch_size,
        "seq_len": fleet.shape.seq_len,
        "seed": fleet.shape.seed,
        "eval_windows": fleet.eval_windows,
        **fleet.pretrain.describe(),
    }


def pretrained_model(fleet: Fleet, workload: str, cache_dir: str | Path) -> Pretrained:
    """``workload``'s model pretrained as ``fleet.pretrain`` says, from the cache in
    ``cache_dir`` or trained now (and cached). With candidate lrs (``lr`` a list),
    each candidate is pretrained (or found in the cache) and the best kept: the
    record's ``lr`` is the one kept, ``lr_sweep`` has every candidate's metric.

    Raises:
        ValueError: the fleet has no ``[pretrain]`` table, or the workload brings its
            own data (``load_data``), which has no public share to hold out.
    """
    p = fleet.pretrain
    if p is None:
        raise ValueError(f"fleet {fleet.name!r} has no [pretrain] table")
    if not p.lrs:
        return _pretrained_at(fleet, workload, cache_dir)
    done = {
        lr: _pretrained_at(
            replace(fleet, pretrain=replace(p, lr=lr, lrs=())), workload, cache_dir
        )
        for lr in p.lrs
    }
    from simulations.lr_sweep import choose  # the federated sweep's pick, one rule

    metric_name = next(iter(done.values())).record["metric_name"]
    rows = [
        {"strategy": workload, "lr": x, "final_metric": d.record.get("metric")}
        for x, d in done.items()
    ]
    lr = choose(rows, metric_name)[workload]
    sweep = [{"lr": x, "metric": d.record.get("metric")} for x, d in done.items()]
    record = {**done[lr].record, "lr": lr, "lr_sweep": sweep}
    log.info(
        "pretrain: %s keeps lr %g of %s (%s: %s)",
        workload,
        lr,
        ", ".join(f"{x:g}" for x in p.lrs),
        metric_name,
        ", ".join(f"{d.record.get('metric')}" for d in done.values()),
    )
    return Pretrained(done[lr].path, all(d.cached for d in done.values()), record)


def _pretrained_at(fleet: Fleet, workload: str, cache_dir: str | Path) -> Pretrained:
    """The model pretrained at ``fleet.pretrain``'s one lr, from the cache or now."""
    key = cache_key(fleet, workload)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    stem = f"{re.sub(r'[^A-Za-z0-9_.@-]', '_', workload)}-{digest[:16]}"
    cache = Path(cache_dir)
    path, meta = cache / f"{stem}.safetensors", cache / f"{stem}.json"
    if path.is_file() and meta.is_file():
        record = json.loads(meta.read_text())
        log.info("pretrain: %s from the cache (%s)", workload, path)
        return Pretrained(path, True, record)
    cache.mkdir(parents=True, exist_ok=True)
    record = _pretrain(fleet, workload, path)
    record["key"] = key
    meta.write_text(json.dumps(record, indent=2))
    return Pretrained(path, False, record)


def _pretrain(fleet: Fleet, workload: str, path: Path) -> dict[str, Any]:
    import torch

    from server.persist import save_model
    from workloads import get_workload

    p = fleet.pretrain
    assert p is not None
    shape = fleet.shape
    wl = get_workload(
        workload,
        batch_size=p.batch_size or shape.batch_size or None,
        seq_len=shape.seq_len or None,
        eval_windows=fleet.eval_windows,
    )
    if wl.own_data or wl.dataset == "example":
        raise ValueError(
            f"pretrain: {workload} brings its own data, which has no public share to "
            "hold out; leave out [pretrain] for it"
        )
    public = wl.public_items(p.share)
    t0 = time.monotonic()
    model = wl.make_model(shape.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr)
    stream = wl.batches(public, seed=shape.seed)
    losses: list[float] = []
    torch.manual_seed(shape.seed)
    for _ in range(p.steps):
        x, y = next(stream)
        opt.zero_grad(set_to_none=True)
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    metrics = wl.evaluate(model)
    save_model(path, model.state_dict(), {"workload": workload, "pretrain": "1"})
    wall = time.monotonic() - t0
    log.info(
        "pretrain: %s, %d steps on %d public items: loss %.3f -> %.3f, %s %.4g "
        "(%.1f s)",
        workload,
        p.steps,
        len(public),
        losses[0],
        losses[-1],
        wl.metric_name,
        metrics[wl.metric_name],
        wall,
    )
    return {
        "workload": workload,
        "public_items": len(public),
        "steps": p.steps,
        "lr": p.lr,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "metric_name": wl.metric_name,
        "metric": float(metrics[wl.metric_name]),
        "wall_s": wall,
    }


__all__ = ["Pretrain", "Pretrained", "cache_key", "parse_pretrain", "pretrained_model"]
