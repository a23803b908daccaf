"""Read single tensors from a safetensors file with plain reads, not a memory map.

``safetensors.safe_open`` maps the whole file: every page a read touches stays in the
process's resident set until the mapping closes, so loading a model block by block
through it would count the whole file in the peak. ``TensorFile`` reads each tensor's
bytes with ``os.pread`` into fresh memory and nothing else stays resident.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memory.errors import MemoryPlanError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20


class TensorFile:
    """A safetensors file whose tensors are read one at a time by name.

    Raises:
        MemoryPlanError: the file is missing, truncated or not safetensors.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise MemoryPlanError(f"cannot open tensor file {self.path}: {e}") from e
        try:
            size = os.fstat(self._fd).st_size
            raw = os.pread(self._fd, 8, 0)
            if len(raw) < 8:
                raise MemoryPlanError(
                    f"{self.path} is not a safetensors file (too short)"
                )
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise MemoryPlanError(f"{self.path} is not a safetensors file (header)")
            header = json.loads(os.pread(self._fd, n, 8))
            header.pop("__metadata__", None)
            self._base = 8 + n
            self._entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                if (
                    entry["dtype"] not in _DTYPES
                    or not 0 <= begin <= end <= size - self._base
                ):
                    raise MemoryPlanError(f"{self.path}: bad entry for {name!r}")
                self._entries[name] = (
                    _DTYPES[entry["dtype"]],
                    list(entry["shape"]),
                    begin,
                    end,
                )
        except (ValueError, KeyError, TypeError) as e:
            os.close(self._fd)
            raise MemoryPlanError(f"{self.path} is not a safetensors file: {e}") from e
        except BaseException:
            os.close(self._fd)
            raise

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in fresh memory."""
        if name not in self._entries:
            raise MemoryPlanError(f"{self.path} has no tensor {name!r}")
        dtype, shape, begin, end = self._entries[name]
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        done = 0
        while done < end - begin:
            got = os.preadv(self._fd, [view[done:]], self._base + begin + done)
            if got <= 0:
                raise MemoryPlanError(f"{self.path} is truncated at {name!r}")
            done += got
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_NAMES = {v: k for k, v in _DTYPES.items()}


def write_tensors(
    path: str | os.PathLike,
    entries: Sequence[tuple[str, torch.dtype, list[int], Callable[[], torch.Tensor]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a safetensors file one tensor at a time.

    ``entries`` are ``(name, dtype, shape, fetch)``: the header is written from the
    shapes first, then each ``fetch()`` is called, its bytes written and the tensor
    dropped, so at most one tensor is in memory (a streamed unit's parameter mapped
    from its store, for example). The file appears under ``path`` only when complete
    (written next to it and renamed).
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape, _fetch in entries:
        if dtype not in _NAMES:
            raise MemoryPlanError(f"tensor {name!r}: dtype {dtype} cannot be written")
        nbytes = torch.empty(0, dtype=dtype).element_size() * int(
            torch.Size(shape).numel()
        )
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    target = Path(path)
    tmp = target.with_name(target.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape, fetch in entries:
            t = fetch()
            if t.dtype != dtype or list(t.shape) != list(shape):
                raise MemoryPlanError(
                    f"tensor {name!r} changed from {dtype}{list(shape)} to "
                    f"{t.dtype}{list(t.shape)} while it was written"
                )
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
