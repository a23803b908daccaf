"""The one measured-training path: train a workload in a fresh child process and
measure its peak (``memory.measure.measure_in_child``).

``fleetfit memory run`` (``partition.run.measured_run``) and a client's ``child``
measure (``client.train``) both call ``train_in_child``. The parent writes the batches
(``save_batches``) and the initial state (``write_state``) to files in a temporary
directory; the child (``train_child``) sets torch's threads, builds the workload's
model, takes its initial weights from the file (copied in, or read within the plan by
a model built without them), reads the batches, seeds torch and calls the caller's
training function, which writes the trained state; the parent reads it back
(``read_state``). The child holds exactly what a training job holds (model, optimizer
state, the batches), not the dataset they were drawn from: everything the step needs
is built inside the measured child.

A training function (``TrainFn``) is a module-level function of one ``ChildRun``
returning the losses: ``partition.run.train_chain_job`` (a whole chain, plainly or
through ``partition.local.LocalExecutor``), ``client.train.train_window_job`` (a
client's window). Its module is imported before the child's baseline, as torch is.

The batches file stores each distinct tensor once and, in its metadata, the structure
of each step's batch: a custom workload trains its one example batch at every step,
and the child then holds that batch once, as the training job does.

Example:
    >>> from partition.run import train_chain_job  # doctest: +SKIP
    >>> wl = get_workload("gpt-tiny")  # doctest: +SKIP
    >>> state, m = train_in_child(train_chain_job, wl, batches, plan=None, lr=1e-3)
    >>> m.peak_bytes, m.result["losses"]  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from memory.materialize import build_without_weights, load_state_into
from memory.measure import (
    Measurement,
    load_target,
    measure_in_child,
    rss_bytes,
    target_name,
)
from memory.proximal import ProximalTerm
from memory.spec import MemoryPlan
from memory.tensorfile import TensorFile
from workloads import Workload, get_workload

# ------------------------------------------------------------------ batches file


def save_batches(path: str | Path, batches: Sequence[Any]) -> None:
    """Write ``batches`` for a measured child (``load_batches``).

    A batch is ``(inputs, targets)`` of any structure a workload gives: tensors, dicts,
    tuples and lists of them, None and plain numbers (``model(**inputs)`` with
    ``labels``, for a transformers model). The structure goes to the metadata with
    each tensor replaced by its name in the file.

    safetensors refuses tensors that share memory, yet a step's tensors may be ones
    already written (a custom workload's example batch comes back at every step) or
    views of one storage (inputs and targets sliced from one tensor). The same view is
    written once, under one name that every step using it refers to; another view of a
    storage already written is written as a copy of its elements.

    Raises:
        ValueError: a batch holds something other than tensors, containers of them,
            None, numbers or strings (one line naming its type).
    """
    tensors: dict[str, torch.Tensor] = {}
    names: dict[tuple[Any, ...], str] = {}  # view of a storage -> its name in the file
    storages: set[tuple[torch.device, int]] = set()  # those of the written tensors

    def name_of(t: torch.Tensor) -> str:
        view = (_storage(t), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        name = names.get(view)
        if name is None:
            out = t.detach().contiguous()  # a copy only if not contiguous
            if _storage(out) in storages:
                out = out.clone()
            storages.add(_storage(out))
            name = names[view] = f"tensor.{len(tensors)}"
            tensors[name] = out
        return name

    def encode(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {"t": name_of(x)}
        if isinstance(x, dict):
            return {"d": {str(k): encode(v) for k, v in x.items()}}
        if isinstance(x, tuple | list):
            return {"tuple" if isinstance(x, tuple) else "list": [encode(v) for v in x]}
        if x is None or isinstance(x, bool | int | float | str):
            return {"v": x}
        raise ValueError(
            f"a batch holds a {type(x).__name__}: batches may hold tensors, dicts, "
            "tuples and lists of them, None, numbers and strings"
        )

    steps = [encode(b) for b in batches]
    save_file(tensors, str(path), metadata={"batches": json.dumps(steps)})


def load_batches(path: str | Path) -> list[Any]:
    """The batches written by ``save_batches``, one per step, in their structure;
    steps that trained on the same tensor get the same tensor object (read once)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118

    def decode(x: dict[str, Any]) -> Any:
        if "t" in x:
            return tensors[x["t"]]
        if "d" in x:
            return {k: decode(v) for k, v in x["d"].items()}
        if "tuple" in x:
            return tuple(decode(v) for v in x["tuple"])
        if "list" in x:
            return [decode(v) for v in x["list"]]
        return x["v"]

    if "batches" in meta:
        return [decode(b) for b in json.loads(meta["batches"])]
    if "steps" in meta:  # an earlier version: pairs of tensor names
        return [(tensors[x], tensors[y]) for x, y in json.loads(meta["steps"])]
    n = sum(k.startswith("inputs.") for k in tensors)  # one tensor per key
    return [(tensors[f"inputs.{i}"], tensors[f"targets.{i}"]) for i in range(n)]


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


# ------------------------------------------------------------------ state files


def write_state(
    path: str | Path,
    state: Mapping[str, torch.Tensor],
    *,
    keys: Collection[str] | None = None,
    tied: Literal["alias", "copy"] = "alias",
) -> None:
    """Write ``state`` (only ``keys``, default all) to a safetensors file.

    ``tied="alias"``: tensors sharing memory (a head tied to the embedding) are written
    once, under their first key; the metadata's ``aliases`` (JSON) maps the other keys
    to it (``read_state`` restores them). ``tied="copy"``: every key gets its own copy
    (a file any safetensors reader loads whole, as ``fleetfit memory run --save``
    writes it).
    """
    wanted = state if keys is None else {k: state[k] for k in keys}
    if tied == "copy":
        save_file(
            {k: v.detach().clone().contiguous() for k, v in wanted.items()}, str(path)
        )
        return
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}  # storage -> the first key written with it
    for k, v in wanted.items():
        ptr = v.untyped_storage().data_ptr() if v.numel() else -1
        if ptr != -1 and ptr in first:
            aliases[k] = first[ptr]
            continue
        first.setdefault(ptr, k)
        kept[k] = v.detach().contiguous()
    save_file(kept, str(path), metadata={"aliases": json.dumps(aliases)})


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state written by ``write_state`` (or ``PlannedTrainer.save``), tied keys
    restored as the same tensor."""
    state = load_file(str(path))
    for k, first in _aliases(path).items():
        state[k] = state[first]
    return state


def _aliases(path: str | os.PathLike) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("aliases", "{}"))


# ------------------------------------------------------------------ training steps


def plain_steps(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: Any,
    *,
    lr: float,
    proximal_mu: float = 0.0,
) -> list[float]:
    """Train ``model`` in place, one torch AdamW step per ``(inputs, targets)`` batch
    (other AdamW settings: torch's defaults, over ``model.parameters()``); return the
    losses. Gradients are freed after each step (``zero_grad(set_to_none=True)``), so
    no step's forward holds the previous step's. ``proximal_mu`` > 0: FedProx's term
    towards the starting weights (``memory.proximal``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    prox = ProximalTerm(model.parameters(), proximal_mu)
    model.train()
    losses: list[float] = []
    for inputs, targets in batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        prox.add_to_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


InitMode = Literal["copy", "stream"]
"""How the child takes its initial state: ``copy``: the model is built, then every
tensor in the file copied in, one at a time; ``stream``: the model is built without
weights (chains on ``meta``; any-model workloads, and any workload the option
``per-unit`` marks, under ``memory.materialize.params_on_meta``) and the training
function reads them within the plan (``ChildRun.init_state``)."""


@dataclass
class ChildRun:
    """What a training function gets in the measured child.

    Attributes:
        model: the workload's model (its weights on ``meta`` when ``init_state`` is
            streamed).
        workload: the workload.
        batches: one ``(inputs, targets)`` per step.
        plan: the memory plan (None: plain training).
        lr: AdamW learning rate.
        offload_dir: where a plan's files go (None: the system temporary directory).
        init_state: with ``init="stream"``: the state file (``TensorFile``) the model's
            weights are read from, tied keys resolved; else None.
        save_to: where the trained state goes (None: nowhere).
        options: the training function's own settings (JSON values).
        step_times_s: seconds of each step, appended by ``timed``.
        write_s: seconds spent in ``write_state`` (not counted as training).
        baseline_bytes: the child's resident bytes when it started (torch and the
            preloaded modules), for a ``memory.guard.MemoryGuard`` at the plan's
            budget.
    """

    model: nn.Module
    workload: Workload
    batches: list[Any]
    plan: MemoryPlan | None
    lr: float
    offload_dir: str | None
    init_state: _AliasedFile | None
    save_to: str | None
    options: dict[str, Any]
    step_times_s: list[float] = field(default_factory=list)
    write_s: float = 0.0
    baseline_bytes: int = 0

    def timed(self) -> Iterator[Any]:
        """The batches, each step's seconds appended to ``step_times_s``."""
        for b in self.batches:
            t0 = time.perf_counter()
            yield b
            self.step_times_s.append(time.perf_counter() - t0)

    def close_init_state(self) -> None:
        """Close the initial state's file (every weight is in the model or the
        plan's store now)."""
        if self.init_state is not None:
            self.init_state.close()

    def write_state(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        keys: Collection[str] | None = None,
        tied: Literal["alias", "copy"] = "alias",
    ) -> None:
        """``write_state`` to ``save_to`` (if any), not counted in ``train_s``."""
        if self.save_to:
            t0 = time.perf_counter()
            write_state(self.save_to, state, keys=keys, tied=tied)
            self.write_s += time.perf_counter() - t0


TrainFn = Callable[[ChildRun], list[float]]
"""A training function: trains ``run.model``, writes ``run.save_to``, returns the
losses; module-level, so that the child imports it by name."""


class _AliasedFile(TensorFile):
    """A state file whose tied keys (``write_state``'s aliases) read as their first."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.aliases = _aliases(path)

    def get_tensor(self, name: str) -> torch.Tensor:
        return super().get_tensor(self.aliases.get(name, name))


def train_child(
    *,
    train: str,
    workload: str,
    batches_file: str,
    plan: dict[str, Any] | None,
    lr: float,
    seed: int = 0,
    torch_seed: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    threads: int | None = None,
    init_file: str | None = None,
    init: InitMode = "copy",
    save_to: str | None = None,
    offload_dir: str | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The measured child's work (``train_in_child``'s target; JSON arguments).

    Returns:
        ``{"losses", "train_s", "step_times_s", "step_s"}``: ``train_s`` the seconds
        of the training function (writing the state excluded), ``step_s`` the median
        step after the first (None when the function timed no step).
    """
    baseline = rss_bytes()  # the measuring child's, just taken
    if threads:
        torch.set_num_threads(threads)
    fn = load_target(train)
    options = options or {}

    # a module:function workload is built to read its example batch: without weights
    # (for real where its factory reads them: memory.materialize.build_without_weights)
    def workload_of() -> Any:
        return get_workload(workload, batch_size=batch_size, seq_len=seq_len)

    wl = build_without_weights(workload_of)[0] if ":" in workload else workload_of()
    batches = load_batches(batches_file)
    source = None
    if init_file is not None and init == "stream":
        # PlannedTrainer needs real buffers (computed in __init__); the chain executor
        # reads buffers from the file too
        per_unit = wl.any_model or options.get("per-unit", False)
        if per_unit:
            model, hollow = build_without_weights(lambda: wl.make_model(seed))
        else:
            with torch.device("meta"):
                model = wl.make_model(seed)
            hollow = True
        if hollow:
            source = _AliasedFile(init_file)
        else:  # a factory that reads its weights: built whole, the file read in
            load_state_into(model, init_file)
    else:
        model = wl.make_model(seed)
        if init_file is not None:
            load_state_into(model, init_file)
    run = ChildRun(
        model,
        wl,
        batches,
        None if plan is None else MemoryPlan.from_dict(plan),
        lr,
        offload_dir,
        source,
        save_to,
        options,
        baseline_bytes=baseline,
    )
    if torch_seed is not None:
        torch.manual_seed(torch_seed)
    try:
        t0 = time.perf_counter()
        losses = fn(run)
        train_s = time.perf_counter() - t0 - run.write_s
    finally:
        run.close_init_state()
    times = run.step_times_s
    later = times[1:] or times
    return {
        "losses": losses,
        "train_s": train_s,
        "step_times_s": times,
        "step_s": statistics.median(later) if later else None,
    }


# ------------------------------------------------------------------ the parent


def train_in_child(
    train: TrainFn,
    workload: Workload,
    batches: Sequence[Any],
    *,
    plan: MemoryPlan | None,
    lr: float,
    seed: int = 0,
    torch_seed: int | None = None,
    threads: int | None = None,
    initial_state: Mapping[str, torch.Tensor]
    | Callable[[str], None]
    | str
    | os.PathLike
    | None = None,
    init: InitMode = "copy",
    save: str | None = None,
    read_back: bool = False,
    options: dict[str, Any] | None = None,
    offload_dir: str | None = None,
    tmp_dir: str | None = None,
    timeout_s: float = 3600,
) -> tuple[dict[str, torch.Tensor] | None, Measurement]:
    """Train ``workload`` on ``batches`` with ``train`` in a fresh child process and
    measure its peak (see the module docstring).

    Args:
        train: the training function (``TrainFn``), defined at module level.
        workload: the workload; the child builds it by name (and shape).
        batches: one ``(inputs, targets)`` per step.
        plan: the memory plan (None: plain training).
        lr: AdamW learning rate.
        seed: ``make_model``'s seed in the child.
        torch_seed: torch's seed right before training (None: not reseeded).
        threads: torch's intra-op threads in the child (None: torch's default).
        initial_state: the weights the child starts from: a state dict (written to
            a file here) or a function writing them to the path it is given (a
            safetensors file; the weights need not exist here while the child
            runs), or the path of such a file (read where it is); None:
            ``make_model(seed)``'s.
        init: how the child takes ``initial_state`` (``InitMode``).
        save: where the trained state goes (None: a temporary file, when
            ``read_back``).
        read_back: read the trained state back and return it.
        options: ``ChildRun.options`` (JSON values).
        offload_dir: where a plan's files go.
        tmp_dir: where the temporary files go (default: the system's).
        timeout_s: kill the child after this many seconds.

    Returns:
        The trained state (tied keys restored; None unless ``read_back``) and the
        measurement, whose ``result`` is ``train_child``'s.

    Raises:
        MeasurementError: the child failed (its traceback in the message).
        ValueError: ``train`` is not a module-level function.
    """
    custom = workload.kind == "custom"
    kwargs: dict[str, Any] = dict(
        train=target_name(train),
        workload=workload.name,
        plan=None if plan is None else plan.to_dict(),
        lr=lr,
        seed=seed,
        torch_seed=torch_seed,
        batch_size=None if custom else workload.batch_size,
        seq_len=workload.seq_len,
        threads=threads,
        init=init,
        offload_dir=offload_dir,
        options=options or {},
    )
    with tempfile.TemporaryDirectory(prefix="fleetfit-train-", dir=tmp_dir) as tmp:
        kwargs["batches_file"] = os.path.join(tmp, "batches.safetensors")
        save_batches(kwargs["batches_file"], batches)
        if isinstance(initial_state, (str, os.PathLike)):
            kwargs["init_file"] = os.path.abspath(initial_state)
        elif initial_state is not None:
            kwargs["init_file"] = os.path.join(tmp, "initial.safetensors")
            if callable(initial_state):
                initial_state(kwargs["init_file"])
            else:
                write_state(kwargs["init_file"], initial_state)
        out = save or (os.path.join(tmp, "trained.safetensors") if read_back else None)
        kwargs["save_to"] = None if out is None else os.path.abspath(out)
        m = measure_in_child(
            train_child,
            kwargs,
            timeout_s=timeout_s,
            # the training function's module, and a custom workload's (with what it
            # imports: transformers), are library code, imported before the baseline
            # as torch is; so is what its model's construction imports lazily
            # (transformers' modeling code: 62 MiB for the example GPT-2)
            preload=(train.__module__,)
            + ((workload.name.split(":")[0],) if custom else ()),
            warmup=_warm_up(workload.name) if custom else None,
        )
        state = read_state(out) if read_back and out is not None else None
    return state, m


def _warm_up(factory: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    from memory.step import warm_up

    return warm_up, {"factory": factory, "factory_kwargs": {}}
