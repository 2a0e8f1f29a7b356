"""This rank's rows of a safetensors tensor, read with a few large ``preadv`` calls.

Hugging Face's loader asks each tensor for this rank's rows through ``get_slice(key)[rows, :,
...]``. safetensors' own slices read them at about a quarter of the disk's bandwidth from a
cold page cache here (0.25 GB/s against 0.93 GB/s for the same bytes read in 64 MiB
``preadv`` calls: ``bench/RESULTS.md``, "Big models"). A slice of whole rows of a row-major
tensor is one contiguous byte range, so ``RowSlice`` reads it straight into a tensor's memory in
large chunks; any other index (strided, inner-dimension slices) goes to safetensors' own slice.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import torch

from ..offload import origins
from ..offload.store import pread_all, pread_cast

CHUNK = 64 << 20  # bytes per preadv call

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


def header(path: str) -> tuple[dict[str, Any], int]:
    """The safetensors header of ``path`` (name -> dtype, shape, data_offsets) and the byte
    offset its data starts at."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(size))
    entries.pop("__metadata__", None)
    return entries, 8 + size


class RowSlice:
    """``get_slice`` of one tensor: whole-row indices read directly, others by ``fallback()``."""

    def __init__(
        self,
        path: str,
        fd: int,
        entry: dict,
        data_start: int,
        fallback: Callable[[], Any],
        cast_to: torch.dtype | None = None,
    ):
        self.path = path
        self.fd = fd
        self.cast_to = cast_to  # floating rows are returned in it (the model's dtype)
        self.dtype_name = entry["dtype"]
        self.shape = list(entry["shape"])
        self.start = data_start + entry["data_offsets"][0]
        self.fallback = fallback

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype_name

    def __getitem__(self, index):
        rows = self._rows(index)
        dtype = _DTYPES.get(self.dtype_name)
        if rows is None or dtype is None:
            return self.fallback()[index]
        first, last = rows
        shape = (last - first, *self.shape[1:]) if self.shape else ()
        row_bytes = math.prod(self.shape[1:]) * dtype.itemsize
        offset = self.start + first * row_bytes
        cast = self.cast_to
        if (
            cast is not None
            and cast != dtype
            and dtype.is_floating_point
            and cast.is_floating_point
        ):
            # cast as read, a chunk at a time: the loader's own cast would allocate the tensor
            # again, and the offloaded shard can then take it as the file's rows unchecked
            out = torch.empty(shape, dtype=cast)
            pread_cast(self.fd, self.path, out.view(-1), offset, dtype)
        else:
            out = torch.empty(shape, dtype=dtype)
            self._read(out, offset)
        # an offloaded shard adopting these values leaves them in the file (offload/origins.py)
        origins.record(out, self.path, self.fd, offset, dtype)
        return out

    def _rows(self, index) -> tuple[int, int] | None:
        """(first, last) row of an index that takes whole rows in order; None otherwise."""
        if index is Ellipsis:
            index = ()
        if not isinstance(index, tuple):
            index = (index,)
        if index and index[-1] is Ellipsis:
            index = index[:-1]
        if not self.shape:
            return (0, 1) if not index else None
        if len(index) > len(self.shape) or not all(isinstance(i, slice) for i in index):
            return None
        for dim, part in enumerate(index[1:], start=1):
            if part.indices(self.shape[dim]) != (0, self.shape[dim], 1):
                return None
        if not index:
            return 0, self.shape[0]
        first, last, step = index[0].indices(self.shape[0])
        if step != 1:
            return None
        return first, max(first, last)

    def _read(self, out: torch.Tensor, offset: int) -> None:
        if out.numel():
            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            pread_all(self.fd, self.path, view, offset, CHUNK)
