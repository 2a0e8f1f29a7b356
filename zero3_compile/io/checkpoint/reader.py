"""The verifying reader of a load: DCP reads through it, and each file is checked against the
manifest as it is read, so the checkpoint is read from the disk once.

A file up to ``READ_WHOLE_MAX`` is read whole into memory, hashed on the way, and checked before
DCP parses it; a larger one is hashed on a thread while DCP parses its items and checked when DCP
closes it (a parse that failed on it reported as the damage). Offloaded values DCP reads go to
their stores' free slots (``IncomingPlanner``, ``offload/incoming.py``); with ``staged``, the
values loaded into memory wait in buffers until the whole load succeeded.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem

from ..._torch.dtensor import local_tensor
from ...cluster import agree
from ...offload.incoming import IncomingWrites, incoming
from . import hashing
from .manifest import CheckpointCorruptError, check_file, content_problem, corrupt, rank_state_name
from .metadata import SafeFileSystemReader

# a load checks each file as it reads it when it can hold the values it loads into memory twice;
# else it checks every file first, and reads them again to load them
STAGED_MAX = 256 << 20
# a file up to this size is read whole into memory (hashed on the way) and checked before DCP
# parses it; a larger one is hashed on a thread beside the parse and checked when DCP closes it
READ_WHOLE_MAX = 64 << 20
_AHEAD_BYTES = 16 << 20  # of files read ahead of the one DCP parses (at least the next one)


class IncomingPlanner(DefaultLoadPlanner):
    """Items of offloaded values (``IncomingTensor``) are read into buffers of their own and
    written to their stores as they arrive (``offload/incoming.py``); the rest as DCP does, or,
    with ``staged`` (a list), into buffers copied in only once the whole load succeeded."""

    def __init__(self, writes: IncomingWrites, staged: list | None = None):
        super().__init__()
        self.writes = writes
        self.staged = staged

    def resolve_tensor(self, read_item):
        value = incoming(self.state_dict[read_item.dest_index.fqn])
        if value is None:
            target = super().resolve_tensor(read_item)
            if self.staged is None:
                return target
            buffer = torch.empty_like(target, memory_format=torch.contiguous_format)
            self.staged.append((target, buffer))
            return buffer
        return self.writes.target(value, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        value = incoming(self.state_dict[read_item.dest_index.fqn])
        if value is None:
            return super().commit_tensor(read_item, tensor)
        self.writes.arrived(value, read_item.dest_offsets, read_item.lengths, tensor)


class IncomingReader(SafeFileSystemReader):
    """Reads as DCP does (each file checked against ``manifest`` as it is opened, while
    ``verifying``), then waits for the stores' writes of what it read: a damaged file or a
    failed write fails DCP's read step, which every rank then raises."""

    def __init__(self, path: str, writes: IncomingWrites, manifest: dict[str, Any] | None):
        super().__init__(path)
        self.writes = writes
        if manifest is not None:
            self.fs = VerifyingFileSystem(path, manifest)

    def read_data(self, plan, planner):
        verifying = isinstance(self.fs, VerifyingFileSystem) and self.fs.verifying
        if verifying:
            order: dict[str, None] = {}  # the files in the order DCP opens them
            for item in plan.items:
                relative = self.storage_data[item.storage_index].relative_path
                order.setdefault(os.fspath(self.fs.concat_path(self.path, relative)))
            self.fs.read_ahead(list(order))
        try:
            done = super().read_data(plan, planner)
        finally:
            if verifying:
                self.fs.stop()
        self.writes.drain()
        return done


