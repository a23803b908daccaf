"""The one-device executor: a training step under a ``MemoryPlan``, run as a schedule.

``LocalExecutor`` compiles the plan (``partition.schedule.compile_plan``), checks it and
runs its actions with ``memory``'s mechanisms: ``torch.utils.checkpoint`` for
``recompute`` blocks, saved-tensor hooks for ``offload`` blocks, the on-disk
``BlockStore`` for ``stream`` blocks. Results equal plain training
(``loss_fn(model(x), y).backward(); AdamW.step()``): bit for bit where only data moves,
within a relative 1e-6 where micro-batching or chunked losses change the order of sums.

The model runs block by block (``memory.blocks.as_blocks``): each block's input is a
fresh autograd leaf, and backward goes from the last block to the first, handing the
input gradient of block i+1 to block i as its output gradient.

Tied parameters (GPT-2's ``head.proj.weight is embed.tok.weight``) belong to the first
block that uses them. If that block is resident, the parameter is resident wherever it
is used. If it is streamed, every later block that uses it must be streamed too: those
blocks load it from the owner's file with their own parameters, and their gradient for
it is added to the owner's gradient accumulator, which the owner's update consumes.
A resident block using a streamed block's parameter is refused (``MemoryPlanError``).

Example:
    >>> wl = get_workload("gpt-tiny")  # doctest: +SKIP
    >>> model = wl.make_model(0)
    >>> plan = MemoryPlan.plain([b.name for b in as_blocks(model)])
    >>> with LocalExecutor(model, wl.loss_fn, plan) as ex:
    ...     loss = ex.step(*wl.example_batch())
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memory.blocks import as_blocks
from memory.errors import MemoryPlanError
from memory.offload import ActivationOffload, OffloadedActivations
from memory.proximal import ProximalTerm
from memory.recompute import (
    RecomputeRecord,
    checkpoint_block,
    forward_no_grad,
    has_buffers,
    recompute,
)
from memory.sizes import format_bytes
from memory.spec import MemoryPlan
from memory.store import BlockStore, check_directory
from partition.schedule import Action, compile_plan, validate

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class LocalExecutor:
    """Trains ``model`` on one device under ``plan``.

    Args:
        model: the model; its children (``as_blocks``) must match ``plan.blocks``.
            Parameters of streamed blocks are moved into the store and the model's own
            copies are freed (their ``.data`` becomes an empty tensor): read them with
            ``state_dict()`` or ``close(restore=True)``.
        loss_fn: ``loss_fn(outputs, targets)``, a mean over examples (and tokens).
        plan: the memory plan.
        lr: AdamW learning rate; ``betas``, ``eps``, ``weight_decay`` are AdamW's.
        optimizer: only ``"adamw"``.
        offload_dir: where streamed state and offloaded activations go (default: the
            system's temporary directory). Checked for room and writability here.
        device: ``"cpu"`` or a CUDA device (offloaded activations go to host memory).
        init_state: ``init_state(name) -> tensor`` for a model built on the ``meta``
            device: each parameter and buffer is read by its state-dict name, block by
            block, streamed blocks straight into the store, so the whole model never
            exists in memory at once (e.g. ``safetensors.safe_open(f).get_tensor``).

    Raises:
        MemoryPlanError: the plan does not fit the model, or a combination the executor
            does not support; ``memory.errors.OffloadDirError`` for a full or
            unwritable offload directory.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        plan: MemoryPlan,
        *,
        lr: float = 1e-3,
        optimizer: str = "adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        offload_dir: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        init_state: Callable[[str], torch.Tensor] | None = None,
        proximal_mu: float = 0.0,
    ) -> None:
        if optimizer.lower() != "adamw":
            raise ValueError(f"optimizer {optimizer!r} is not supported; use 'adamw'")
        self.model = model
        self.loss_fn = loss_fn
        self.plan = plan
        self.hparams: dict[str, Any] = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.device = torch.device(device)
        self.init_state = init_state
        self.blocks = as_blocks(model)
        names = [b.name for b in self.blocks]
        if names != [b.name for b in plan.blocks]:
            raise MemoryPlanError(
                f"the plan's blocks {[b.name for b in plan.blocks]} are not the model's "
                f"blocks {names}; make the plan for this model"
            )
        self.schedule = compile_plan(plan)
        validate(self.schedule)
        self.streamed = self.schedule.streamed
        ProximalTerm.refuse(
            proximal_mu,
            (plan.blocks[i].name for i in sorted(self.streamed)),
            "LocalExecutor",
        )
        self._check_plan()
        self._placeholders = self._swap_meta_parameters()
        self._tie_params()
        self.store: BlockStore | None = None
        self.offload: ActivationOffload | None = None
        self.workdir: Path | None = None
        self._loaded: dict[int, list[torch.Tensor]] = {}
        self._broken: BaseException | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            self._open_disk(offload_dir)
            self._move_streamed_to_store()
            self._materialize()
            self.init_state = None  # the source (e.g. an open file) is not needed now
            model.to(self.device)
        except BaseException:
            self.close()
            raise
        resident = [
            p for p in self._all_params if self._owner[id(p)] not in self.streamed
        ]
        self.optimizer = (
            torch.optim.AdamW(
                resident, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
            )
            if resident
            else None
        )
        self.proximal = ProximalTerm(resident, proximal_mu)

    # ------------------------------------------------------------ setup

    def _check_plan(self) -> None:
        plan, last = self.plan, self.blocks[-1].module
        if plan.loss_chunks > 1 and has_buffers(last):
            raise MemoryPlanError(
                f"loss_chunks={plan.loss_chunks} would split the batch statistics of "
                f"the last block {self.blocks[-1].name!r}; use loss_chunks=1"
            )
        if plan.num_microbatches > 1 and any(
            has_buffers(b.module) for b in self.blocks
        ):
            logger.warning(
                "micro-batching a model with buffers (e.g. BatchNorm): batch statistics "
                "are taken per micro-batch, so results differ from plain training"
            )

    def _tie_params(self) -> None:
        self._all_params = list(self.model.parameters())
        self._owner: dict[int, int] = {}
        self._block_params: list[list[nn.Parameter]] = []
        for i, b in enumerate(self.blocks):
            ps = list(b.module.parameters())
            self._block_params.append(ps)
            for p in ps:
                self._owner.setdefault(id(p), i)
        # own[i]: the parameters block i stores; borrowed[i]: (owner, index) pairs
        self._own = [
            [p for p in ps if self._owner[id(p)] == i]
            for i, ps in enumerate(self._block_params)
        ]
        self._borrowed: list[list[tuple[int, int, nn.Parameter]]] = []
        lenders: set[int] = set()
        for i, ps in enumerate(self._block_params):
            out = []
            for p in ps:
                a = self._owner[id(p)]
                if a == i or a not in self.streamed:
                    continue
                if i not in self.streamed:
                    raise MemoryPlanError(
                        f"block {self.blocks[i].name!r} is resident but shares a "
                        f"parameter with streamed block {self.blocks[a].name!r}, which "
                        "owns it (tied weights); stream both blocks or keep "
                        f"{self.blocks[a].name!r} resident"
                    )
                out.append(
                    (a, next(j for j, q in enumerate(self._own[a]) if q is p), p)
                )
                lenders.add(a)
            self._borrowed.append(out)
        self._lenders = lenders

    def _disk_bytes(self) -> tuple[int, str]:
        m = self.plan.num_microbatches
        store = sum(
            BlockStore.bytes_needed(
                self._own[i], with_grads=m > 1 or i in self._lenders
            )
            for i in self.streamed
        )
        need = max(store, self.plan.predicted_disk_bytes)
        offloaded = sum(b.activations == "offload" for b in self.plan.blocks)
        what = (
            f"the parameters, gradients and AdamW state of {len(self.streamed)} streamed "
            f"block(s) ({format_bytes(store)})"
        )
        if offloaded:
            what += f" and the activations of {offloaded} offloaded block(s)"
        return need, what

    def _open_disk(self, offload_dir: str | os.PathLike | None) -> None:
        offloads = any(b.activations == "offload" for b in self.plan.blocks)
        if not self.streamed and not offloads:
            return
        directory = tempfile.gettempdir() if offload_dir is None else offload_dir
        need, what = self._disk_bytes()
        path = check_directory(directory, need, what=what)
        self.workdir = Path(tempfile.mkdtemp(prefix="fleetfit-run-", dir=path))
        self._finalizer = weakref.finalize(
            self, shutil.rmtree, str(self.workdir), ignore_errors=True
        )
        if self.streamed:
            self.store = BlockStore(self.workdir)
        if offloads:
            if self.device.type == "cuda":
                logger.info("offloading activations to host memory")
            self.offload = ActivationOffload(self.workdir)
        logger.info("offload directory %s: %s", self.workdir, what)

    @torch.no_grad()
    def _move_streamed_to_store(self) -> None:
        if self.store is None:
            return
        m = self.plan.num_microbatches
        names = {id(p): n for n, p in self.model.named_parameters()}
        for i in sorted(self.streamed):
            own = self._own[i]
            values = [
                self._initial(names[id(p)], p) if id(p) in self._placeholders else p
                for p in own
            ]
            self.store.add(i, values, with_grads=m > 1 or i in self._lenders)
            del values
            for p in own:
                p.data = _empty_like(p)  # frees the resident copy
                self._placeholders.discard(id(p))

    def _swap_meta_parameters(self) -> set[int]:
        """Replace meta parameters by CPU placeholders of the same shape that hold no
        memory (a broadcast scalar), keeping tied parameters tied; their values come
        from ``init_state`` later, block by block."""
        swapped: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for key, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in swapped:
                    hollow = torch.zeros((), dtype=p.dtype).expand(p.shape)
                    swapped[id(p)] = nn.Parameter(hollow, requires_grad=p.requires_grad)
                module._parameters[key] = swapped[id(p)]
        return {id(p) for p in swapped.values()}

    def _initial(self, name: str, like: torch.Tensor) -> torch.Tensor:
        if self.init_state is None:
            raise MemoryPlanError(
                f"{name} is on the meta device but no init_state was given to read it "
                "from; build the model on a real device or pass init_state"
            )
        value = self.init_state(name)
        if value.shape != like.shape or value.dtype != like.dtype:
            raise MemoryPlanError(
                f"init_state gave {name} as {value.dtype}{list(value.shape)}, but the "
                f"model has {like.dtype}{list(like.shape)}"
            )
        return value

    @torch.no_grad()
    def _materialize(self) -> None:
        """Read resident parameters and buffers of a meta-built model from init_state."""
        for name, p in self.model.named_parameters():
            if id(p) in self._placeholders:
                p.data = self._initial(name, p)
                self._placeholders.discard(id(p))
        for name, b in self.model.named_buffers():
            if b.is_meta:
                owner_name, _, attr = name.rpartition(".")
                owner = self.model.get_submodule(owner_name)
                owner._buffers[attr] = self._initial(name, b)

    # ------------------------------------------------------------ the step

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step on ``(inputs, targets)``; returns the loss.

        Raises:
            ValueError: a batch that does not split into the plan's micro-batches.
            RuntimeError: a previous step failed part-way (the state is inconsistent).
        """
        if self._broken is not None:
            raise RuntimeError(
                "a previous step failed part-way, so streamed state may be partly "
                "updated; build a new executor"
            ) from self._broken
        m = self.plan.num_microbatches
        if inputs.shape[0] % m:
            raise ValueError(
                f"a batch of {inputs.shape[0]} does not split into {m} equal micro-batches"
            )
        self._xs = torch.tensor_split(inputs.to(self.device), m)
        self._ys = torch.tensor_split(targets.to(self.device), m)
        self._fwd: dict[tuple[int, int], Any] = {}
        self._out: dict[tuple[int, int], torch.Tensor] = {}
        self._gin: dict[tuple[int, int], torch.Tensor | None] = {}
        self._acts: dict[tuple[int, int], OffloadedActivations] = {}
        self._loss = 0.0
        try:
            for action in self.schedule.ranks[0]:
                getattr(self, f"_do_{action.kind}")(action)
        except BaseException as e:
            self._broken = e
            self._release_step()
            raise
        self._release_step()
        return self._loss

    def _release_step(self) -> None:
        for acts in self._acts.values():
            acts.release()
        self._acts, self._fwd, self._out, self._gin = {}, {}, {}, {}
        self._xs = self._ys = ()
        for i in list(self._loaded):
            self._unload(i)

    def _fn(self, i: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        module = self.blocks[i].module
        if i < len(self.blocks) - 1:
            return module
        y, m = self._ys[k], self.plan.num_microbatches

        def head_and_loss(z: torch.Tensor) -> torch.Tensor:
            loss = self.loss_fn(module(z), y)
            return loss / m if m > 1 else loss

        return head_and_loss

    def _input(self, i: int, k: int) -> torch.Tensor:
        if i == 0:
            return self._xs[k]
        x = self._out.pop((i - 1, k)).detach()
        return x.requires_grad_(x.is_floating_point())

    def _do_F(self, a: Action) -> None:
        i, k = a.block, a.microbatch
        assert i is not None and k is not None
        last = i == len(self.blocks) - 1
        module = self.blocks[i].module
        x = self._input(i, k)
        if last and self.plan.loss_chunks > 1:
            self._chunked_head(i, k, x)
            return
        mode = self.plan.blocks[i].activations
        fn = self._fn(i, k)
        if i in self.streamed and not last:
            out, record = forward_no_grad(fn, x, module)
            self._fwd[(i, k)] = record
        elif mode == "recompute":
            out = checkpoint_block(fn, x, module)
            self._fwd[(i, k)] = (x, out)
        elif mode == "offload":
            assert self.offload is not None
            keep = [*self._block_params[i], x]
            acts = self.offload.activations(f"{i}-{k}", keep, device=self.device)
            self._acts[(i, k)] = acts
            with acts.hooks():
                out = fn(x)
            acts.commit(out)
            self._fwd[(i, k)] = (x, out)
        else:
            out = fn(x)
            self._fwd[(i, k)] = (x, out)
        if last:
            self._loss += float(out.detach())
        else:
            self._out[(i, k)] = out

    def _chunked_head(self, i: int, k: int, x: torch.Tensor) -> None:
        """Last block and loss over ``loss_chunks`` slices of the flattened positions,
        each run forward and backward at once, so the full logits never exist."""
        module, y = self.blocks[i].module, self._ys[k]
        flat_x = x.detach().reshape(-1, x.shape[-1])
        flat_y = y.reshape(-1)
        n = flat_y.shape[0]
        if flat_x.shape[0] != n:
            raise MemoryPlanError(
                f"loss_chunks needs one target per position: the head's input has "
                f"{flat_x.shape[0]} positions but there are {n} targets; use "
                "loss_chunks=1 for this model"
            )
        gin = torch.zeros_like(flat_x) if x.requires_grad else None
        scale = 1.0 / (n * self.plan.num_microbatches)
        bounds = torch.tensor_split(torch.arange(n), self.plan.loss_chunks)
        for idx in bounds:
            if idx.numel() == 0:
                continue
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            xj = flat_x[lo:hi].detach().requires_grad_(gin is not None)
            loss = self.loss_fn(module(xj), flat_y[lo:hi]) * ((hi - lo) * scale)
            loss.backward()
            self._loss += float(loss.detach())
            if gin is not None:
                assert xj.grad is not None
                gin[lo:hi] = xj.grad
        self._fwd[(i, k)] = "done"
        self._gin[(i, k)] = None if gin is None else gin.view_as(x)

    def _do_R(self, a: Action) -> None:
        i, k = a.block, a.microbatch
        assert i is not None and k is not None
        record = self._fwd[(i, k)]
        assert isinstance(record, RecomputeRecord)
        leaf, out = recompute(
            self._fn(i, k),
            record,
            self.blocks[i].module,
            input_requires_grad=i > 0 and record.inputs.is_floating_point(),
        )
        self._fwd[(i, k)] = (leaf, out)

    def _do_B(self, a: Action) -> None:
        i, k = a.block, a.microbatch
        assert i is not None and k is not None
        entry = self._fwd.pop((i, k))
        if entry == "done":  # chunked head: forward did the backward
            return
        x, out = entry
        last = i == len(self.blocks) - 1
        grad = None if last else self._gin.pop((i + 1, k))
        if out.requires_grad and (last or grad is not None):
            torch.autograd.backward(out, grad)
        del out
        acts = self._acts.pop((i, k), None)
        if acts is not None:
            acts.release()
        if i > 0:
            self._gin[(i, k)] = x.grad

    def _do_LOAD(self, a: Action) -> None:
        i = a.block
        assert i is not None and self.store is not None
        views = self.store.load(i)
        for p, v in zip(self._own[i], views, strict=True):
            p.data = v if self.device.type == "cpu" else v.to(self.device)
        for owner, j, p in self._borrowed[i]:
            v = self.store.load(owner, [j])[0]
            p.data = v if self.device.type == "cpu" else v.to(self.device)
        self._loaded[i] = views

    def _unload(self, i: int) -> None:
        for p in self._own[i]:
            p.grad = None
            p.data = _empty_like(p)
        for _, _, p in self._borrowed[i]:
            p.grad = None
            p.data = _empty_like(p)
        del self._loaded[i]
        assert self.store is not None
        self.store.flush(i)  # after the views are gone: nothing stays mapped

    def _do_OFFLOAD(self, a: Action) -> None:
        assert a.block is not None
        self._unload(a.block)

    def _do_WRITE(self, a: Action) -> None:
        i = a.block
        assert i is not None and self.store is not None
        own = {j: p.grad for j, p in enumerate(self._own[i]) if p.grad is not None}
        self.store.accumulate_grads(
            i, own
        )  # between micro-batches (empty after UPDATE)
        by_owner: dict[int, dict[int, torch.Tensor]] = {}
        for owner, j, p in self._borrowed[i]:
            if p.grad is not None:
                by_owner.setdefault(owner, {})[j] = p.grad
        for owner, grads in by_owner.items():
            self.store.accumulate_grads(owner, grads)
        del own, by_owner
        if self.device.type != "cpu":
            self.store.write_params(i, [p.data for p in self._own[i]])
        self._unload(i)

    def _do_UPDATE(self, a: Action) -> None:
        i = a.block
        assert i is not None and self.store is not None
        own = self._own[i]
        params = self._loaded[i] if self.device.type == "cpu" else [p.data for p in own]
        grads = [p.grad for p in own]
        for p in own:
            p.grad = None
        self.store.adamw_step(i, params, grads, **self.hparams)

    def _do_STEP(self, a: Action) -> None:
        assert self.optimizer is not None
        self.proximal.add_to_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of every parameter and buffer by name, streamed ones read from disk."""
        streamed: dict[int, torch.Tensor] = {}
        if self.store is not None:
            for i in self.streamed:
                for p, v in zip(self._own[i], self.store.read(i), strict=True):
                    streamed[id(p)] = v
        out = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            out[name] = streamed[id(p)] if id(p) in streamed else p.detach().clone()
        for name, b in self.model.named_buffers():
            out[name] = b.detach().clone()
        return out

    def close(self, *, restore: bool = False) -> None:
        """Remove every temporary file (idempotent). With ``restore``, first copy the
        streamed parameters back into the model (it then holds all of them again)."""
        if restore and self.store is not None:
            with torch.no_grad():
                for i in self.streamed:
                    for p, v in zip(self._own[i], self.store.read(i), strict=True):
                        p.data = v.to(self.device)
        for i in list(self._loaded):
            try:
                self._unload(i)
            except Exception:  # closing after a failure: removing the files matters
                self._loaded.pop(i, None)
        if self.store is not None:
            self.store.close()
        if self._finalizer is not None:
            self._finalizer()  # removes the work directory

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
