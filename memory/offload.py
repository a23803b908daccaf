"""Activation offload: a block's saved tensors go to a file (CPU) or host memory (CUDA).

``ActivationOffload(directory)`` hands out one ``OffloadedActivations`` per block and
micro-batch. Its ``hooks()`` are ``torch.autograd.graph.saved_tensors_hooks``: every
tensor the block's forward saves for backward is packed into a handle; ``commit(out)``
after the forward writes the packed storages out and drops them from memory; backward
unpacks them from the file. Results are bit-identical: only bytes move.

What stays in memory:
- tensors whose storage is a parameter's or the block's input (``keep``): they live
  anyway, so writing them would only add a second copy on the way back;
- the block's output storage (held by the next block), resolved at ``commit``;
- tensors under ``min_bytes`` (not worth a write).

Handles are keyed by storage, so views that share a storage (q, k, v split from one
projection) are written once and come back as views of one storage again, with their
original offsets and strides.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO

import torch

from memory.errors import OffloadDirError

logger = logging.getLogger(__name__)


class _Stored:
    """One storage that saved tensors point into."""

    __slots__ = ("tensor", "version", "nbytes", "file_offset", "live", "host", "cache")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor  # keeps the storage until commit
        self.version = tensor._version
        self.nbytes = tensor.untyped_storage().nbytes()
        self.file_offset = -1
        self.live: torch.UntypedStorage | None = None  # stays in memory (block output)
        self.host: torch.Tensor | None = None  # CUDA: bytes in host memory
        self.cache: weakref.ref[torch.UntypedStorage] | None = None


class _Handle:
    __slots__ = ("stored", "dtype", "offset", "size", "stride", "device")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.size = t.shape
        self.stride = t.stride()
        self.device = t.device


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadedActivations:
    """The saved tensors of one block's forward on one micro-batch.

    Use ``with acts.hooks(): out = block(x)``, then ``acts.commit(out)``; run the
    block's backward; then ``acts.release()`` (removes the file).
    """

    def __init__(
        self, path: Path | None, keep: Iterable[torch.Tensor], min_bytes: int
    ) -> None:
        self.path = path  # None: host memory (CUDA)
        self.min_bytes = min_bytes
        self._keep = {t.untyped_storage().data_ptr() for t in keep if t.numel()}
        self._pending: dict[int, _Stored] = {}
        self._file: BinaryIO | None = None
        self.bytes_offloaded = 0

    def hooks(self) -> AbstractContextManager:
        """The saved-tensor hooks to run the block's forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._keep or storage.nbytes() < self.min_bytes or t.is_sparse:
            return t
        stored = self._pending.get(ptr)
        if stored is None:
            stored = self._pending[ptr] = _Stored(t)
        return _Handle(stored, t)

    def commit(self, out: torch.Tensor | None = None) -> None:
        """Move the packed storages out of memory; keep ``out``'s storage referenced."""
        out_ptr = out.untyped_storage().data_ptr() if out is not None else None
        for ptr, stored in self._pending.items():
            t = stored.tensor
            assert t is not None
            if t._version != stored.version:
                raise RuntimeError(
                    "a tensor saved for backward was modified in place during the "
                    "forward of an offloaded block; backward would use stale values"
                )
            storage = t.untyped_storage()
            if ptr == out_ptr:
                stored.live = storage
            elif self.path is None:
                stored.host = _bytes_of(storage).to("cpu", copy=True)
                self.bytes_offloaded += stored.nbytes
            else:
                try:
                    if self._file is None:
                        self._file = open(self.path, "wb+")  # noqa: SIM115 - released
                    stored.file_offset = self._file.tell()
                    self._file.write(_bytes_of(storage).numpy().data)
                    self._file.flush()
                except OSError as e:  # full or vanished: name the place and the fix
                    done = self.bytes_offloaded
                    self.release()  # close and remove the partial file: free the disk
                    raise OffloadDirError(
                        f"offloading activations to {self.path} failed after "
                        f"{done} bytes ({e.strerror or e}): free space "
                        "there, choose another offload directory, or give a disk "
                        "budget of 0 (no offload)",
                        directory=str(Path(self.path).parent),
                        bytes_needed=done + stored.nbytes,
                        bytes_free=None,
                    ) from e
                self.bytes_offloaded += stored.nbytes
            stored.tensor = None
        self._pending = {}
        if self._file is not None:
            self._file.flush()

    def _unpack(self, h: object) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        assert isinstance(h, _Handle)
        stored = h.stored
        storage: torch.UntypedStorage | None
        if stored.tensor is not None:  # backward before commit (not our executor)
            storage = stored.tensor.untyped_storage()
        elif stored.live is not None:
            storage = stored.live
        else:
            storage = stored.cache() if stored.cache is not None else None
            if storage is None:
                storage = self._load(stored, h.device)
                stored.cache = weakref.ref(storage)
        return torch.empty(0, dtype=h.dtype, device=h.device).set_(
            storage, h.offset, h.size, h.stride
        )

    def _load(self, stored: _Stored, device: torch.device) -> torch.UntypedStorage:
        if stored.host is not None:
            return stored.host.to(device).untyped_storage()
        assert self._file is not None, "saved activations were released"
        buf = torch.empty(stored.nbytes, dtype=torch.uint8)
        got = os.preadv(self._file.fileno(), [buf.numpy().data], stored.file_offset)
        if got != stored.nbytes:
            raise OSError(f"short read of offloaded activations in {self.path}")
        return buf.untyped_storage()

    def release(self) -> None:
        """Drop everything and remove the file (idempotent)."""
        self._pending = {}
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class ActivationOffload:
    """Hands out ``OffloadedActivations`` whose files live in ``directory``.

    Args:
        directory: where the files go (CPU tensors); it must exist.
        min_bytes: storages smaller than this stay in memory.

    Example:
        >>> off = ActivationOffload(tmp_dir)  # doctest: +SKIP
        >>> acts = off.activations("3.0", keep=list(block.parameters()) + [x])
        >>> with acts.hooks():
        ...     y = block(x)
        >>> acts.commit(y); y.backward(g); acts.release()
    """

    def __init__(self, directory: str | os.PathLike, *, min_bytes: int = 4096) -> None:
        self.directory = Path(directory)
        self.min_bytes = min_bytes

    def activations(
        self,
        key: str,
        keep: Iterable[torch.Tensor],
        *,
        device: torch.device | str = "cpu",
    ) -> OffloadedActivations:
        """A fresh set of hooks for one block and micro-batch (``key`` names its file)."""
        on_cuda = torch.device(device).type == "cuda"
        path = None if on_cuda else self.directory / f"activations-{key}.bin"
        return OffloadedActivations(path, keep, self.min_bytes)
