"""On-disk state of streamed blocks: parameters, gradients and AdamW state, one file each.

A block's file holds, in page-aligned sections: its parameters, optionally a gradient
accumulator (micro-batches, tied parameters), AdamW's ``exp_avg`` and ``exp_avg_sq``,
and one ``step`` per parameter. Sections are mapped with ``np.memmap`` (shared, so
writes through a mapping land in the file) and handed out as torch views:

- ``load(key)`` maps the parameters; the caller points each ``Parameter.data`` at them
  for the block's forward or backward, and drops every view afterwards: a mapping
  counts in RSS until it and every tensor view of it are gone.
- ``adamw_step(key, params, grads)`` applies ``torch.optim``'s own AdamW arithmetic
  (the functional ``adamw``, ``foreach=False``: the same per-element kernel
  ``torch.optim.AdamW`` runs on CPU) to the mapped parameters in place, mapping the
  optimizer state a chunk at a time, so the update's working set stays at
  ``chunk_bytes`` whatever the size of the block.
- ``flush(key)`` (after the views are dropped): ``fsync`` then
  ``posix_fadvise(DONTNEED)``, so dirty pages neither pile up in the page cache nor
  linger. Each block's ``step`` is written after its tensors: a block whose step was
  not advanced was not (fully) updated. The store is scratch space for one run, so
  this is as atomic as it needs to be; it is removed by ``close()``.

``check_directory`` verifies, before training starts, that a directory is writable and
has room for what a plan will put there.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.optim.adamw import adamw

from memory.errors import OffloadDirError
from memory.sizes import format_bytes

logger = logging.getLogger(__name__)

PAGE = 4096
_ALIGN = 64  # bytes between tensors inside a section


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def check_directory(
    directory: str | os.PathLike, bytes_needed: int, *, what: str
) -> Path:
    """``directory``, created if missing, checked to be writable with room for
    ``bytes_needed`` bytes.

    Args:
        directory: the offload directory.
        bytes_needed: what the plan writes there.
        what: what goes there, in words, for the message.

    Raises:
        OffloadDirError: it cannot be created, is not a writable directory, or has less
            free space than needed.
    """
    path = Path(directory).expanduser()
    fix = (
        "choose another directory (offload_dir / --offload-dir), free space there, or "
        "give a smaller disk budget so that the plan keeps more in memory"
    )
    need = format_bytes(bytes_needed)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".fleetfit-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OffloadDirError(
            f"offload directory {str(path)!r} is not writable ({e.strerror or e}); "
            f"the plan needs {need} ({bytes_needed} bytes) there for {what}; {fix}",
            directory=str(path),
            bytes_needed=bytes_needed,
            bytes_free=None,
        ) from e
    free = shutil.disk_usage(path).free
    if free < bytes_needed:
        raise OffloadDirError(
            f"offload directory {str(path)!r} has {format_bytes(free)} free but the plan "
            f"needs {need} ({bytes_needed} bytes) there for {what}; {fix}",
            directory=str(path),
            bytes_needed=bytes_needed,
            bytes_free=free,
        )
    return path


@dataclass(frozen=True)
class _Slot:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    offset: int  # within its section


@dataclass
class _BlockFile:
    path: Path
    fd: int
    slots: list[_Slot]
    section_bytes: int  # bytes of one section (page aligned)
    params: int  # file offsets of the sections
    grads: int | None
    exp_avg: int
    exp_avg_sq: int
    steps: int
    has_grad: list[bool]


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[_Slot], int]:
    slots, off = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        slots.append(_Slot(tuple(t.shape), t.dtype, nbytes, off))
        off = _round_up(off + nbytes, _ALIGN)
    return slots, _round_up(max(off, 1), PAGE)


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


def _adamw_chunk(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """``torch.optim``'s functional AdamW on one chunk, in place (``foreach=False``:
    the per-element kernel ``torch.optim.AdamW`` runs on CPU)."""
    adamw(
        [p],
        [g],
        [exp_avg],
        [exp_avg_sq],
        [],
        [torch.tensor(step)],
        foreach=False,
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


class BlockStore:
    """Parameters, gradients and AdamW state of streamed blocks, in files.

    Args:
        directory: where the store's own temporary directory is made (it must exist
            and be writable; see ``check_directory``).
        chunk_bytes: most bytes of optimizer state mapped at once during an update.

    Example:
        >>> store = BlockStore(tmp_dir)  # doctest: +SKIP
        >>> store.add(3, list(block.parameters()))
        >>> views = store.load(3)  # mapped; point each Parameter.data at its view
        >>> ...  # forward, backward
        >>> store.adamw_step(3, views, grads, lr=1e-3)
        >>> del views; store.flush(3)
        >>> store.close()
    """

    def __init__(
        self, directory: str | os.PathLike, *, chunk_bytes: int = 16 * 2**20
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fleetfit-store-", dir=directory))
        self.chunk_bytes = chunk_bytes
        self._blocks: dict[int, _BlockFile] = {}

    @staticmethod
    def bytes_needed(
        tensors: Sequence[torch.Tensor], *, with_grads: bool = False
    ) -> int:
        """Bytes of the file that ``add(key, tensors, with_grads=...)`` writes."""
        _, section = _layout(tensors)
        steps = _round_up(max(4 * len(tensors), 1), PAGE)
        return section * (4 if with_grads else 3) + steps

    def add(
        self, key: int, tensors: Sequence[torch.Tensor], *, with_grads: bool = False
    ) -> None:
        """Write ``tensors`` as block ``key``'s parameters, with zero AdamW state."""
        assert key not in self._blocks, f"block {key} is already stored"
        slots, section = _layout(tensors)
        path = self.root / f"block-{key}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        off = 0
        params, off = off, off + section
        grads = None
        if with_grads:
            grads, off = off, off + section
        exp_avg, off = off, off + section
        exp_avg_sq, off = off, off + section
        steps = off
        size = steps + _round_up(max(4 * len(tensors), 1), PAGE)
        try:
            os.ftruncate(fd, size)  # zeros: AdamW's initial state, step 0
            for slot, t in zip(slots, tensors, strict=True):
                os.pwrite(fd, _tensor_bytes(t).data, params + slot.offset)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException:
            os.close(fd)
            raise
        self._blocks[key] = _BlockFile(
            path,
            fd,
            slots,
            section,
            params,
            grads,
            exp_avg,
            exp_avg_sq,
            steps,
            [False] * len(slots),
        )

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def _map(self, b: _BlockFile, start: int, nbytes: int) -> torch.Tensor:
        mm = np.memmap(b.path, dtype=np.uint8, mode="r+", offset=start, shape=(nbytes,))
        return torch.from_numpy(mm)

    def _views(
        self, b: _BlockFile, section: int, indices: Sequence[int]
    ) -> list[torch.Tensor]:
        lo = min(b.slots[i].offset for i in indices)
        hi = max(b.slots[i].offset + b.slots[i].nbytes for i in indices)
        base = self._map(b, section + lo, max(hi - lo, 1))
        out = []
        for i in indices:
            s = b.slots[i]
            raw = base[s.offset - lo : s.offset - lo + s.nbytes]
            out.append(raw.view(s.dtype).view(s.shape))
        return out

    def load(
        self, key: int, indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Block ``key``'s parameters (those at ``indices``), as views of one mapping.

        Writes to the views go to the file. Drop every view to unmap.
        """
        b = self._blocks[key]
        idx = range(len(b.slots)) if indices is None else indices
        return self._views(b, b.params, list(idx)) if len(idx) else []

    def accumulate_grads(self, key: int, grads: dict[int, torch.Tensor]) -> None:
        """Add ``grads`` (by parameter index) to block ``key``'s gradient accumulator."""
        b = self._blocks[key]
        if not grads:
            return
        assert b.grads is not None, f"block {key} was stored without gradients"
        order = sorted(grads)
        views = self._views(b, b.grads, order)
        for i, v in zip(order, views, strict=True):
            g = grads[i].detach().to("cpu")
            if b.has_grad[i]:
                v.add_(g)
            else:
                v.copy_(g)
                b.has_grad[i] = True
        del views
        assert b.grads is not None
        self._sync(b, b.grads, b.section_bytes)

    def accumulate_grads_chunked(
        self, key: int, grads: dict[int, torch.Tensor]
    ) -> None:
        """``accumulate_grads``, mapping the accumulator a chunk at a time: the
        mapped pages stay at ``chunk_bytes`` (a large tied head's gradient goes to
        disk without a second copy of it resident)."""
        b = self._blocks[key]
        if not grads:
            return
        assert b.grads is not None, f"block {key} was stored without gradients"
        dense = {}
        for i, g in grads.items():
            if g.layout == torch.sparse_coo:
                self.accumulate_sparse(key, i, g)
            else:
                dense[i] = g
        for i in sorted(dense):
            g = dense[i].detach().to("cpu").reshape(-1)
            s = b.slots[i]
            esize = g.element_size()
            per = max(self.chunk_bytes // esize, 1)
            for a in range(0, g.numel(), per):
                z = min(a + per, g.numel())
                v = self._map(b, b.grads + s.offset + a * esize, (z - a) * esize)
                v = v.view(s.dtype)
                if b.has_grad[i]:
                    v.add_(g[a:z])
                else:
                    v.copy_(g[a:z])
                del v
            b.has_grad[i] = True
        self._sync(b, b.grads, b.section_bytes)

    # ------------------------------------------------------------- by rows
    def _rows(
        self, b: _BlockFile, section: int, index: int, start: int, stop: int
    ) -> torch.Tensor:
        s = b.slots[index]
        row = s.nbytes // max(s.shape[0], 1) if s.shape else s.nbytes
        raw = self._map(
            b, section + s.offset + start * row, max((stop - start) * row, 1)
        )
        return (
            raw[: (stop - start) * row].view(s.dtype).view(stop - start, *s.shape[1:])
        )

    def load_rows(self, key: int, index: int, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of parameter ``index`` (its first dimension), mapped
        on their own: only these rows' pages are touched and they leave memory with
        the view."""
        return self._rows(
            self._blocks[key], self._blocks[key].params, index, start, stop
        )

    def accumulate_rows(
        self,
        key: int,
        index: int,
        start: int,
        stop: int,
        grad: torch.Tensor,
        *,
        first: bool,
    ) -> None:
        """Rows ``[start, stop)`` of parameter ``index``'s gradient into the
        accumulator, mapped on their own: copied when ``first`` (the accumulator held
        nothing for this parameter when this backward began), added otherwise. Call
        ``rows_done`` after the last rows of a backward."""
        b = self._blocks[key]
        assert b.grads is not None, f"block {key} was stored without gradients"
        v = self._rows(b, b.grads, index, start, stop)
        g = grad.detach().to("cpu")
        if first:
            v.copy_(g)
        else:
            v.add_(g)
        del v

    def rows_done(self, key: int, index: int) -> None:
        """Every row of parameter ``index``'s gradient was written (``accumulate_rows``):
        the accumulator holds it; its dirty pages go to disk."""
        b = self._blocks[key]
        b.has_grad[index] = True
        assert b.grads is not None
        self._sync(b, b.grads, b.section_bytes)

    def accumulate_sparse(self, key: int, index: int, grad: torch.Tensor) -> None:
        """A sparse (COO, row-wise) gradient of parameter ``index``, such as an
        embedding lookup's, into the accumulator: its rows are summed first
        (``index_add_`` in the order of the indices, as the dense embedding backward
        sums them, so the sum is the same bit for bit) and each touched row is added
        once; only those rows' pages are touched. An empty accumulator is zeroed
        first (written, not mapped)."""
        b = self._blocks[key]
        assert b.grads is not None, f"block {key} was stored without gradients"
        assert grad.layout == torch.sparse_coo, "a sparse COO gradient"
        idx = grad._indices()[0]
        vals = grad._values().detach().to("cpu")
        rows, inverse = torch.unique(idx.to("cpu"), return_inverse=True)
        summed = vals.new_zeros((rows.numel(), *vals.shape[1:]))
        summed.index_add_(0, inverse, vals)
        del vals, inverse
        s = b.slots[index]
        if not b.has_grad[index]:
            zeros = bytes(min(s.nbytes, 2**20))
            at, end = b.grads + s.offset, b.grads + s.offset + s.nbytes
            while at < end:
                at += os.pwrite(b.fd, zeros[: end - at], at)
            b.has_grad[index] = True
        if rows.numel():
            v = self._rows(b, b.grads, index, 0, s.shape[0])
            v.index_add_(0, rows, summed.to(s.dtype))
            del v
        self._sync(b, b.grads, b.section_bytes)

    def adamw_step_mapped(
        self,
        key: int,
        grads: Sequence[torch.Tensor | None],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        scale: torch.Tensor | None = None,
    ) -> None:
        """``adamw_step`` on the parameters in the file, mapping parameters, stored
        gradients and state a chunk at a time (CPU): the update's resident working
        set stays a few chunks whatever the size of the block. ``scale`` multiplies
        the full gradient first (global-norm clipping). A sparse gradient (an
        embedding lookup's) goes to the accumulator first (``accumulate_sparse``).
        Same arithmetic, element by element, as ``adamw_step``."""
        b = self._blocks[key]
        grads = list(grads)
        for i, g in enumerate(grads):
            if g is not None and g.layout == torch.sparse_coo:
                self.accumulate_sparse(key, i, g)  # then updated from the store
                grads[i] = None
        steps_map = self._map(b, b.steps, 4 * len(b.slots)).view(torch.float32)
        for i, g in enumerate(grads):
            s = b.slots[i]
            if g is None and not b.has_grad[i]:
                continue
            step = float(steps_map[i])
            esize = torch.empty(0, dtype=s.dtype).element_size()
            n = int(torch.Size(s.shape).numel())
            per = max(self.chunk_bytes // esize // 1024 * 1024, 1024)
            g_flat = None if g is None else g.detach().reshape(-1)
            for a in range(0, n, per):
                z = min(a + per, n)
                off, nb = s.offset + a * esize, (z - a) * esize
                p = self._map(b, b.params + off, nb).view(s.dtype)
                if b.has_grad[i]:
                    assert b.grads is not None
                    stored = self._map(b, b.grads + off, nb).view(s.dtype)
                    gc = (
                        stored.clone()
                        if g_flat is None
                        else g_flat[a:z].clone().add_(stored)
                    )
                    del stored
                else:
                    assert g_flat is not None
                    gc = g_flat[a:z]
                if scale is not None:
                    gc = gc * scale
                ea = self._map(b, b.exp_avg + off, nb).view(s.dtype)
                eas = self._map(b, b.exp_avg_sq + off, nb).view(s.dtype)
                _adamw_chunk(p, gc, ea, eas, step, lr, betas, eps, weight_decay)
                del p, gc, ea, eas
            b.has_grad[i] = False
            steps_map[i] = step + 1  # written after the tensors
        del steps_map
        self._sync(b)

    def has_grad(self, key: int, index: int) -> bool:
        """The accumulator holds a gradient of parameter ``index``."""
        return self._blocks[key].has_grad[index]

    def has_grads(self, key: int) -> bool:
        return any(self._blocks[key].has_grad)

    def stored_grad(self, key: int, index: int) -> torch.Tensor | None:
        """A mapped view of parameter ``index``'s accumulated gradient, or None."""
        b = self._blocks[key]
        if not b.has_grad[index]:
            return None
        assert b.grads is not None
        return self._views(b, b.grads, [index])[0]

    def adamw_step(
        self,
        key: int,
        params: Sequence[torch.Tensor | None],
        grads: Sequence[torch.Tensor | None],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        """One AdamW step on block ``key``: ``params[i] -= ...`` in place.

        ``params`` are the (mapped or device) tensors to update, ``grads`` their full
        gradients (None: no update, like ``torch.optim.AdamW`` skipping a parameter
        without a gradient). Accumulated gradients are added first and then cleared.
        """
        b = self._blocks[key]
        steps_map = self._map(b, b.steps, 4 * len(b.slots)).view(torch.float32)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            stored = self.stored_grad(key, i)
            if stored is not None:
                g = stored.clone() if g is None else g.add_(stored.to(g.device))
                b.has_grad[i] = False
            del stored
            if g is None or p is None:
                continue
            step = float(steps_map[i])
            self._update(b, i, p, g, step, lr, betas, eps, weight_decay)
            steps_map[i] = step + 1  # written after the tensors
        del steps_map

    def _update(
        self,
        b: _BlockFile,
        i: int,
        p: torch.Tensor,
        g: torch.Tensor,
        step: float,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        s = b.slots[i]
        esize = torch.empty(0, dtype=s.dtype).element_size()
        n = p.numel()
        # whole vector lanes per chunk, so elements meet the same kernel paths
        per = max(self.chunk_bytes // esize // 1024 * 1024, 1024)
        p_flat, g_flat = p.view(-1), g.reshape(-1).to(p.device)
        for a in range(0, n, per):
            z = min(a + per, n)
            ea = self._map(b, b.exp_avg + s.offset + a * esize, (z - a) * esize)
            eas = self._map(b, b.exp_avg_sq + s.offset + a * esize, (z - a) * esize)
            ea_t, eas_t = ea.view(s.dtype).to(p.device), eas.view(s.dtype).to(p.device)
            _adamw_chunk(
                p_flat[a:z],
                g_flat[a:z],
                ea_t,
                eas_t,
                step,
                lr,
                betas,
                eps,
                weight_decay,
            )
            if p.device.type != "cpu":  # state was copied to the device: write back
                ea.view(s.dtype).copy_(ea_t)
                eas.view(s.dtype).copy_(eas_t)
            del ea, eas, ea_t, eas_t

    def write_params(self, key: int, params: Sequence[torch.Tensor]) -> None:
        """Copy device tensors back into block ``key``'s parameter section (CUDA)."""
        b = self._blocks[key]
        views = self._views(b, b.params, list(range(len(b.slots))))
        for v, p in zip(views, params, strict=True):
            v.copy_(p)
        del views

    def flush(self, key: int) -> None:
        """Write block ``key``'s dirty pages and drop them from the page cache.

        Call it after every view of the block is dropped: pages still mapped stay.
        """
        self._sync(self._blocks[key])

    @staticmethod
    def _sync(b: _BlockFile, start: int = 0, length: int = 0) -> None:
        """Write the file's dirty pages and drop bytes ``[start, start + length)``
        (the whole file for ``length`` 0) from the page cache. After a gradient
        accumulation only its section is dropped: the parameters, only read since the
        last update, stay cached for the next micro-batch's load (clean pages: not in
        any process's RSS once unmapped, and reclaimable)."""
        os.fsync(b.fd)
        os.posix_fadvise(b.fd, start, length, os.POSIX_FADV_DONTNEED)

    def read(self, key: int) -> list[torch.Tensor]:
        """Copies (not mappings) of block ``key``'s parameters."""
        return [v.clone() for v in self.load(key)]

    def read_state(self, key: int) -> list[dict[str, torch.Tensor]]:
        """Copies of block ``key``'s AdamW state, one dict per parameter, in the form
        ``torch.optim.AdamW.state`` holds it."""
        b = self._blocks[key]
        idx = list(range(len(b.slots)))
        ea = self._views(b, b.exp_avg, idx)
        eas = self._views(b, b.exp_avg_sq, idx)
        steps = self._map(b, b.steps, 4 * len(b.slots)).view(torch.float32)
        return [
            {
                "step": steps[i].clone(),
                "exp_avg": ea[i].clone(),
                "exp_avg_sq": eas[i].clone(),
            }
            for i in idx
        ]

    @property
    def nbytes(self) -> int:
        """Bytes on disk (file sizes)."""
        return sum(b.path.stat().st_size for b in self._blocks.values())

    def close(self) -> None:
        """Close and remove every file (idempotent)."""
        for b in self._blocks.values():
            try:
                os.close(b.fd)
            except OSError:
                pass
        self._blocks = {}
        shutil.rmtree(self.root, ignore_errors=True)
