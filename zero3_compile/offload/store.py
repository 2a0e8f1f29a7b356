"""Where offloaded tensors live between uses: regions of one file per rank, or host memory.

``DiskStore``: one file per rank and purpose under ``path`` (default: a private temporary folder).
The file is unlinked as soon as it is open (and the private folder removed): its space lives as
long as the descriptor, so a finished, failed or killed run never leaves swap files behind. Each tensor gets two regions (double buffering: a write goes to
the region not in use and becomes current only when ``commit()`` flips it, so an interrupted step
leaves the previous values readable). Regions are preallocated with ``posix_fallocate`` when they
are created, so later writes cannot run out of space halfway. Reads and writes are positional
(``os.preadv`` / ``os.pwritev``) on a thread pool, straight into the tensor's memory; no mmap
(mapped pages sit in the page cache and make memory figures meaningless). ``o_direct=True`` opens
the file with ``O_DIRECT`` and goes through a fixed pool of aligned staging buffers; a file system
that refuses it falls back to buffered I/O with a log line.

``HostStore``: pinned host memory for accelerator models (the "cpu" tier).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .allocator import settle_host_allocator

log = logging.getLogger(__name__)

ALIGN = 4096  # bytes: O_DIRECT transfers and the parts of a region start at this boundary


class OffloadError(OSError):
    """An offload store could not be created, written or read (names the path and the bytes).

    Example:
        ```python
        try:
            model = z3.shard(model, offload=z3.Offload(params="disk", path="/full/disk"))
        except z3.OffloadError as error:  # names the path and the bytes it could not reserve
            print(error)
        ```
    """

    def __str__(self) -> str:  # the message, then where the docs explain it
        return f"{super().__str__()}\n(docs/troubleshooting.md#offloaderror)"


class SourceFile:
    """A file some regions' committed values still are the bytes of (the checkpoint a loader read
    them from; see ``FileRows``): opened once, its identity (inode, size, modification time)
    checked before every read. The descriptor stays open until the store closes (a state dict
    handed out before a step may still read it after), so a checkpoint replaced meanwhile keeps
    its disk space until then."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.identity = file_identity(os.fstat(self.fd))

    def check(self) -> None:
        if self.fd < 0:
            raise OffloadError(
                errno.EBADF, f"zero3: the offload store reading {self.path!r} was closed"
            )
        if file_identity(os.fstat(self.fd)) != self.identity:
            raise OffloadError(
                errno.ESTALE,
                f"zero3: the checkpoint file {self.path!r} changed after it was loaded, before "
                "the first optimizer step replaced the values read from it (offloaded shards "
                "read them from the file until then); write checkpoints to a new file or folder "
                "(save_pretrained replaces files, so saving into the same folder is safe), or "
                "take a step first",
            )