class VerifyingFileSystem(FileSystem):
    """A file of the checkpoint opened for reading is checked against the manifest as it is
    read, so the checkpoint is read from the disk once (``load_checkpoint``). A file of up to
    ``READ_WHOLE_MAX`` bytes is read whole into memory, hashed on the way, and checked before
    DCP parses it; a larger one is hashed on a thread while DCP parses the items it reads from
    it (the two share the page cache) and checked when DCP closes it, so no large file is held
    in the process (``load_checkpoint`` commits nothing until every rank read everything it
    needs from intact files)."""

    def __init__(self, root: str, manifest: dict[str, Any]) -> None:
        super().__init__()
        self.root = os.path.abspath(root)
        self.manifest = manifest
        self.verifying = True
        self.queue: collections.deque[str] = collections.deque()
        self.ahead: dict[str, tuple[Future, int]] = {}  # path -> its hashed_read, its size
        self.pool: ThreadPoolExecutor | None = None

    def read_ahead(self, paths: list[str]) -> None:
        """The files about to be opened, in order: each is read (and hashed) on a thread ahead
        of its turn, up to ``_AHEAD_BYTES`` of them (at least the next one), so the disk keeps
        reading while the files before it are parsed and copied."""
        self.queue.extend(paths)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="zero3-ckpt-read")
        self._top_up()

    def _start(self, path: str) -> tuple[Future, int]:
        size = self._size(path)
        keep = size <= READ_WHOLE_MAX
        if self.pool is None:  # a file opened outside a read step (the metadata): read first
            done: Future = Future()
            try:
                done.set_result(hashing.hashed_read(path, keep))
            except OSError as error:
                done.set_exception(error)
            return done, size
        return self.pool.submit(hashing.hashed_read, path, keep), size

    def _top_up(self) -> None:
        ahead = sum(size for _, size in self.ahead.values())
        while self.queue and (not self.ahead or ahead + self._size(self.queue[0]) <= _AHEAD_BYTES):
            path = self.queue.popleft()
            self.ahead[path] = self._start(path)
            ahead += self._size(path)

    def _size(self, path: str) -> int:
        name = os.path.relpath(os.path.abspath(path), self.root)
        return self.manifest["files"].get(name, {}).get("size", 0)

    def stop(self) -> None:
        self.queue.clear()
        for future, _ in self.ahead.values():
            future.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.ahead, self.pool = {}, None

    def _check(self, name: str, want: dict[str, Any], read: Future, cause=None) -> None:
        """Raise ``CheckpointCorruptError`` if the file ``read`` hashed is not as saved."""
        try:
            size, digest, _ = read.result()
        except OSError as error:
            reason = f"is unreadable ({type(error).__name__}: {error})"
        else:
            reason = content_problem(self.root, name, want, self.manifest["save_id"], size, digest)
        if reason is not None:
            raise corrupt(self.root, [(name, reason)]) from cause

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = os.path.relpath(os.path.abspath(os.fspath(path)), self.root)
        if not self.verifying or "r" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        want = self.manifest["files"].get(name)
        if want is None:
            raise corrupt(self.root, [(name, "is not in the manifest: no save wrote it")])
        if os.fspath(path) in self.queue:
            self.queue.remove(os.fspath(path))
        read, _ = self.ahead.pop(os.fspath(path), None) or self._start(os.fspath(path))
        if self.pool is not None:
            self._top_up()
        if want["size"] <= READ_WHOLE_MAX:  # read whole: checked before anything parses it
            self._check(name, want, read)
            yield _MemoryFile(read.result()[2])
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as error:  # what a damaged file does to the parse: named as the damage
            self._check(name, want, read, cause=error)
            raise
        self._check(name, want, read)


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory (no copy of them, as ``BytesIO`` makes)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self.data = data
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), len(self.data) - self.position))
        view[:n] = self.data[self.position : self.position + n]
        self.position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.data)}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position


def read_rank_state(
    path: str, rank: int, manifest: dict[str, Any] | None, verify_file: bool
) -> Any:
    name = rank_state_name(rank)
    where = os.path.join(path, name)
    if manifest is not None:
        record = manifest["files"].get(name)
        if record is None:
            return None
        if verify_file:
            reason = check_file(path, name, record, manifest["save_id"])
            if reason is not None:
                raise corrupt(path, [(name, reason)])
    elif not os.path.exists(where):
        return None
    with open(where, "rb") as f:
        return torch.load(io.BytesIO(f.read()), weights_only=True)


def verifies_on_read(state: dict[str, Any]) -> bool:
    """Whether a load checks each file as it reads it (``VerifyingFileSystem``): it then holds
    the values it loads into memory twice (``staged``) until every rank read everything and
    every file it read was intact. The same answer on every rank (the load verifies first on
    all, or on none)."""
    from torch.distributed.tensor import DTensor

    from ..._torch.pytree import tree_leaves

    in_memory = 0
    for value in tree_leaves(state):
        if isinstance(value, torch.Tensor) and incoming(value) is None:
            local = local_tensor(value) if isinstance(value, DTensor) else value
            in_memory += local.numel() * local.element_size()
    return all(agree(in_memory <= STAGED_MAX))


def raise_if_corrupt(error: BaseException, path: str) -> None:
    """A file some rank found damaged as it read it: the same ``CheckpointCorruptError`` on every
    rank (DCP raised its read step's failures on all of them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, CheckpointException):
        return
    problems = set()
    for failure in (getattr(error, "failures", {}) or {}).values():
        found = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(found, CheckpointCorruptError):
            problems.update(tuple(p) for p in found.problems)
    if problems:
        raise corrupt(path, sorted(problems)) from error
