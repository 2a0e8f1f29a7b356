"""Where a loader's tensors came from: rows of a checkpoint file, so an offloaded shard loaded
from them is not written to its store.

A Hugging Face load into disk-offloaded shards read each shard's rows from the checkpoint, cast
them (bf16 to fp32) and wrote them to the store: at 3B on this machine 6.4 GB read and 12.9 GB
written in 34 s. The first optimizer step writes a new version of every shard anyway, so until
then the shard's values can stay where they are: the rows in the checkpoint (``store.FileRows``),
read and cast by every reload (with the rows cast as they are read, the 3B load takes 7.8 s).

``tracking()`` is entered by the loader around its reads; ``record`` notes each tensor it read
from a file (its path, the file's identity, the byte offset, the file's dtype) and keeps the
last few alive; ``take_origin(values)`` gives the rows a shard's values were read from if
``values`` is a recorded tensor, or one that cast to the shard's dtype equals bit for bit:
anything the loader did in between (a key converter, a transpose, a concatenation) that changed
them makes the shard be written as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_KEPT = 2  # tensors read and not yet adopted (the loader reads one tensor at a time)
_CHUNK = 1 << 22  # elements compared at a time


@dataclass(frozen=True)
class Origin:
    path: str
    identity: tuple  # store.file_identity of the file as it was read
    offset: int  # bytes from the file's start
    dtype: torch.dtype  # in the file


_local = threading.local()


@contextlib.contextmanager
def tracking(dtype: torch.dtype | None = None) -> Iterator[None]:
    """Tensors ``record``ed in the block can be found by ``take_origin``. ``dtype``: the shards'
    (where they all have one), which a reader may cast into as it reads (``target_dtype``)."""
    previous = getattr(_local, "recent", None), getattr(_local, "dtype", None)
    _local.recent, _local.dtype = deque(maxlen=_KEPT), dtype
    try:
        yield
    finally:
        _local.recent, _local.dtype = previous


def tracked() -> bool:
    return getattr(_local, "recent", None) is not None


def record(tensor: torch.Tensor, path: str, fd: int, offset: int, dtype: torch.dtype) -> None:
    """``tensor`` holds the elements of ``dtype`` at ``offset`` of the file ``path`` (open as
    ``fd``), cast to its own dtype."""
    recent = getattr(_local, "recent", None)
    if recent is None:
        return
    from .store import file_identity

    origin = Origin(os.fspath(path), file_identity(os.fstat(fd)), offset, dtype)
    recent.append((tensor, origin))


def target_dtype() -> torch.dtype | None:
    """The dtype a tracking loader should cast what it reads into (``tracking(dtype)``)."""
    return getattr(_local, "dtype", None) if tracked() else None


def take_origin(values: torch.Tensor) -> Origin | None:
    """Where ``values`` were read from, if a recorded tensor gives exactly them cast to their
    dtype (then forgotten: each read is one shard's); None otherwise."""
    recent = getattr(_local, "recent", None)
    if not recent or values.device.type != "cpu" or not values.is_contiguous():
        return None
    for index, (read, origin) in enumerate(recent):
        if read.shape == values.shape and _same(read, values):
            del recent[index]
            return origin
    return None


def _same(read: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``read`` cast to ``values``' dtype is ``values``, bit for bit (cast a chunk at a
    time into one buffer: a fresh temporary per chunk is page-faulted in every time)."""
    if read.dtype == values.dtype and read.data_ptr() == values.data_ptr():
        return True
    bits = _BITS.get(values.element_size())
    if bits is None or values.dtype is torch.bool or values.is_complex():
        return False
    a, b = read.reshape(-1), values.reshape(-1)
    buffer = torch.empty(min(_CHUNK, a.numel()), dtype=values.dtype)
    for i in range(0, a.numel(), _CHUNK):
        part = a[i : i + _CHUNK]
        cast = buffer[: part.numel()]
        cast.copy_(part)
        if not torch.equal(cast.view(bits), b[i : i + _CHUNK].view(bits)):
            return False
    return True


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


__all__ = ["Origin", "record", "take_origin", "target_dtype", "tracked", "tracking"]
