"""Hashing the files of a checkpoint: as the writer writes them (``HashingFileSystem``, so
sealing need not read them back) and read back (``hashed_read``, each chunk read while the one
before it is hashed)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint.filesystem import FileSystem

_HASH_CHUNK = 2 << 20  # bytes read at a time to hash a file


class HashingFileSystem(FileSystem):
    """The checkpoint writer's file system: each file opened for writing is hashed as its bytes
    go out (in the writer's threads), so sealing does not read the checkpoint back."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.sha is not None:
            with self._lock:
                self.digests[os.fspath(path)] = (hashing.size, hashing.sha.hexdigest())


class _HashingStream(io.RawIOBase):
    """A file being written from its start, hashed on the way; any seek gives the hash up."""

    def __init__(self, raw) -> None:
        self.raw, self.size, self.sha = raw, 0, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        written = self.raw.write(data)
        if self.sha is not None:
            view = memoryview(data).cast("B")[:written]
            self.sha.update(view)
            self.size += len(view)
        return written

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.sha = None
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()


def file_digest(path: str) -> tuple[int, str]:
    size, digest, _ = hashed_read(path, keep=False)
    return size, digest


def hashed_read(path: str, keep: bool) -> tuple[int, str, memoryview | None]:
    """(size, sha256, with ``keep`` the bytes) of the file at ``path``; each chunk is read while
    the one before it is hashed (both give up the GIL: the disk and the hashing overlap)."""
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as reader:
        whole = memoryview(bytearray(os.fstat(f.fileno()).st_size)) if keep else None
        spare = [memoryview(bytearray(_HASH_CHUNK)) for _ in range(0 if keep else 2)]

        def read(index: int) -> memoryview:
            if whole is None:
                view = spare[index % 2]
            else:
                view = whole[index * _HASH_CHUNK : (index + 1) * _HASH_CHUNK]
            done = 0
            while done < len(view) and (n := f.readinto(view[done:])):
                done += n
            return view[:done]

        size, index, chunk = 0, 0, read(0)
        while len(chunk):
            following = reader.submit(read, index + 1)
            sha.update(chunk)
            size += len(chunk)
            index += 1
            chunk = following.result()
    return size, sha.hexdigest(), None if whole is None else whole[:size]