def file_identity(stat: os.stat_result) -> tuple:
    """What tells a file apart from another one written at the same path since."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass(frozen=True)
class FileRows:
    """A region's committed values that are still a file's bytes: elements of ``dtype`` at byte
    ``offset`` of ``file``, cast to the region's ``stored`` dtype on every read. A loader that
    read a shard's rows from a checkpoint leaves them there instead of writing them to the store
    (half the bytes, in bf16, and no write); the first new version of the region replaces them
    (``Region.commit``)."""

    file: SourceFile
    offset: int
    dtype: torch.dtype
    stored: torch.dtype

    def read_into(self, out: torch.Tensor, start: int) -> int:
        """``out``'s bytes: the region's from byte ``start``; returns the bytes read from the
        file (in the file's dtype: one read; else one read and one cast per chunk, through this
        thread's buffer)."""
        self.file.check()
        values = out.reshape(-1).view(torch.uint8).view(self.stored)
        offset = self.offset + start // self.stored.itemsize * self.dtype.itemsize
        if self.dtype == self.stored:
            pread_all(self.file.fd, self.file.path, _memory(values), offset)
        else:
            pread_cast(self.file.fd, self.file.path, values, offset, self.dtype)
        return values.numel() * self.dtype.itemsize


def pread_cast(fd: int, path: str, values: torch.Tensor, offset: int, dtype: torch.dtype) -> None:
    """``values`` (1-D, contiguous) from elements of ``dtype`` at ``offset`` of the file open as
    ``fd``: one read and one cast per chunk, through this thread's buffer."""
    typed, raw = _cast_buffer(dtype)
    step = typed.numel()
    for i in range(0, values.numel(), step):
        count = min(step, values.numel() - i)
        pread_all(fd, path, raw[: count * dtype.itemsize], offset + i * dtype.itemsize)
        values[i : i + count].copy_(typed[:count])


def pread_all(fd: int, path: str, view: memoryview, offset: int, chunk: int | None = None) -> None:
    """All of ``view`` from ``offset`` of the file open as ``fd`` (``path`` names it), at most
    ``chunk`` bytes per call."""
    done = 0
    while done < len(view):
        end = len(view) if chunk is None else min(len(view), done + chunk)
        n = os.preadv(fd, [view[done:end]], offset + done)
        if n <= 0:
            raise OffloadError(
                errno.EIO, f"zero3: the file {path!r} ended {len(view) - done} bytes early"
            )
        done += n


_SOURCE_CHUNK = 8 << 20  # bytes of the file per read and cast (a 16 MiB fp32 piece in bf16)
_buffers = threading.local()


def _cast_buffer(dtype: torch.dtype) -> tuple[torch.Tensor, memoryview]:
    """This thread's buffer for file bytes on their way to a cast, as ``dtype`` and as bytes (one
    allocation per thread: a fresh tensor per read is a new mapping, page-faulted in each
    time)."""
    cached = getattr(_buffers, "cached", None)
    if cached is None:
        buffer = torch.empty(_SOURCE_CHUNK, dtype=torch.uint8)
        cached = _buffers.cached = (buffer, _memory(buffer), {})
    buffer, raw, typed = cached
    if dtype not in typed:
        typed[dtype] = buffer.view(dtype)
    return typed[dtype], raw


@dataclass
class Region:
    """Two slots of ``nbytes`` in a store's file; ``current`` holds the committed values.

    A single-slot region (a store with ``double_buffer=False``: half the disk) is rewritten in
    place: discarding a write then cannot bring the previous values back, so the region is
    marked lost and every later read raises ``OffloadError``.

    ``source``: the committed values are still a checkpoint file's rows (``FileRows``), read
    from there until a new version is committed or the current slot is written.
    """

    offsets: tuple[int, int]
    nbytes: int
    current: int = 0
    pending: int | None = None  # the slot written since the last commit
    lost: bool = False
    source: FileRows | None = None

    @property
    def read_offset(self) -> int:
        if self.lost:
            raise OffloadError(
                errno.EIO,
                "zero3: these offloaded values were lost: a step failed while rewriting them in "
                "place (double_buffer=False keeps one copy on disk); load a checkpoint, or "
                "offload with double_buffer=True (twice the disk) so a failed step keeps the "
                "previous values",
            )
        return self.offsets[self.current]

    def commit(self) -> None:
        """The pending slot becomes the current one (after a step that changed the values)."""
        if self.pending is not None:
            self.current, self.pending = self.pending, None
            self.source = None

    def discard(self) -> None:
        """Forget the pending slot: the current one still holds the previous values."""
        one_slot = self.offsets[0] == self.offsets[1]
        if self.pending is not None and one_slot and self.source is None:
            self.lost = True  # one slot: the write went over the current values
        self.pending = None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts at an ``ALIGN`` boundary: O_DIRECT
    reads and writes it without a staging copy."""
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.data_ptr() % ALIGN == 0:  # the host cache's blocks are: a storage of its own size
        return tensor
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes].view(dtype).view(shape)


def read_target(store, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor to read a region of ``store`` into: for an O_DIRECT store, at an aligned address
    (read straight into it, not chunk by chunk through a staging buffer and a copy)."""
    if getattr(store, "o_direct", False) and torch.device(device).type == "cpu":
        return aligned_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def _memory(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no numpy needed)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class DiskStore:
    """Tensors in regions of one file; see the module docstring."""

    def __init__(
        self,
        path: str | None,
        purpose: str,
        rank: int,
        *,
        threads: int = 4,
        o_direct: bool = False,
        staging_buffers: int = 4,
        staging_mb: float = 16.0,
        double_buffer: bool = True,
    ):
        settle_host_allocator()  # host memory that offloading saves is given back
        private = path is None
        if private:
            path = tempfile.mkdtemp(prefix="zero3-offload-")
        self.folder = os.path.abspath(path)
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as error:
            raise OffloadError(
                error.errno,
                f"zero3: cannot create the offload folder {self.folder!r}: {error.strerror}; "
                "pass Offload(path=...) / offload_optimizer(path=...) a writable folder",
            ) from error
        self.path = os.path.join(self.folder, f"rank{rank}.{purpose}.bin")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self.o_direct = False
        try:
            if o_direct and hasattr(os, "O_DIRECT"):
                try:
                    self.fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                    self.o_direct = True
                except OSError as error:
                    if error.errno != errno.EINVAL:
                        raise
                    log.info("zero3: %s refuses O_DIRECT; buffered I/O instead", self.folder)
                    self.fd = os.open(self.path, flags, 0o600)
            else:
                self.fd = os.open(self.path, flags, 0o600)
        except OSError as error:
            raise OffloadError(
                error.errno,
                f"zero3: cannot open the offload file {self.path!r}: {error.strerror}; "
                "pass a writable folder",
            ) from error
        # nothing on disk outlives the descriptor: not this run's end, a crash or a kill -9
        os.unlink(self.path)
        if private:
            os.rmdir(self.folder)
            self.folder = os.path.dirname(self.folder)  # where the space comes from
        self.size = 0
        self.reserved = 0  # bytes preallocated by ``reserve`` (from 0)
        self.slots = 2 if double_buffer else 1
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="zero3-io")
        self.staging_bytes = _aligned(int(staging_mb * 2**20))
        self.staging: list[torch.Tensor] = []
        self.free_staging = threading.Semaphore(staging_buffers)
        if self.o_direct:
            for _ in range(staging_buffers):
                raw = torch.empty(self.staging_bytes + ALIGN, dtype=torch.uint8)
                shift = (-raw.data_ptr()) % ALIGN
                self.staging.append(raw[shift : shift + self.staging_bytes])
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_seconds = 0.0  # time the I/O threads spent reading and writing
        self.wait_seconds = 0.0  # time training waited for them (I/O not hidden by compute)
        self.sources: dict[tuple, SourceFile] = {}  # checkpoint files regions read from

    def count_wait(self, seconds: float) -> None:
        with self.lock:
            self.wait_seconds += seconds

    # ------------------------------------------------------------------ allocation

    def allocate(self, nbytes: int, slots: int | None = None) -> Region:
        """Preallocated slots of ``nbytes`` (two: a new version is written beside the current
        one; one: rewritten in place, or never rewritten; default: the store's
        ``double_buffer``); raises ``OffloadError`` naming the bytes needed."""
        slots = self.slots if slots is None else slots
        slot = _aligned(max(nbytes, 1))
        with self.lock:
            first = self.size
            self.size += slots * slot
            if self.size <= self.reserved:  # inside what ``reserve`` preallocated
                return Region((first, first + slot * (slots - 1)), nbytes)
            try:
                os.posix_fallocate(self.fd, first, slots * slot)
            except OSError as error:
                self.size = first
                raise OffloadError(
                    error.errno,
                    f"zero3: cannot reserve {slots * slot} bytes in {self.path!r} "
                    f"({error.strerror}); {_free_space(self.folder)}",
                ) from error
        return Region((first, first + slot * (slots - 1)), nbytes)

    def reserve(self, sizes: list[int]) -> None:
        """Preallocate, with one ``posix_fallocate``, the regions that ``allocate`` will be asked
        for next (``sizes``: their ``nbytes``, default slots): a loader allocating tensor by
        tensor while the I/O threads write would otherwise wait for each write to release the
        file (ext4 serialises fallocate and writes on the inode)."""
        total = sum(self.slots * _aligned(max(n, 1)) for n in sizes)
        with self.lock:
            if total == 0 or self.reserved > self.size:
                return
            try:
                os.posix_fallocate(self.fd, self.size, total)
            except OSError as error:
                raise OffloadError(
                    error.errno,
                    f"zero3: cannot reserve {total} bytes in {self.path!r} ({error.strerror}); "
                    f"{_free_space(self.folder)}",
                ) from error
            self.reserved = self.size + total

    # ------------------------------------------------------------------ I/O

    def write(self, region: Region, tensor: torch.Tensor) -> None:
        """Write ``tensor`` into the region's free slot; ``commit(region)`` makes it current."""
        slot = region.pending = 1 - region.current  # set first: see ``write_part``
        self._transfer(tensor, region.offsets[slot], region.nbytes, write=True)

    def write_current(
        self, region: Region, tensor: torch.Tensor, non_blocking: bool = False
    ) -> None:
        """Overwrite the current slot (values that are not a new version, e.g. initial ones);
        synchronous whatever ``non_blocking`` says (the host store's copies may not be)."""
        self._transfer(tensor, region.read_offset, region.nbytes, write=True)
        region.source = None

    def write_current_async(self, region: Region, tensor: torch.Tensor) -> Future:
        """``write_current`` on the I/O threads (``tensor`` must stay alive and unchanged until
        the future is done)."""
        return self.pool.submit(self.write_current, region, tensor)

    def source_file(self, path: str, identity: tuple) -> SourceFile | None:
        """The store's ``SourceFile`` of the file at ``path`` whose identity (``file_identity``) a
        loader read it with; None if the file at ``path`` is another one now."""
        with self.lock:
            file = self.sources.get(identity)
            if file is None:
                try:
                    file = SourceFile(path)
                except OSError:  # gone since it was read: the values are written instead
                    return None
                if file.identity != identity:
                    os.close(file.fd)
                    return None
                self.sources[identity] = file
            return file

    def leave_in_file(self, region: Region, rows: FileRows) -> None:
        """The region's current values are ``rows`` of a file (see ``FileRows``), not written."""
        region.source = rows

    def read(self, region: Region, out: torch.Tensor) -> None:
        self._read_current(region.source, region.read_offset, out, 0, region.nbytes)

    def read_async(self, region: Region, out: torch.Tensor) -> Future:
        # the committed values at the time of the request
        source, offset = region.source, region.read_offset
        return self.pool.submit(self._read_current, source, offset, out, 0, region.nbytes)

    def _read_current(
        self, source: FileRows | None, offset: int, out: torch.Tensor, start: int, nbytes: int
    ) -> None:
        if source is None:
            self._transfer(out, offset + start, nbytes, write=False)
            return
        if out.device.type != "cpu":  # accelerator memory: through host memory
            staged = torch.empty_like(out, device="cpu")
            self._read_current(source, offset, staged, start, nbytes)
            out.copy_(staged)
            return
        if out.numel() * out.element_size() != nbytes or not out.is_contiguous():
            raise OffloadError(
                errno.EINVAL,
                f"zero3: offload read of {nbytes} bytes from {source.file.path!r} got a tensor "
                f"of {out.numel() * out.element_size()} bytes",
            )
        began = time.perf_counter()
        try:
            read = source.read_into(out, start)
        finally:
            with self.lock:
                self.io_seconds += time.perf_counter() - began
        with self.lock:
            self.bytes_read += read

    def write_async(self, region: Region, tensor: torch.Tensor) -> Future:
        slot = 1 - region.current
        region.pending = slot
        return self.pool.submit(self._transfer, tensor, region.offsets[slot], region.nbytes, True)

    def read_part(self, region: Region, out: torch.Tensor, start: int) -> None:
        """Read ``out``'s bytes from byte ``start`` of the region's current slot."""
        nbytes = _part_bytes(region, out, start)
        self._read_current(region.source, region.read_offset, out, start, nbytes)

    def write_part(self, region: Region, tensor: torch.Tensor, start: int) -> None:
        """Write ``tensor`` at byte ``start`` of the region's free slot (the parts of one new
        version, in any order, then ``commit(region)``)."""
        nbytes = _part_bytes(region, tensor, start)
        # pending before the transfer: a one-slot region a failed write went over is then
        # marked lost by ``discard``, not read as if it held its previous values
        slot = region.pending = 1 - region.current
        self._transfer(tensor, region.offsets[slot] + start, nbytes, write=True)

    def _transfer(self, tensor: torch.Tensor, offset: int, nbytes: int, write: bool) -> None:
        if tensor.device.type != "cpu":  # accelerator memory: through host memory
            staged = tensor.to("cpu") if write else torch.empty_like(tensor, device="cpu")
            self._transfer(staged, offset, nbytes, write)
            if not write:
                tensor.copy_(staged)
            return
        if tensor.numel() * tensor.element_size() != nbytes or not tensor.is_contiguous():
            raise OffloadError(
                errno.EINVAL,
                f"zero3: offload {'write' if write else 'read'} of {nbytes} bytes at {offset} in "
                f"{self.path!r} got a tensor of {tensor.numel() * tensor.element_size()} bytes",
            )
        if nbytes == 0:
            return
        start = time.perf_counter()
        try:
            if self.o_direct:
                self._transfer_direct(tensor, offset, nbytes, write)
            else:
                self._transfer_buffered(tensor, offset, nbytes, write)
        finally:
            with self.lock:
                self.io_seconds += time.perf_counter() - start

    def _transfer_buffered(
        self, tensor: torch.Tensor, offset: int, nbytes: int, write: bool
    ) -> None:
        self._move(_memory(tensor), offset, write, nbytes)
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes

    def _transfer_direct(self, tensor: torch.Tensor, offset: int, nbytes: int, write: bool) -> None:
        """O_DIRECT: a tensor whose memory is aligned (``aligned_empty``) moves straight between
        its memory and the file, but for a tail shorter than a block; the rest goes through the
        staging buffers (a copy)."""
        flat = tensor.view(-1).view(torch.uint8) if tensor.dtype != torch.uint8 else tensor.view(-1)
        direct = 0
        if tensor.data_ptr() % ALIGN == 0 and offset % ALIGN == 0:
            direct = nbytes // ALIGN * ALIGN
        if direct:
            self._move(_memory(flat[:direct]), offset, write, nbytes, block=ALIGN)
        if nbytes > direct:
            self._staged(flat[direct:], offset + direct, nbytes - direct, write)
        if write:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes

    def _move(self, view: memoryview, offset: int, write: bool, whole: int, block: int = 1):
        """All of ``view`` written at (or read from) ``offset``, call by call (a call may move
        fewer bytes; with O_DIRECT each a multiple of ``block``). ``whole``: the transfer's
        size, for the error."""
        done = 0
        while done < len(view):
            try:
                if write:
                    n = os.pwritev(self.fd, [view[done:]], offset + done)
                else:
                    n = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as error:
                raise self._io_error(error, write, offset, whole) from error
            if n <= 0 or n % block:
                raise OffloadError(
                    errno.EIO,
                    f"zero3: short {'write' if write else 'read'} in {self.path!r}: "
                    f"{done + max(n, 0)} of {whole} bytes at offset {offset}",
                )
            done += n

    def _staged(self, flat: torch.Tensor, offset: int, nbytes: int, write: bool) -> None:
        """O_DIRECT through an aligned staging buffer (a copy per chunk)."""
        self.free_staging.acquire()
        with self.lock:
            buffer = self.staging.pop()
        try:
            done = 0
            while done < nbytes:
                chunk = min(self.staging_bytes, nbytes - done)
                span = _aligned(chunk)
                view = _memory(buffer[:span])
                try:
                    if write:
                        buffer[:chunk].copy_(flat[done : done + chunk])
                        n = os.pwritev(self.fd, [view], offset + done)
                    else:
                        n = os.preadv(self.fd, [view], offset + done)
                        flat[done : done + chunk].copy_(buffer[:chunk])
                except OSError as error:
                    raise self._io_error(error, write, offset, nbytes) from error
                if n < chunk:
                    raise OffloadError(
                        errno.EIO,
                        f"zero3: short {'write' if write else 'read'} in {self.path!r}: "
                        f"{done + max(n, 0)} of {nbytes} bytes at offset {offset}",
                    )
                done += chunk
        finally:
            with self.lock:
                self.staging.append(buffer)
            self.free_staging.release()

    def _io_error(self, error: OSError, write: bool, offset: int, nbytes: int) -> OffloadError:
        what = "write" if write else "read"
        extra = f"; {_free_space(self.folder)}" if error.errno == errno.ENOSPC else ""
        return OffloadError(
            error.errno,
            f"zero3: offload {what} of {nbytes} bytes at offset {offset} in {self.path!r} "
            f"failed: {error.strerror}{extra}",
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        try:
            os.close(self.fd)
        except OSError:
            pass
        for file in self.sources.values():
            if file.fd >= 0:
                os.close(file.fd)
                file.fd = -1


def _part_bytes(region: Region, tensor: torch.Tensor, start: int) -> int:
    """Bytes of a part of ``region`` from ``start`` (``ALIGN``-aligned: O_DIRECT transfers)."""
    nbytes = tensor.numel() * tensor.element_size()
    if start % ALIGN or start < 0 or start + nbytes > region.nbytes:
        raise OffloadError(
            errno.EINVAL,
            f"zero3: a part of {nbytes} bytes at {start} does not fit a region of "
            f"{region.nbytes} bytes at a {ALIGN}-byte boundary",
        )
    return nbytes


def _free_space(folder: str) -> str:
    try:
        stat = os.statvfs(folder)
        return f"{stat.f_bavail * stat.f_frsize} bytes free in {folder!r}"
    except OSError:
        return f"free space in {folder!r} unknown"


class HostStore:
    """Pinned host memory for tensors of an accelerator model (the "cpu" tier).

    ``slots``: buffers per region (two: a new version is written beside the current one);
    ``pin_memory=False``: pageable memory (slower copies, no pinned memory held)."""

    def __init__(self, slots: int = 2, pin_memory: bool = True) -> None:
        self.slots = slots
        self.pin_memory = pin_memory
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_seconds = 0.0
        self.wait_seconds = 0.0
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-host")

    def count_wait(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def allocate(self, nbytes: int, slots: int | None = None) -> Region:
        slots = self.slots if slots is None else slots
        region = Region((0, slots - 1), nbytes)
        region.buffers = [  # type: ignore[attr-defined]
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory) for _ in range(slots)
        ]
        return region

    def _slot(self, region: Region, slot: int) -> torch.Tensor:
        return region.buffers[slot]  # type: ignore[attr-defined]

    @staticmethod
    def _free_slot(region: Region) -> int:
        """The slot a new version goes to (a one-slot region is rewritten in place)."""
        return region.offsets[1 - region.current]

    def write(self, region: Region, tensor: torch.Tensor) -> None:
        slot = self._free_slot(region)
        self._slot(region, slot).copy_(tensor.reshape(-1).view(torch.uint8))
        region.pending = slot
        self.bytes_written += region.nbytes

    def write_current(
        self, region: Region, tensor: torch.Tensor, non_blocking: bool = False
    ) -> None:
        buffer = self._slot(region, region.current)
        buffer.copy_(tensor.reshape(-1).view(torch.uint8), non_blocking=non_blocking)
        self.bytes_written += region.nbytes

    def read(self, region: Region, out: torch.Tensor) -> None:
        out.view(-1).view(torch.uint8).copy_(self._slot(region, region.current), non_blocking=True)
        self.bytes_read += region.nbytes

    def read_part(self, region: Region, out: torch.Tensor, start: int) -> None:
        nbytes = _part_bytes(region, out, start)
        source = self._slot(region, region.current)[start : start + nbytes]
        out.view(-1).view(torch.uint8).copy_(source, non_blocking=True)
        self.bytes_read += nbytes

    def write_part(self, region: Region, tensor: torch.Tensor, start: int) -> None:
        nbytes = _part_bytes(region, tensor, start)
        slot = self._free_slot(region)
        self._slot(region, slot)[start : start + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        region.pending = slot
        self.bytes_written += nbytes

    def read_async(self, region: Region, out: torch.Tensor) -> Future:
        # ordered on the current stream: the copy cannot be read before it is done
        self.read(region, out)
        done: Future = Future()
        done.set_result(None)
        return done

    def write_async(self, region: Region, tensor: torch.Tensor) -> Future:
        self.write(region, tensor)
        done: Future = Future()
        done.set_result(None)
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=True)
